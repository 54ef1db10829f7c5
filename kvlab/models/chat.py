"""Chat messages to prompt text, through the checkpoint's own Jinja2 chat template.

Instruction-tuned checkpoints ship their prompt format as ``chat_template`` in
tokenizer_config.json (or chat_template.jinja beside it), or in a GGUF file's
``tokenizer.chat_template``; applying anything else would feed the
model text it was never trained on. A checkpoint without one (the Austen demo model, random-weight
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

from kvlab.gguf import GGUFFile
from kvlab.models.tokenizer import TextTokenizer

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value: object) -> str:
    """Special tokens in tokenizer_config.json are a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class ChatTemplateError(ValueError):
    """The template refused these messages (``raise_exception``) or failed on them."""


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
        raise ChatTemplateError(f"chat template: {message}")

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

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ChatTemplate:
        """A GGUF file's ``tokenizer.chat_template``, else the default."""
        return cls(gguf.chat_template or DEFAULT_TEMPLATE, gguf.special_token("bos"), gguf.special_token("eos"))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from None

    def encode(self, tokenizer: TextTokenizer, messages: Sequence[dict[str, str]],
               add_generation_prompt: bool = True) -> list[int]:
        """Messages -> template text -> ids. A tokenizer that adds BOS itself meets a template
        that may write it too: one BOS is kept, never two."""
        ids = tokenizer.encode(self.render(messages, add_generation_prompt))
        to_id = getattr(tokenizer, "token_to_id", None)  # the byte fallback has no special tokens
        bos_id = to_id(self.bos_token) if to_id is not None and self.bos_token else None
        if bos_id is not None and len(ids) > 1 and ids[0] == ids[1] == bos_id:
            ids = ids[1:]
        return ids
