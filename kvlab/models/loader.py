"""Load a local Hugging Face checkpoint folder (or a catalogue config with random weights).

A checkpoint folder holds config.json, one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, optionally generation_config.json (EOS ids) and tokenizer.json.
Nothing is downloaded. Weights are converted to the requested dtype as they are read; the model
is built on the meta device first so the weights are never held twice.

Random weights (``random_weights=True``) build the same model from any catalogue config, seeded,
initialised like Hugging Face (normal with ``initializer_range``, norms 1, biases 0), so
real-size memory and speed can be measured offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kvlab.catalog import load_config
from kvlab.models.llama import CausalLM, check_supported, inv_frequencies
from kvlab.spec import ConfigError, ModelSpec, spec_from_config

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
DEFAULT_DTYPE = "bf16"  # serving engines run 16-bit even for fp32 checkpoints
DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"  # bundled HF Llama checkpoint

# Keys some checkpoints carry that the model recomputes (old RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.lower()
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose fp32, bf16 or fp16")
    return DTYPES[key]


class TextTokenizer(Protocol):
    """What generation needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """tokenizer.json through the ``tokenizers`` library (special tokens added / skipped)."""

    is_fallback = False

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

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

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
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


@dataclass
class Loaded:
    model: CausalLM
    tokenizer: HFTokenizer | ByteTokenizer
    path: Path | None  # checkpoint folder, None for a catalogue config


def _eos_ids(folder: Path | None, cfg: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list)."""
    value = cfg.get("eos_token_id")
    if folder is not None and (folder / "generation_config.json").is_file():
        try:
            gen = json.loads((folder / "generation_config.json").read_text())
            value = gen.get("eos_token_id", value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{folder / 'generation_config.json'} is not valid JSON: {e}") from None
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{folder}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors weights (pass --random-weights to run "
                          f"the config with random weights)")
    return files


def _load_weights(model: CausalLM, folder: Path, dtype: torch.dtype, device: torch.device) -> None:
    expected = dict(model.state_dict())
    if model.spec.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in expected:
                    want = expected[key].shape
                    t = f.get_tensor(key)
                    if t.shape != want:
                        raise ConfigError(f"{file.name}: {key} has shape {tuple(t.shape)}, the config "
                                          f"implies {tuple(want)}")
                    state[key] = t.to(device=device, dtype=dtype)
                elif not (key.endswith(_IGNORED_SUFFIXES) or key == "lm_head.weight"):
                    unexpected.append(key)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise ConfigError(f"{folder}: weights do not match the config: {'; '.join(parts)}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()


@torch.no_grad()
def init_random_(model: CausalLM, seed: int = 0, std: float | None = None) -> None:
    """Hugging Face's init: Linear/Embedding ~ N(0, initializer_range), biases 0, norms 1."""
    std = std if std is not None else float(model.config.get("initializer_range") or 0.02)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def build_model(spec: ModelSpec, dtype: str | torch.dtype = DEFAULT_DTYPE, device: str = "cpu",
                random_weights: bool = False, seed: int = 0) -> CausalLM:
    """An empty (meta) model, or one with seeded random weights, in ``dtype`` on ``device``."""
    check_supported(spec)
    dt = torch_dtype(dtype)
    with torch.device("meta"):  # no memory yet: never materialise fp32 weights for a bf16 model
        model = CausalLM(spec).to(dt)
    if random_weights:
        model.to_empty(device=device)
        model.tie_weights()
        init_random_(model, seed)
    # Otherwise weights arrive through load_state_dict(assign=True). RoPE stays float32.
    model.inv_freq = inv_frequencies(spec.config, spec.layers[0].head_dim).to(device)
    return model.eval()


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load(model: str | Path, dtype: str | torch.dtype = DEFAULT_DTYPE, *, device: str | None = "cpu",
         random_weights: bool = False, seed: int = 0) -> Loaded:
    """Load a checkpoint folder, or build a random-weight model from any config.

    ``model`` is a checkpoint folder, a config.json, or (with ``random_weights``) a catalogue
    name. Raises ConfigError / UnsupportedModelError / ValueError with a one-line message.
    """
    dev = resolve_device(device)
    path = Path(model).expanduser()
    folder = path if path.is_dir() else (path.parent if path.is_file() else None)
    if folder is None and not random_weights:
        cfg, _ = load_config(str(model))  # raises for unknown names
        raise ConfigError(f"{model!r} is a catalogue config without weights: pass --random-weights "
                          f"(random_weights=True), or a checkpoint folder")
    cfg, name = load_config(str(model))
    spec = spec_from_config(cfg, name)
    check_supported(spec)
    built = build_model(spec, dtype, dev, random_weights=random_weights, seed=seed)
    if not random_weights:
        assert folder is not None
        _load_weights(built, folder, torch_dtype(dtype), torch.device(dev))
    built.eos_token_ids = _eos_ids(folder, spec.config)
    tok_file = folder / "tokenizer.json" if folder is not None else None
    tokenizer: HFTokenizer | ByteTokenizer
    if tok_file is not None and tok_file.is_file():
        tokenizer = HFTokenizer(tok_file)
    else:
        tokenizer = ByteTokenizer(spec.vocab_size)
    return Loaded(built, tokenizer, folder)


def load_model(model: str | Path, dtype: str | torch.dtype = DEFAULT_DTYPE, **kwargs) -> CausalLM:
    """Just the model (see ``load``)."""
    return load(model, dtype, **kwargs).model
