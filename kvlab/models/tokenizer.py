"""Tokenizers: a ``tokenizers`` Tokenizer (from tokenizer.json or a GGUF file's vocabulary), or
the byte fallback for configs that come without one."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer


class TextTokenizer(Protocol):
    """What generation needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """A ``tokenizers`` Tokenizer: special tokens (BOS...) added on encode, skipped on decode."""

    is_fallback = False

    def __init__(self, tokenizer: Tokenizer | str | Path, source: str = "tokenizer.json") -> None:
        self._tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.from_file(str(tokenizer))
        self.source = source  # where the vocabulary came from, for reports

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class ByteTokenizer:
    """Fallback when there is no tokenizer (catalogue configs with random weights).

    The prompt's UTF-8 bytes become ids (byte % vocab); ids < 256 decode back to bytes, others
    show as ``<id>``. Deterministic and honest, not a real tokenizer.
    """

    is_fallback = True
    source = "byte fallback"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(f"<{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)
