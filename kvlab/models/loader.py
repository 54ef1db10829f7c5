"""Load a model: a GGUF file, a local Hugging Face checkpoint folder, a bundled model by name
(``smollm2-135m``, the default; ``austen-demo``), or a catalogue config with random weights.

A checkpoint folder holds config.json, one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, optionally generation_config.json (EOS ids) and tokenizer.json.
A GGUF file holds all of it (see ``kvlab.gguf``). Nothing is downloaded. Weights are converted to
the requested dtype as they are read, one tensor at a time; the model is built on the meta device
first so the weights are never held twice.

Random weights (``random_weights=True``) build the same model from any catalogue config, seeded,
initialised like Hugging Face (normal with ``initializer_range``, norms 1, biases 0), so
real-size memory and speed can be measured offline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from kvlab import dispatch
from kvlab.dispatch import Backends
from kvlab.catalog import DEFAULT_MODEL, gguf_file, load_config, model_path
from kvlab.models.chat import ChatTemplate
from kvlab.models.llama import CausalLM, WeightsSource, check_supported
from kvlab.models.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer
from kvlab.models.weights import ACT8_FORMATS, FORMATS, QuantEmbedding, QuantLinear
from kvlab.options import ACTIVATIONS, ModelOptions
from kvlab.spec import ConfigError, ModelSpec, spec_from_config

if TYPE_CHECKING:
    from kvlab.gguf import GGUFFile

__all__ = ["ByteTokenizer", "DtypeChoice", "HFTokenizer", "Loaded", "TextTokenizer", "WeightsChoice",
           "build_model", "choose_dtype", "choose_weights", "load", "load_model", "torch_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
DEFAULT_DTYPE = ModelOptions.dtype  # "auto": the checkpoint's values exactly, fast on this device (choose_dtype)
WEIGHTS = ("auto", "as-stored", "dense")  # see choose_weights

# Keys some checkpoints carry that the model recomputes (old RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why, for every place that shows the dtype to a person."""

    dtype: torch.dtype
    why: str  # "auto: ..." when chosen for this device, else "as asked" (plus a warning if slow)

    @property
    def name(self) -> str:
        return _short_name(self.dtype)

    def __str__(self) -> str:
        return f"{self.name} ({self.why})"


def _short_name(dtype: torch.dtype) -> str:
    """fp32, bf16 or fp16: the first key of each dtype in DTYPES (the name of an unsupported
    dtype as torch prints it)."""
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype))


def stored_format(gguf: GGUFFile | None, folder: Path | None, cfg: dict) -> str:
    """How the checkpoint stores its weight matrices: ``fp32``, ``fp16``, ``bf16``, or a GGUF
    quantisation type (``Q4_1``...): the most common type among a GGUF file's matrices (any
    quantised one first), the safetensors files' most common dtype, or (random weights) the
    config's ``torch_dtype`` (fp32 where it names none, as transformers)."""
    if gguf is not None:
        kinds = [t.tensor_type.name for t in gguf.reader.tensors if len(t.shape) > 1]
        quantised = [k for k in kinds if k not in ("F32", "F16", "BF16")]
        common = max(set(quantised or kinds), key=(quantised or kinds).count)
        return {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(common, common)
    if folder is not None:
        counts: dict[str, int] = {}
        for file in _safetensors_files(folder):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    kind = f.get_slice(key).get_dtype()
                    counts[kind] = counts.get(kind, 0) + 1
        common = max(counts, key=counts.get) if counts else "F32"
        return {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(common, common.lower())
    named = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    return _short_name(DTYPES[named]) if named in DTYPES else named


def choose_dtype(name: str | torch.dtype, device: str = "cpu", stored: str = "fp32",
                 backends: Backends | None = None) -> DtypeChoice:
    """The model dtype for ``name`` on ``device``, for weights stored as ``stored``
    (``stored_format``). ``auto`` keeps the checkpoint's values exactly and gives the same tokens
    on every CPU: fp32, in which fp16, bf16 and every GGUF quantisation's values are exact (bf16
    would round a Q4_1 or fp16 weight: another model), and which kvlab's native kernels compute
    with the same instructions on every x86 CPU. bf16 results depend on the CPU's bf16 kernels
    (oneDNN's on AVX-512, none on AVX2, where a bf16 matmul runs ~100x slower than fp32), so bf16
    is on request. On a GPU: fp16 for an fp16 checkpoint, else bf16, as vLLM. An explicit name is
    taken as it is. ``backends``: what runs here (default ``kvlab.dispatch.backends()``)."""
    onednn = (backends or dispatch.backends()).onednn_bf16
    key = _short_name(name) if isinstance(name, torch.dtype) else name.lower()
    cpu = torch.device(device).type == "cpu"
    if key == "auto":
        if not cpu:
            dtype = torch.float16 if stored == "fp16" else torch.bfloat16
            return DtypeChoice(dtype, f"auto: {stored} weights on a {torch.device(device).type} device")
        if stored == "fp32":
            return DtypeChoice(torch.float32, "auto: fp32 weights")
        if stored != "bf16":
            return DtypeChoice(torch.float32, f"auto: {stored} weights, exact in fp32 (bf16 would round them)")
        if onednn:
            return DtypeChoice(torch.float32, "auto: bf16 weights, exact in fp32 and the same tokens on every "
                                              "CPU; --dtype bf16 runs faster here on oneDNN's bf16 kernels")
        return DtypeChoice(torch.float32, f"auto: bf16 weights, exact in fp32; bf16 matmuls are slow here: "
                                          f"{onednn.why}")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, fp32, bf16 or fp16")
    dtype = DTYPES[key]
    if dtype == torch.bfloat16 and cpu and not onednn:
        return DtypeChoice(dtype, f"as asked; slow here: {onednn.why}, "
                                  f"--dtype auto picks fp32")
    return DtypeChoice(dtype, "as asked")


@dataclass(frozen=True)
class WeightsChoice:
    """Which of the checkpoint's GGUF types the weight matrices keep as stored (none: all dense
    in the model's dtype), and why."""

    formats: frozenset[str]
    why: str

    def __str__(self) -> str:
        held = ", ".join(sorted(self.formats))
        return f"{held + ' as stored' if held else 'dense'} ({self.why})"


def choose_weights(name: str, gguf: GGUFFile | None, dtype: torch.dtype, device: str,
                   activations: str = "fp32") -> WeightsChoice:
    """How to hold the weight matrices. ``auto``: a GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and
    Q6_K matrices as stored where the native kernels run (fp32 on the CPU), the same values as
    dense fp32 at a quarter to a seventh of the bytes; everything else dense in ``dtype``. ``as-stored``: that,
    also where the kernels do not run (dequantised per call, slow), and ``auto`` with int8
    ``activations`` (the mode runs on stored layers only). ``dense``: every matrix in ``dtype``
    (today's fp32 for a GGUF file)."""
    if name not in WEIGHTS:
        raise ValueError(f"unknown --weights {name!r}; choose {', '.join(WEIGHTS)}")
    types = ({t.tensor_type.name for t in gguf.reader.tensors if len(t.shape) == 2}
             if gguf is not None else set())
    runnable = frozenset(types & set(FORMATS))
    others = sorted(types - runnable - {"F32", "F16", "BF16"})
    if name == "dense" or not runnable:
        why = "as asked" if name == "dense" else (
            "auto: no GGUF blocks" if not types else f"auto: kvlab runs {', '.join(FORMATS)} as stored, "
                                                     f"not {', '.join(others) or 'float tensors'}")
        return WeightsChoice(frozenset(), why)
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        if name == "as-stored":
            raise ValueError("--weights as-stored runs with fp32 activations on the CPU; drop --dtype "
                             "or --device, or pass --weights dense")
        return WeightsChoice(frozenset(), "auto: stored blocks run with fp32 activations on the CPU only")
    native = dispatch.backends().native
    if name == "auto" and not native and activations == "fp32":
        return WeightsChoice(frozenset(), f"auto: the native kernels do not run here ({native.why})")
    why = "auto" if name == "auto" else "as asked"
    if not native:
        why += f"; slow: dequantised per call, the native kernels do not run here ({native.why})"
    if others:
        why += f"; {', '.join(others)} dequantised to fp32 (no kernel)"
    return WeightsChoice(runnable, why)


def hold_blocks(model: CausalLM, gguf: GGUFFile, formats: frozenset[str]) -> frozenset[str]:
    """Put the GGUF file's matrices stored in ``formats`` into the (meta) model as they are
    stored: each linear layer becomes a ``QuantLinear`` (its bias still to load), the embedding a
    ``QuantEmbedding``. Returns the tensor names placed."""
    placed = set()
    for name, kind, blocks in gguf.blocks(set(formats)):
        path = name.removesuffix(".weight")
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        data = torch.from_numpy(blocks)
        try:
            if isinstance(old, torch.nn.Embedding):
                new: torch.nn.Module = QuantEmbedding(FORMATS[kind], data, old.embedding_dim)
            else:
                bias = None if old.bias is None else torch.empty_like(old.bias, device="meta")
                new = QuantLinear(FORMATS[kind], data, old.in_features, bias)
        except ValueError as e:  # rows not whole blocks: not what a GGUF writer stores
            raise ConfigError(f"{gguf.path.name}: {name}: {e}") from None
        if new.blocks.shape[0] != (old.num_embeddings if isinstance(old, torch.nn.Embedding) else old.out_features):
            raise ConfigError(f"{gguf.path.name}: {name} has {blocks.shape[0]} rows, the config implies another shape")
        setattr(parent, child, new)
        placed.add(name)
    return frozenset(placed)


def torch_dtype(name: str | torch.dtype, device: str = "cpu", stored: str = "fp32") -> torch.dtype:
    """The torch dtype for ``name`` (fp32, bf16, fp16 and their aliases, or auto) on ``device``."""
    return choose_dtype(name, device, stored).dtype


@dataclass
class Loaded:
    model: CausalLM
    tokenizer: HFTokenizer | ByteTokenizer
    path: Path | None  # checkpoint folder or GGUF file, None for a catalogue config
    chat_template: ChatTemplate
    dtype: DtypeChoice  # the model's dtype and why it was chosen
    weights: WeightsChoice  # which weight matrices run as stored, and why


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


def _safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if not key.endswith(_IGNORED_SUFFIXES):
                    yield key, f.get_tensor(key)


def _assign_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str,
                    dtype: torch.dtype, device: torch.device) -> None:
    """Give the meta model its weights, each converted to ``dtype`` as it arrives; every tensor
    must be known, of the config's shape, and none missing (but the stored blocks, placed
    already by ``hold_blocks``)."""
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith(".blocks")}
    if model.spec.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, t in tensors:
        if key in expected:
            want = expected[key].shape
            if t.shape != want:
                raise ConfigError(f"{source}: {key} has shape {tuple(t.shape)}, the config implies "
                                  f"{tuple(want)}")
            state[key] = t.to(device=device, dtype=dtype)
        elif key != "lm_head.weight":  # a tied checkpoint may still carry its LM head
            unexpected.append(key)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
        raise ConfigError(f"{source}: weights do not match the config: {'; '.join(parts)}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()


@torch.no_grad()
def init_random_(model: CausalLM, seed: int = 0, std: float | None = None) -> None:
    """Hugging Face's init: Linear/Embedding ~ N(0, initializer_range), biases 0, norms the
    identity (1, or 0 for Gemma's (1 + w) norms)."""
    std = std if std is not None else float(model.config.get("initializer_range") or 0.02)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    offsets = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "offset", False)}
    for name, p in model.named_parameters():  # tied lm_head is listed once, as embed_tokens
        if name.endswith("norm.weight"):
            p.fill_(0.0 if name in offsets else 1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def build_model(spec: ModelSpec, dtype: str | torch.dtype = DEFAULT_DTYPE, device: str = "cpu",
                random_weights: bool = False, seed: int = 0) -> CausalLM:
    """An empty (meta) model, or one with seeded random weights, in ``dtype`` on ``device``
    (``auto``: as the config's ``torch_dtype`` says random weights are stored)."""
    check_supported(spec)
    dt = torch_dtype(dtype, device, stored_format(None, None, spec.config))
    with torch.device("meta"):  # no memory yet: never materialise fp32 weights for a bf16 model
        model = CausalLM(spec).to(dt)
    if random_weights:
        model.to_empty(device=device)
        model.tie_weights()
        init_random_(model, seed)
        model.source = WeightsSource(random=json.dumps({"config": spec.config, "seed": seed},
                                                       sort_keys=True, default=str))
    # Otherwise weights arrive through load_state_dict(assign=True), and load() has the layers
    # choose again. RoPE stays float32.
    model.set_rope(device)
    model.use()
    return model.eval()


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_activations(activations: str, model: CausalLM) -> None:
    """``--activations int8`` needs layers it runs: GGUF Q8_0/Q4_0/Q4_1/Q5_0 matrices held as
    stored (so fp32 rows, on the CPU); ValueError, one line, otherwise."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"--activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if activations == "fp32":
        return
    formats = {m.format.name for m in model.modules() if isinstance(m, QuantLinear)}
    if not formats & set(ACT8_FORMATS):
        raise ValueError(f"--activations int8 runs GGUF {'/'.join(ACT8_FORMATS)} layers held as stored "
                         f"(a GGUF file, --weights auto, fp32, CPU); this model holds "
                         f"{', '.join(sorted(formats)) if formats else 'no stored layer'}")


def load(model: str | Path | None = None, dtype: str | torch.dtype = DEFAULT_DTYPE, *,
         device: str | None = "cpu", random_weights: bool = False, seed: int = 0,
         weights: str = "auto", activations: str = "fp32") -> Loaded:
    """Load a model: a GGUF file, a checkpoint folder, a bundled name (default ``smollm2-135m``),
    or (with ``random_weights``) any catalogue name or config.json with seeded random weights;
    ``weights``: how to hold the matrices (``choose_weights``); ``activations``: their inputs'
    precision (``check_activations``).
    Raises ConfigError / UnsupportedModelError / ValueError with a one-line message."""
    dev = resolve_device(device)
    model = DEFAULT_MODEL if model is None else model
    path = model_path(model)
    if path is None and not random_weights:
        load_config(str(model))  # raises for unknown names
        raise ConfigError(f"{model!r} is a catalogue config without weights: pass --random-weights "
                          f"(random_weights=True), a checkpoint folder or a GGUF file")
    cfg, name = load_config(model)
    spec = spec_from_config(cfg, name)
    check_supported(spec)
    gguf = gguf_file(path) if path is not None else None
    folder = None if path is None or gguf is not None else (path if path.is_dir() else path.parent)
    choice = choose_dtype(dtype, dev, stored_format(gguf, None if random_weights else folder, cfg))
    held = choose_weights(weights, None if random_weights else gguf, choice.dtype, dev, activations)
    built = build_model(spec, choice.dtype, dev, random_weights=random_weights, seed=seed)
    if not random_weights:
        placed = hold_blocks(built, gguf, held.formats) if held.formats else frozenset()
        tensors = (((k, torch.from_numpy(a)) for k, a in gguf.tensors(placed)) if gguf is not None
                   else _safetensors(folder))
        _assign_weights(built, tensors, path.name, choice.dtype, torch.device(dev))
        files = (gguf.path,) if gguf is not None else tuple(sorted(folder.glob("*.safetensors")))
        built.source = WeightsSource(files=files, stored=tuple(sorted(placed)))
    check_activations(activations, built)
    built.activations = activations
    if not random_weights:
        built.use()  # the layers choose how they run, on the weights they now hold
    tokenizer: HFTokenizer | ByteTokenizer
    if gguf is not None:
        built.eos_token_ids = gguf.eos_token_ids()
        tokenizer = HFTokenizer(gguf.tokenizer(), source="GGUF vocabulary")
        chat = ChatTemplate.from_gguf(gguf)
    else:
        built.eos_token_ids = _eos_ids(folder, spec.config)
        tok_file = folder / "tokenizer.json" if folder is not None else None
        tokenizer = (HFTokenizer(tok_file) if tok_file is not None and tok_file.is_file()
                     else ByteTokenizer(spec.vocab_size))
        chat = ChatTemplate.from_checkpoint(folder)
    return Loaded(built, tokenizer, path if gguf is not None else folder, chat, choice, held)


def load_options(options: ModelOptions, tp: int = 1) -> Loaded:
    """``load`` as the options say, torch's threads set first. At ``tp`` > 1 the model loads on
    the CPU whatever the device: the tensor-parallel workers cut their shards from this whole
    copy in this process's memory, and each moves its shard to its own device."""
    if options.threads:
        torch.set_num_threads(options.threads)
    return load(options.model, options.dtype, device="cpu" if tp > 1 else options.device,
                random_weights=options.random_weights, seed=options.seed or 0, weights=options.weights,
                activations=options.activations)


def load_model(model: str | Path, dtype: str | torch.dtype = DEFAULT_DTYPE, **kwargs) -> CausalLM:
    """Just the model (see ``load``)."""
    return load(model, dtype, **kwargs).model
