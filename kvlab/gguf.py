"""GGUF files (llama.cpp's checkpoint format): config, weights, tokenizer and chat template.

One file holds everything a Hugging Face folder spreads over config.json, *.safetensors,
tokenizer.json and tokenizer_config.json. llama.cpp's own reader (the ``gguf`` package) parses
it and dequantises every quantisation type; this module only translates names:

- metadata ``{arch}.block_count``, ``{arch}.attention.head_count``... become a config.json dict,
  so the planner, the runtime and the engine read a GGUF model through the same ModelSpec;
- tensors ``blk.N.attn_q.weight``... become the runtime's Hugging Face names, dequantised to
  float32 one tensor at a time (the caller converts each to the run dtype before the next is
  read, so the model is never held twice), with llama.cpp's Q/K row permutation undone;
- ``tokenizer.ggml.*`` becomes a ``tokenizers.Tokenizer`` (byte-level BPE, or SentencePiece's
  BPE with byte fallback for ``llama``-model vocabularies such as Gemma's);
- Gemma 3's norms go back to Hugging Face's form: llama.cpp's converter stores 1 + w.

``export_folder`` writes the dequantised file as a Hugging Face checkpoint folder, so that
transformers can run the very weights kvlab runs (the parity checks).

Nothing here imports torch: ``kvlab plan FILE.gguf`` stays light.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.dtypes import GGUF_AS_STORED
from kvlab.spec import ConfigError, StoredWeights

MAGIC = b"GGUF"

# GGUF architecture -> (config.json model_type, HF architecture class). Mistral-style models are
# converted to "llama" by llama.cpp; Qwen2/3 keep their names.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

# Per-layer tensors: GGUF name -> runtime (HF) name under model.layers.N.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 normalises around attention and MLP: ffn_norm is the norm before the MLP there.
_GEMMA3_TENSORS = {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                   "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
# What llama.cpp's gemma3 loader fixes rather than stores: every 6th layer global, the others
# sliding with RoPE base 10,000, queries scaled by head_dim (llama-model.cpp; its 27B alone
# scales by hidden/heads, which a GGUF does not record: kvlab takes key_length).
_GEMMA3_PATTERN, _GEMMA3_LOCAL_BASE = 6, 10000.0
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}

# Pre-tokenizer regexes per ``tokenizer.ggml.pre``, as llama.cpp defines them (llama-vocab.cpp).
# "gpt2"-style names need no Split: the ByteLevel pre-tokenizer applies GPT-2's own regex.
_GPT2_STYLE = {"default", "gpt2", "gpt-2"}
_DIGITS_THEN_GPT2 = {"smollm"}  # every digit alone, then GPT-2's regex (SmolLM's tokenizer.json)
_SPLITS = {
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
_SPLITS["llama3"] = _SPLITS["llama-v3"] = _SPLITS["llama-bpe"]
PRE_TOKENIZERS = sorted(_GPT2_STYLE | _DIGITS_THEN_GPT2 | set(_SPLITS))
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types
_SPACE = "\u2581"  # SentencePiece's visible space


def is_gguf(path: str | Path) -> bool:
    """A file meant as GGUF: it starts with the GGUF magic or is named *.gguf (then opening it
    says what is wrong with it, rather than a JSON reader)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with p.open("rb") as f:
        return f.read(4) == MAGIC


@lru_cache(maxsize=1)
def _reader_class(gguf):
    class Reader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of the mapped file: the same bytes, but slicing
        skips np.memmap's per-slice bookkeeping, which made parsing a 49k-word vocabulary take
        5.4 s instead of 2.0 s here."""

        def _get(self, offset, dtype, count=1, override_order=None):
            if isinstance(self.data, np.memmap):
                self.data = self.data.view(np.ndarray)  # keeps the mapping alive through .base
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs, raw_type):
            """Arrays of strings or numbers (the vocabulary, merges and token types: 147k items
            in the default model) read in one pass: the parts the package's own loop builds (per
            item a length and the bytes, or a one-item array), without its two ``_get`` calls
            and a recursion per item, which took seconds."""
            array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
            if raw_type != array or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            itype = gguf.GGUFValueType(raw_itype[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if itype != string and nptype is None:  # arrays of arrays
                return super()._get_field_parts(orig_offs, raw_type)
            alen = self._get(orig_offs + 4, np.uint64)
            count, offs, parts = int(alen[0]), orig_offs + 12, [raw_itype, alen]
            if itype == string:
                data, view = self.data, memoryview(self.data)
                for _ in range(count):
                    n = int.from_bytes(view[offs:offs + 8], "little")
                    parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + n])
                    offs += 8 + n
                idxs = list(range(3, len(parts), 2))
            else:
                values = self._get(offs, nptype, count)
                parts += (values[i:i + 1] for i in range(count))
                offs += int(values.nbytes)
                idxs = list(range(2, len(parts)))
            return offs - orig_offs, parts, idxs, [gguf.GGUFValueType(raw_type)] + ([itype] if count else [])

    return Reader


def open_gguf(path: str | Path) -> GGUFFile:
    """The file, opened once per process while it stays unchanged (reading the metadata of a
    49k-token vocabulary takes seconds)."""
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        return GGUFFile(p)  # raises the one-line error
    st = p.stat()
    return _open_cached(p, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def _is_blocks(tensor: Any, types: Collection[str]) -> bool:
    """Whether a tensor of the file can be held as its stored blocks: a weight matrix in one of
    ``types`` (a ``gguf.ReaderTensor``)."""
    return len(tensor.shape) == 2 and tensor.tensor_type.name in types


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows for its interleaved RoPE.

    llama.cpp's converter regroups each head's rows from Hugging Face's halves layout
    (x0..x31 | x32..x63, rotated as pairs (i, i+32)) into adjacent pairs (x0, x32, x1, x33...);
    the runtime rotates halves, so the rows go back: per head, [pairs][2] -> [2][pairs].
    """
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """One GGUF checkpoint, opened lazily (memory-mapped by the gguf package)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # llama.cpp's reader; imported here so the rest of kvlab loads without it

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: no such file")
        with self.path.open("rb") as f:
            magic = f.read(4)
        if magic != MAGIC:
            raise ConfigError(f"{self.path}: not a GGUF file (it does not start with the GGUF magic)")
        try:
            self.reader = _reader_class(gguf)(str(self.path))
        except (ValueError, KeyError, IndexError, OSError) as e:
            raise ConfigError(f"{self.path}: unreadable GGUF file (truncated or corrupt: {e})") from None
        size = self.path.stat().st_size
        end = max((t.data_offset + int(t.n_bytes) for t in self.reader.tensors), default=0)
        if end > size:
            raise ConfigError(f"{self.path}: truncated GGUF file: tensors end at byte {end:,}, the "
                              f"file has {size:,}")
        self._gguf = gguf

    # --- metadata ---------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def strings(self, key: str) -> list[str]:
        """A string array (vocabulary, merges) without the per-item overhead of ``contents()``."""
        field = self.reader.fields.get(key)
        if field is None:
            return []
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]

    def ints(self, key: str) -> list[int]:
        field = self.reader.fields.get(key)
        if field is None:
            return []
        return [int(field.parts[i][0]) for i in field.data]

    def floats(self, key: str) -> list[float]:
        field = self.reader.fields.get(key)
        if field is None:
            return []
        return [float(field.parts[i][0]) for i in field.data]

    @cached_property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{self.path.name}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)} (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3)")
        return arch

    @property
    def name(self) -> str:
        return self.path.stem

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def _require(self, key: str) -> Any:
        value = self._arch(key)
        if value is None:
            raise ConfigError(f"{self.path.name}: GGUF metadata lacks {self.architecture}.{key}")
        return value

    def config(self) -> dict[str, Any]:
        """The model's hyper-parameters as a Hugging Face config.json dict."""
        arch = self.architecture
        model_type, hf_class = ARCHITECTURES[arch]
        tensors = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in tensors:
            raise ConfigError(f"{self.path.name}: per-dimension RoPE factors (rope_freqs, Llama 3.1-style "
                              f"scaling in GGUF) are not supported yet")
        heads = int(self._require("attention.head_count"))
        hidden = int(self._require("embedding_length"))
        ffn = self._require("feed_forward_length")
        if not isinstance(ffn, int):
            raise ConfigError(f"{self.path.name}: per-layer feed_forward_length is not supported")
        vocab = self._arch("vocab_size") or len(self.reader.fields.get("tokenizer.ggml.tokens").data)
        cfg: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(ffn),
            "num_hidden_layers": int(self._require("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": int(self._arch("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self._require("context_length")),
            # stored as float32: its shortest spelling (1e-05, not 9.999999747378752e-06)
            "rms_norm_eps": float(str(np.float32(self._arch("attention.layer_norm_rms_epsilon", 1e-6)))),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "vocab_size": int(vocab),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors and model_type == "llama",
            "torch_dtype": "bfloat16",
        }
        scaling = self._arch("rope.scaling.type")
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(self._arch("rope.scaling.factor", 1.0))}
        window = self._arch("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
        if arch == "gemma3":
            cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg["head_dim"],
                       sliding_window_pattern=_GEMMA3_PATTERN, rope_local_base_freq=_GEMMA3_LOCAL_BASE)
            del cfg["hidden_act"]
        for key in ("bos_token_id", "eos_token_id"):
            value = self.get(f"tokenizer.ggml.{key}")
            if value is not None:
                cfg[key] = int(value)
        return cfg

    @cached_property
    def stored_weights(self) -> StoredWeights:
        """The file's bytes and types, and the bytes kvlab's engine holds running it on the CPU:
        the matrices it keeps as their blocks (``blocks``) as in the file, every other tensor
        dequantised to fp32, 4 B an element. Each tensor counts once, as the loader holds it: a
        tied LM head has no tensor of its own in a GGUF file (it reads the embedding's)."""
        formats: dict[str, int] = {}
        held = 0
        for t in self.reader.tensors:
            formats[t.tensor_type.name] = formats.get(t.tensor_type.name, 0) + 1
            held += int(t.n_bytes) if _is_blocks(t, GGUF_AS_STORED) else int(t.n_elements) * 4
        return StoredWeights(sum(int(t.n_bytes) for t in self.reader.tensors), formats, held)

    # --- tensors ----------------------------------------------------------------------------------
    def runtime_name(self, name: str) -> str | None:
        """The runtime's name for a GGUF tensor name (None for tensors the runtime has no use for)."""
        stem, _, kind = name.rpartition(".")
        if stem.startswith("blk."):
            _, idx, part = stem.split(".", 2)
            target = (_GEMMA3_TENSORS if self.architecture == "gemma3" else _LAYER_TENSORS).get(part)
            return f"model.layers.{idx}.{target}.{kind}" if target else None
        target = _GLOBAL_TENSORS.get(stem)
        return f"{target}.{kind}" if target else None

    def _rows_permuted(self, gguf_name: str, data: np.ndarray) -> np.ndarray:
        """A tensor's rows in Hugging Face's order (llama.cpp permutes Llama's Q/K rows; rows are
        independent, so stored blocks [rows, bytes] go back the same way as values)."""
        if self.architecture != "llama":  # qwen2/qwen3/gemma3 GGUFs keep HF's row order
            return data
        cfg = self.config()
        if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rope_rows(data, cfg["num_attention_heads"])
        if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rope_rows(data, cfg["num_key_value_heads"])
        return data

    def blocks(self, types: set[str]) -> Iterator[tuple[str, str, np.ndarray]]:
        """(runtime name, GGUF type, the stored blocks [rows, bytes per row] as uint8 in Hugging
        Face's row order, a copy in memory) of each weight matrix stored in one of ``types``."""
        for t in self.reader.tensors:
            name = self.runtime_name(t.name)
            if name is not None and _is_blocks(t, types):
                data = np.asarray(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1)
                yield name, t.tensor_type.name, np.array(self._rows_permuted(t.name, data), copy=True, order="C")

    def tensors(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, np.ndarray]]:
        """(runtime name, float32 array in Hugging Face's [out, in] layout), one at a time, but
        for the runtime names in ``skip`` (held as stored blocks instead, see ``blocks``)."""
        norm_shift = self.architecture == "gemma3"  # stored as 1 + w (llama.cpp's converter)
        for t in self.reader.tensors:
            name = self.runtime_name(t.name)
            if name is None:
                raise ConfigError(f"{self.path.name}: unexpected tensor {t.name} for a "
                                  f"{self.architecture} model")
            if name in skip:
                continue
            try:
                data = self._gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ConfigError(f"{self.path.name}: {t.name}: {e}") from None
            data = np.asarray(data, dtype=np.float32)
            if not data.flags.writeable:  # an F32 tensor is a read-only view of the mapped file
                data = data.copy()
            data = self._rows_permuted(t.name, data)
            if norm_shift and t.name.endswith("norm.weight"):
                data -= 1.0
            yield name, data

    # --- tokenizer --------------------------------------------------------------------------------
    def tokenizer(self):  # -> tokenizers.Tokenizer (import kept local: tokenizers is optional here)
        """The file's vocabulary as a ``tokenizers`` Tokenizer: byte-level BPE with the file's
        merges and llama.cpp's pre-tokenizer for ``tokenizer.ggml.pre`` ("gpt2" model), or
        SentencePiece BPE ("llama" model, see ``_sentencepiece``); control tokens as special
        tokens, BOS/EOS added as ``add_bos_token`` / ``add_eos_token`` say."""
        from tokenizers import AddedToken, Tokenizer, processors

        kind = self.get("tokenizer.ggml.model")
        tokens = self.strings("tokenizer.ggml.tokens")
        types = self.ints("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if kind == "gpt2":
            tok = self._byte_level(tokens)
        elif kind == "llama":
            tok = self._sentencepiece(tokens, types)
        else:
            raise ConfigError(f"{self.path.name}: tokenizer model {kind!r} is not supported (byte-level "
                              f"BPE 'gpt2' and SentencePiece BPE 'llama' only)")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        add_bos = bool(self.get("tokenizer.ggml.add_bos_token", False)) and self.special_token("bos")
        add_eos = bool(self.get("tokenizer.ggml.add_eos_token", False)) and self.special_token("eos")
        if add_bos or add_eos:
            marks = [(self.special_token(k), int(self.get(f"tokenizer.ggml.{k}_token_id")))
                     for k, on in (("bos", add_bos), ("eos", add_eos)) if on]
            single = ([marks[0][0]] if add_bos else []) + ["$A"] + ([marks[-1][0]] if add_eos else [])
            tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=marks)
        return tok

    def _byte_level(self, tokens: list[str]):  # -> tokenizers.Tokenizer
        """GPT-2-style byte-level BPE: the file's merges, llama.cpp's pre-tokenizer regex."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        pre = self.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ConfigError(f"{self.path.name}: pre-tokenizer {pre!r} is not supported; supported: "
                              f"{', '.join(PRE_TOKENIZERS)}")
        merges = [tuple(m.split(" ", 1)) for m in self.strings("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
        if pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level])
        elif pre in _DIGITS_THEN_GPT2:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        return tok

    def _sentencepiece(self, tokens: list[str], types: list[int]):  # -> tokenizers.Tokenizer
        """SentencePiece BPE as llama.cpp runs it (its "llama" vocabularies, e.g. Gemma's):
        spaces become U+2581, then the adjacent pair whose union is the highest-scoring piece
        merges first; characters outside the vocabulary fall back to <0xNN> byte pieces. The
        file has scores, not merges; as ranked BPE merges that rule is every split of every
        normal piece into two pieces, ranked by the whole piece's score."""
        from tokenizers import Tokenizer, decoders, models, normalizers

        if self.get("tokenizer.ggml.add_space_prefix", True):
            raise ConfigError(f"{self.path.name}: SentencePiece vocabularies with add_space_prefix "
                              f"(Llama 2 style) are not supported yet")
        scores = self.floats("tokenizer.ggml.scores") or [0.0] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        ranked = sorted((-scores[i], i, t[:k], t[k:]) for t, i in vocab.items() if types[i] == _NORMAL
                        for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab)
        unk = self.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab, [(a, b) for _, _, a, b in ranked], byte_fallback=True,
                                   unk_token=None if unk is None else tokens[int(unk)]))
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        return tok

    def special_token(self, key: str) -> str:
        """The text of a special token (``bos``, ``eos``) or '' if the file names none."""
        idx = self.get(f"tokenizer.ggml.{key}_token_id")
        field = self.reader.fields.get("tokenizer.ggml.tokens")
        if idx is None or field is None or not 0 <= int(idx) < len(field.data):
            return ""
        return bytes(field.parts[field.data[int(idx)]]).decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        return self.get("tokenizer.chat_template")

    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS and end-of-turn ids: generation stops at either."""
        ids = [self.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def export_folder(gguf_file: GGUFFile, folder: str | Path) -> Path:
    """Write the file as a Hugging Face checkpoint folder: config.json, the dequantised weights
    (float32) in model.safetensors under the runtime's names, tokenizer.json and
    generation_config.json (EOS ids). transformers then runs exactly the weights kvlab runs."""
    import json

    from safetensors.numpy import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(gguf_file.config(), indent=2))
    save_file(dict(gguf_file.tensors()), str(out / "model.safetensors"))
    gguf_file.tokenizer().save(str(out / "tokenizer.json"))
    tok_cfg = {"bos_token": gguf_file.special_token("bos"), "eos_token": gguf_file.special_token("eos")}
    if gguf_file.chat_template:
        tok_cfg["chat_template"] = gguf_file.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(gguf_file.eos_token_ids())}))
    return out
