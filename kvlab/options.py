"""Every option of the model and the engine, defined once: one dataclass field each, with its one
default and help, the same name as ``LLM(...)``'s keyword argument and as the CLI flag
(``block_size`` <-> ``--block-size``) on every command that takes it. Torch-free: the CLI parses
flags before anything heavy loads."""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvlab.dtypes import MODEL_DTYPE_HELP, WEIGHTS_HELP
from kvlab.eviction import POLICIES, make_policy, parse_budget
from kvlab.units import parse_bytes

PREEMPTION_MODES = ("recompute", "swap-ram", "swap-disk")
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class TorchrunRank:
    """This process's place among the processes ``torchrun`` started (its environment says)."""

    rank: int  # 0: the driver; above: a worker rank serving rank 0's steps
    world_size: int
    local_rank: int  # on this machine: the GPU it takes


def torchrun_rank() -> TorchrunRank | None:
    """Where torchrun put this process (RANK, WORLD_SIZE, LOCAL_RANK; MASTER_ADDR says where
    rank 0's store listens), or None when these are not all set: torchrun did not start it."""
    env = os.environ
    if not all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        return None
    return TorchrunRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))


def check_torchrun_tp(tp: int) -> None:
    """Under torchrun every process is one tensor-parallel rank: --tp must be their number."""
    where = torchrun_rank()
    if where is not None and tp != where.world_size:
        raise ValueError(f"--tp {tp} under torchrun with {where.world_size} processes (WORLD_SIZE): "
                         f"each process is one rank, so pass --tp {where.world_size}")


ACTIVATIONS = ("fp32", "int8")


def byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _budget(text: str) -> int | float:
    try:
        return parse_budget(text)  # type: ignore[return-value]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _opt(default: Any, help: str, **flag: Any) -> Any:
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ModelOptions:
    """Which model, and how it is held: ``kvlab.models.load_options`` loads it."""

    model: str | None = _opt(None, "GGUF file, checkpoint folder or bundled name (default: smollm2-135m), "
                             "or with --random-weights a catalogue name or config.json",
                             positional=True, nargs="?")
    dtype: str = _opt("auto", MODEL_DTYPE_HELP)
    weights: str = _opt("auto", WEIGHTS_HELP)
    activations: str = _opt("fp32", "the matmuls' inputs: fp32 (default: exact) or int8 (the GGUF "
                            "Q8_0/Q4_0/Q4_1/Q5_0 layers held as stored quantise each input row per 32 "
                            "values and run integer dot products: faster prefill and batches, lossy)",
                            choices=ACTIVATIONS)
    device: str = _opt("cpu", "cpu (default), cuda, or auto")
    random_weights: bool = _opt(False, "random weights from the config (seeded by --seed)", action="store_true")
    seed: int | None = _opt(None, "seed of --random-weights (default 0), and of the command's own randomness "
                            "where it has some (generate: sampling, unseeded by default; bench: the workload, 0)",
                            type=int, metavar="N")
    threads: int | None = _opt(None, "CPU threads for torch and kvlab's kernels (default: torch's choice)",
                               type=positive_int, metavar="N")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelOptions:
        """The options a parser built by ``add_model_args`` read (defaults for flags it lacks)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_model_args(parser: argparse.ArgumentParser, *, only: tuple[str, ...] | None = None,
                   **defaults: tuple[Any, str]) -> None:
    """Add ModelOptions fields as flags (all, or ``only`` those; read back with
    ModelOptions.from_args). A command whose job needs another default passes it with the
    reason, which its help then shows: ``dtype=("fp32", "why")``."""
    _add_fields(parser, ModelOptions, "model", defaults, only)


@dataclass(frozen=True)
class EngineOptions:
    block_size: int = _opt(16, "tokens per KV block (default 16)", type=positive_int, metavar="N")
    kv_memory: int | None = _opt(
        None, "bytes for the KV cache, e.g. 2GiB (default: --mem-util on a GPU, 1 GiB on CPU)",
        type=byte_size, metavar="BYTES")
    mem_util: float | None = _opt(
        None, "fraction of device memory for weights + activations + KV cache, the rest of which "
        "the cache gets (default 0.9 on a GPU)", type=_fraction, metavar="FRACTION")
    kv_dtype: str = _opt("auto", "KV storage: auto (the model's dtype), fp32, bf16, fp16, "
                         "fp8_e4m3, fp8_e5m2, int8", choices=KV_DTYPES)
    max_model_len: int | None = _opt(
        None, "longest sequence, prompt + output (default: the model's max_position_embeddings)",
        type=positive_int, metavar="N")
    max_num_seqs: int = _opt(256, "sequences running at once (default 256)",
                             type=positive_int, metavar="N")
    max_num_batched_tokens: int = _opt(2048, "tokens per step, decodes + prefill chunks "
                                       "(default 2048)", type=positive_int, metavar="N")
    preemption: str = _opt("recompute", "when blocks run out: free and recompute, or copy blocks "
                           "to RAM / a file on disk and back", choices=PREEMPTION_MODES)
    prefix_caching: bool = _opt(True, "turn prefix caching off (on by default: full blocks of "
                                "earlier requests are kept and reused)",
                                flag="--no-prefix-caching", action="store_false")
    kv_offload_ram: int | None = _opt(
        None, "prefix cache tier in host RAM, e.g. 4GiB: full blocks that leave the pool are kept "
        "there and loaded back on a prefix hit (default: off)", type=byte_size, metavar="BYTES")
    kv_offload_dir: str | None = _opt(
        None, "prefix cache tier on disk, in this directory: full blocks are written there as they "
        "are computed and survive a restart; processes may share it (default: off)", metavar="DIR")
    kv_offload_disk: int | None = _opt(
        None, "bytes the --kv-offload-dir tier may take (default: half the free space, at most "
        "10 GiB)", type=byte_size, metavar="BYTES")
    kv_policy: str = _opt("full", "token eviction: full (none), window, streaming (sinks + window), "
                          "h2o (heavy hitters + window), snapkv (prompt votes + window), adakv (snapkv's "
                          "votes per head)",
                          choices=POLICIES)
    kv_budget: int | float | None = _opt(
        None, "tokens each sequence keeps under --kv-policy (256), or a ratio of its context (0.25)",
        type=_budget, metavar="N|RATIO")
    deterministic: bool | None = _opt(
        None, "batch-invariant mode: a request's tokens and logprobs are bitwise the same whatever "
        "runs beside it (CPU; at a fixed thread count). Default: on where it costs nothing (kvlab's "
        "native kernels run the whole model, no eviction policy, --tp 1), else off",
        flag="--deterministic", action=argparse.BooleanOptionalAction)

    tp: int = _opt(1, "tensor-parallel size: N worker processes on this machine, each with 1/N of "
                   "the heads, FFN and KV cache (torch.distributed: gloo on CPU, NCCL on CUDA)",
                   type=positive_int, metavar="N")
    tp_timeout: float = _opt(300.0, "seconds a tensor-parallel step may take before the run ends "
                             "as hung (default 300)", type=_seconds, metavar="SECONDS")

    def __post_init__(self) -> None:
        for name in ("kv_memory", "kv_offload_ram", "kv_offload_disk"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, parse_bytes(getattr(self, name)))
        positive = ("block_size", "kv_memory", "max_model_len", "max_num_seqs",
                    "max_num_batched_tokens", "tp", "kv_offload_ram", "kv_offload_disk")
        for name in positive:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.mem_util is not None and not 0 < self.mem_util <= 1:
            raise ValueError(f"mem_util must be in (0, 1], got {self.mem_util!r}")
        if isinstance(self.tp_timeout, bool) or not isinstance(self.tp_timeout, (int, float)) \
                or not self.tp_timeout > 0:
            raise ValueError(f"tp_timeout must be a positive number of seconds, got {self.tp_timeout!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        make_policy(self.kv_policy, self.kv_budget)  # raises a one-line ValueError
        if self.deterministic not in (None, True, False):
            raise ValueError(f"deterministic must be True, False or None (auto), got {self.deterministic!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption!r}")
        if self.kv_offload_disk is not None and self.kv_offload_dir is None:
            raise ValueError("--kv-offload-disk is the budget of the --kv-offload-dir tier: give the directory")
        if self.offloads and not self.prefix_caching:
            raise ValueError("the --kv-offload-* tiers hold prefix-cache blocks: drop --no-prefix-caching")

    @property
    def offloads(self) -> bool:
        """Some prefix tier beyond the pool is on (--kv-offload-ram / --kv-offload-dir)."""
        return bool(self.kv_offload_ram) or self.kv_offload_dir is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options a parser built by ``add_engine_args`` read (defaults for flags it lacks)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_engine_args(parser: argparse.ArgumentParser, *, only: tuple[str, ...] | None = None,
                    **defaults: tuple[Any, str]) -> None:
    """Add EngineOptions fields as flags (all, or ``only`` those; read back with
    EngineOptions.from_args); ``defaults`` as for ``add_model_args``."""
    _add_fields(parser, EngineOptions, "engine", defaults, only)


def _add_fields(parser: argparse.ArgumentParser, cls: type, title: str,
                defaults: dict[str, tuple[Any, str]], only: tuple[str, ...] | None = None) -> None:
    group = parser.add_argument_group(title)
    unknown = set(defaults) - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"no {cls.__name__} field {', '.join(sorted(unknown))}")
    for f in fields(cls):
        if only is not None and f.name not in only:
            continue
        meta = dict(f.metadata)
        default = f.default if f.default is not MISSING else None
        if f.name in defaults:
            default, why = defaults[f.name]
            meta["help"] = f"{meta['help']}; here {default}: {why}"
        if meta.pop("positional", False):
            parser.add_argument(f.name, default=default, **meta)
            continue
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        group.add_argument(flag, dest=f.name, default=default, **meta)
