"""Chat messages to prompt text, through the checkpoint's own Jinja2 chat template.

Instruction-tuned checkpoints ship their prompt format as ``chat_template`` in
tokenizer_config.json (or chat_template.jinja beside it); applying anything else would feed the
model text it was never trained on. A checkpoint without one (the bundled demo model, random-weight
test models) gets ``DEFAULT_TEMPLATE``: plain ``role: text`` lines, which a small model trained on
plain text continues sensibly. Templates run in Jinja2's sandbox, as transformers does, because
they come from downloaded files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlab.server.errors import APIError

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value: object) -> str:
    """Special tokens in tokenizer_config.json are a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A compiled chat template plus the special tokens templates refer to."""

    def __init__(self, source: str = DEFAULT_TEMPLATE, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self.source = source
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @staticmethod
    def _raise(message: str) -> None:
        raise APIError(f"chat template: {message}", param="messages")

    @classmethod
    def from_checkpoint(cls, folder: Path | None) -> ChatTemplate:
        """The checkpoint's template if it has one, else the default."""
        if folder is None:
            return cls()
        cfg: dict = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if not source and jinja_file.is_file():
            source = jinja_file.read_text()
        return cls(source or DEFAULT_TEMPLATE, _token_text(cfg.get("bos_token")),
                   _token_text(cfg.get("eos_token")))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except APIError:
            raise
        except (TemplateError, TypeError, ValueError) as e:
            raise APIError(f"chat template failed on these messages: {e}", param="messages") from None
