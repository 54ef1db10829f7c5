"""kvlab's own model runtime: plain PyTorch decoders over flat tokens + pluggable attention.

    from kvlab.models import load, ContiguousKVCache
    loaded = load("path/to/checkpoint", "bf16")
"""

from kvlab.models.attention import AttentionBackend, ContiguousKVCache, NoCache
from kvlab.models.chat import ChatTemplate, ChatTemplateError
from kvlab.models.llama import SUPPORTED_TYPES, CausalLM, UnsupportedModelError, check_supported
from kvlab.models.loader import (DtypeChoice, Loaded, build_model, choose_dtype, load, load_model, load_options,
                                 torch_dtype)
from kvlab.models.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer

__all__ = [
    "AttentionBackend", "ByteTokenizer", "CausalLM", "ChatTemplate", "ChatTemplateError",
    "ContiguousKVCache", "DtypeChoice", "HFTokenizer", "Loaded", "NoCache", "SUPPORTED_TYPES", "TextTokenizer",
    "UnsupportedModelError", "build_model", "check_supported", "choose_dtype", "load", "load_model", "load_options",
    "torch_dtype",
]
