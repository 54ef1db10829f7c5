"""Where the model runs: in this process, or as N tensor-parallel ranks in worker processes.

The engine's own side (scheduler, block manager, sampling, stop rules) stays in the driver
process whatever the executor. Each step it hands the executor a ``StepInput``: plain data (token
ids, positions, each sequence's block tables), which a ``Worker`` turns into tensors and runs
through its model over its cache. ``LocalExecutor`` calls one Worker holding the whole model.
``TPExecutor`` starts N worker processes (vLLM's executor / worker split), each a Worker over
its shard (``kvlab.models.parallel``) and its share of the KV heads, joined by torch.distributed
(gloo on CPU, NCCL on CUDA) for the all-reduces inside the model. Every rank's block pool has the
same blocks (the driver's block ids mean the same slots everywhere), so one message per step
drives them all; rank 0 sends back the logits. Every message is a method of ``Worker.answer``
and its arguments; every rank replies (ok, result, fp8 values clamped).

The driver talks to the workers over pipes, never through a collective, so it can always watch
them: a worker that dies (its process sentinel fires) or does not answer within ``timeout_s``
(hung) ends the run with a ``WorkerError`` and every worker process is stopped. Workers stop by
themselves when the driver goes away (their pipe closes) or a peer stops answering inside a
collective (the process group's timeout).

Under ``torchrun`` (across machines) the processes are torchrun's, one per rank, each running the
same command: ``TorchrunExecutor`` makes rank 0 the driver, which also runs rank 0's shard, and
sends the same messages over a gloo process group instead of pipes; ranks above 0 answer them in
``serve_torchrun_rank``. A rank that dies closes its connections (rank 0's next message fails);
one that hangs is waited for ``timeout_s`` at most: either way rank 0 ends with a ``WorkerError``.
"""

from __future__ import annotations

import copy
import logging
import pickle
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kvlab.engine.attention import InvariantAttention, PagedAttention, SeqSpan
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.kv_manager import BlockCopies
from kvlab.options import TorchrunRank, check_torchrun_tp, torchrun_rank
from kvlab.layout import LayerGroup
from kvlab.hardware import available_memory
from kvlab.models.llama import CausalLM
from kvlab.models.parallel import first_kv_head, shard_model, weight_bytes
from kvlab.layout import check_tp

log = logging.getLogger("kvlab.engine")


@dataclass(frozen=True)
class StepInput:
    """One forward pass as plain data: the chunks' tokens end to end, each chunk's positions
    [start, end), each sequence's span (block tables), and the rows that want logits."""

    token_ids: list[int]
    positions: list[tuple[int, int]]
    spans: list[SeqSpan]
    logits_rows: list[int]


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache every rank allocates: the same blocks, each rank its own KV heads."""

    groups: list[LayerGroup]
    num_blocks: int
    block_size: int
    kv_dtype: str
    host_pool: Literal["ram", "disk"] | None  # where preempted blocks are swapped, if anywhere
    calibration_ids: list[int]  # the fixed text fp8 scales are set from (unused otherwise)


Reply = tuple[bool, Any, int]  # a rank's answer: ok, its result (or exception), fp8 values clamped


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, hung or failed: the run cannot go on."""


class Worker:
    """One rank's model and KV cache (at tp=1, the whole model): runs steps."""

    def __init__(self, model: CausalLM, rank: int = 0, tp: int = 1,
                 group: dist.ProcessGroup | None = None) -> None:
        self.model, self.group, self.rank, self.tp = model, group, rank, tp
        self.spec = model.spec.tp_shard(tp)
        self.cache: PagedKVCache | None = None
        self.attn: PagedAttention | None = None
        # with replicated KV heads, only the first rank holding a head counts its clamped values
        heads, kv = self.spec.layers[0].num_heads * tp, model.spec.num_kv_heads
        self.counts_saturation = rank == 0 or (first_kv_head(heads, kv, rank, tp)
                                               != first_kv_head(heads, kv, rank - 1, tp))
        # bf16 on CPU: packed weight copies make decode matmuls ~1.5x faster (bit-identical);
        # they cost the linear weights' bytes once more, so only when RAM has ample room.
        if model.device.type == "cpu":
            model.prepack(max_bytes=available_memory() // 2)

    @property
    def saturated(self) -> int:
        """fp8 values this rank clamped (0 for a copy of another rank's KV heads)."""
        return self.cache.saturated if self.cache is not None and self.counts_saturation else 0

    def init_cache(self, cfg: CacheConfig) -> int:
        """Allocate the cache (fp8: set its scales; swap: attach the host pool); returns its bytes."""
        cache = PagedKVCache(self.spec, cfg.groups, cfg.num_blocks, cfg.block_size, cfg.kv_dtype,
                             self.model.device)
        if cache.scales:  # one scale per layer for all heads: the largest any rank saw
            cache.calibrate(self.model, cfg.calibration_ids)
            if self.group is not None:
                for scale in cache.scales.values():
                    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=self.group)
        if cfg.host_pool is not None:
            cache.attach_host_pool(cfg.num_blocks, cfg.host_pool)
        rows = self.model.invariant_rows  # deterministic mode
        self.cache = cache
        self.attn = PagedAttention(cache) if rows is None else InvariantAttention(cache, rows)
        return cache.nbytes

    @torch.inference_mode()
    def execute(self, step: StepInput) -> Tensor:
        """Logits [len(step.logits_rows), vocab] (rank 0; other ranks: no columns)."""
        assert self.attn is not None, "init_cache() first"
        device = self.model.device
        self.attn.prepare(step.spans, device)
        positions = torch.cat([torch.arange(a, b) for a, b in step.positions])
        # every row in order (a decode-only step): None lets the last layer run whole, natively too
        rows = (None if step.logits_rows == list(range(len(step.token_ids)))
                else torch.tensor(step.logits_rows, dtype=torch.long, device=device))
        return self.model(torch.tensor(step.token_ids, device=device), positions.to(device), self.attn, rows)

    def swap_out(self, copies: BlockCopies) -> None:
        assert self.cache is not None
        self.cache.swap_out(copies)

    def swap_in(self, copies: BlockCopies) -> None:
        assert self.cache is not None
        self.cache.swap_in(copies)

    def block_bytes(self, group: int, blocks: list[int]) -> Tensor:
        """This rank's bytes of these blocks (``PagedKVCache.block_bytes``: its shard of the KV heads)."""
        assert self.cache is not None
        return self.cache.block_bytes(group, blocks)

    def put_block_bytes(self, group: int, blocks: list[int], data: Tensor) -> None:
        """Write this rank's part of whole tier blocks: ``data`` holds every rank's bytes side by
        side, rank 0's first (``_RankedExecutor.block_bytes``), each rank's the same width."""
        assert self.cache is not None
        width = data.shape[1] // self.tp
        self.cache.put_block_bytes(group, blocks, data[:, self.rank * width:(self.rank + 1) * width])

    def kv_scales(self) -> dict[int, list[float]]:
        """The fp8 cache's per-layer K/V scales (the same on every rank: their maximum)."""
        assert self.cache is not None
        return {layer: s.tolist() for layer, s in sorted(self.cache.scales.items())}

    def answer(self, method: str, args: tuple[Any, ...]) -> Reply:
        """One of the driver's messages ("info", "init_cache", "execute", "swap_out", "swap_in",
        the prefix tiers' "block_bytes", "put_block_bytes" and "kv_scales") run here, as the
        reply a rank sends back: it never raises, so a rank keeps serving."""
        calls: dict[str, Callable[..., Any]] = {
            "info": self.info, "init_cache": self.init_cache, "swap_out": self.swap_out,
            "swap_in": self.swap_in, "block_bytes": self.block_bytes, "put_block_bytes": self.put_block_bytes,
            "kv_scales": self.kv_scales,
            "execute": lambda step: self.execute(step).cpu(),  # a tensor travels from host memory
        }
        try:
            return True, calls[method](*args), self.saturated
        except OSError as e:  # recoverable (a full swap disk): the driver decides
            return False, e, self.saturated
        except Exception as e:  # the driver stops every rank: say why here, in full, first
            log.exception("tensor-parallel worker %d: %s failed", self.rank, method)
            return False, RuntimeError(f"{type(e).__name__}: {e}"), 0

    def info(self) -> dict[str, Any]:
        """What the driver checks and sizes from: the model, its dtype, device and weight bytes."""
        return {"name": self.model.name, "dtype": str(self.model.dtype), "device": str(self.model.device),
                "weight_bytes": weight_bytes(self.model)}


class Executor(Protocol):
    """What the engine asks of wherever the model runs."""

    device: torch.device  # where rank 0's model and cache live
    weight_bytes: int  # one rank's weights (rank 0's, the largest: it holds the LM head)
    cache: PagedKVCache | None  # the cache tensors, when they live in this process

    def init_cache(self, cfg: CacheConfig) -> int: ...  # one rank's cache bytes
    def execute(self, step: StepInput) -> Tensor: ...
    def swap_out(self, copies: BlockCopies) -> None: ...  # OSError: the host pool refused
    def swap_in(self, copies: BlockCopies) -> None: ...
    # the prefix tiers: whole blocks as bytes (every rank's shard side by side), the fp8 scales
    def block_bytes(self, group: int, blocks: list[int]) -> Tensor: ...
    def put_block_bytes(self, group: int, blocks: list[int], data: Tensor) -> None: ...
    def kv_scales(self) -> dict[int, list[float]]: ...
    @property
    def saturated(self) -> int: ...  # fp8 values clamped so far, every rank's
    def close(self) -> None: ...


class LocalExecutor:
    """The whole model in this process."""

    def __init__(self, model: CausalLM) -> None:
        self.worker = Worker(model)
        self.device = model.device
        self.weight_bytes = weight_bytes(model)
        self.cache: PagedKVCache | None = None

    def init_cache(self, cfg: CacheConfig) -> int:
        nbytes = self.worker.init_cache(cfg)
        self.cache = self.worker.cache
        return nbytes

    def execute(self, step: StepInput) -> Tensor:
        return self.worker.execute(step)

    def swap_out(self, copies: BlockCopies) -> None:
        self.worker.swap_out(copies)

    def swap_in(self, copies: BlockCopies) -> None:
        self.worker.swap_in(copies)

    def block_bytes(self, group: int, blocks: list[int]) -> Tensor:
        return self.worker.block_bytes(group, blocks)

    def put_block_bytes(self, group: int, blocks: list[int], data: Tensor) -> None:
        self.worker.put_block_bytes(group, blocks, data)

    def kv_scales(self) -> dict[int, list[float]]:
        return self.worker.kv_scales()

    @property
    def saturated(self) -> int:
        return self.worker.saturated

    def close(self) -> None:
        pass


class _RankedExecutor:
    """The engine's calls as one message to every rank (``_call``), the same for every way ranks
    are started; subclasses say how a message reaches them and how they are stopped."""

    tp: int
    failure: str | None  # why the run ended, once it has: every later call raises it
    cache: PagedKVCache | None = None  # every rank's cache lives in its worker
    rank_weight_bytes: list[int]
    rank_cache_bytes: list[int]

    def _start(self, tp: int) -> None:
        """Ask every rank what it holds (the ranks must be up)."""
        self.tp, self.failure = tp, None
        self._saturated = [0] * tp  # each rank's count, as its last reply said
        self._last_replies: list[Any] = []  # every rank's result of the last call
        info = self._call("info")
        self.device = torch.device(info["device"])
        self.rank_weight_bytes = [r["weight_bytes"] for r in self._last_replies]
        self.weight_bytes = max(self.rank_weight_bytes)
        loaded = {(r["name"], r["dtype"]) for r in self._last_replies}
        if len(loaded) != 1:  # each machine loads its own copy: --dtype auto may choose differently
            self._fail(f"tensor-parallel ranks loaded different models: "
                       f"{[(r['name'], r['dtype']) for r in self._last_replies]}; pass the same model "
                       f"and an explicit --dtype to every rank")

    # --- the engine's calls ----------------------------------------------------------------------
    def init_cache(self, cfg: CacheConfig) -> int:
        self._call("init_cache", cfg)
        self.rank_cache_bytes = list(self._last_replies)  # measured from each rank's tensors
        if len(set(self.rank_cache_bytes)) != 1:
            raise WorkerError(f"tensor-parallel ranks allocated different caches: {self.rank_cache_bytes} B")
        return self.rank_cache_bytes[0]

    def execute(self, step: StepInput) -> Tensor:
        return self._call("execute", step)

    def swap_out(self, copies: BlockCopies) -> None:
        if any(copies):
            self._call("swap_out", copies)

    def swap_in(self, copies: BlockCopies) -> None:
        if any(copies):
            self._call("swap_in", copies)

    def block_bytes(self, group: int, blocks: list[int]) -> Tensor:
        """Whole blocks: every rank's shard bytes side by side, in rank order (one tier entry
        per block, read back by ``put_block_bytes`` on the same TP size: the fingerprint has it)."""
        self._call("block_bytes", group, blocks)
        return torch.cat(self._last_replies, dim=1)

    def put_block_bytes(self, group: int, blocks: list[int], data: Tensor) -> None:
        self._call("put_block_bytes", group, blocks, data)

    def kv_scales(self) -> dict[int, list[float]]:
        return self._call("kv_scales")

    @property
    def saturated(self) -> int:
        return sum(self._saturated)

    # --- the messages ------------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        """Run `method` on every rank; rank 0's result. Each rank's result is kept in
        ``_last_replies``. A rank's OSError is raised here as one (the engine recovers from a
        failed swap-out); anything else ends the run."""
        if self.failure is not None:
            raise WorkerError(self.failure)
        replies: dict[int, Any] = {}
        errors: dict[int, OSError] = {}
        for rank, (ok, value, saturated) in self._exchange(method, args):
            self._saturated[rank] = saturated
            if ok:
                replies[rank] = value
            elif isinstance(value, OSError):
                errors[rank] = value
            else:  # the ranks may now wait on each other in a collective: stop them all
                self._fail(f"tensor-parallel worker {rank} failed in {method}: {value}")
        if errors:
            raise next(iter(errors.values()))
        self._last_replies = [replies[r] for r in range(self.tp)]
        return replies[0]

    def _exchange(self, method: str, args: tuple[Any, ...]) -> Iterator[tuple[int, Reply]]:
        """Send the call to every rank; yield (rank, reply) as each answers; ``_fail`` on a rank
        that is gone or does not answer."""
        raise NotImplementedError

    def _fail(self, message: str) -> NoReturn:
        """Stop every rank and raise; every later call raises the same error."""
        self.failure = message
        log.error("%s", message)
        self._abort()
        raise WorkerError(message)

    def _abort(self) -> None:
        """Stop every rank at once, whatever it is doing."""
        raise NotImplementedError


class TPExecutor(_RankedExecutor):
    """`tp` worker processes, one per rank, on this machine: fork on CPU (the children share the
    loaded model's pages, nothing is copied or re-imported), spawn on CUDA (which cannot fork;
    the model's tensors reach the children through shared memory). Each keeps its shard."""

    def __init__(self, model: CausalLM, tp: int, device: str = "cpu", timeout_s: float = 300.0) -> None:
        check_tp(model.spec, tp)
        cuda = torch.device(device).type == "cuda"
        ctx = torch.multiprocessing.get_context("spawn" if cuda else "fork")
        self.timeout_s = timeout_s
        threads = max(1, torch.get_num_threads() // tp)  # the driver idles while workers compute
        init = f"tcp://127.0.0.1:{_free_port()}"
        pipes = [ctx.Pipe() for _ in range(tp)]
        self.conns = [ours for ours, _ in pipes]
        self.procs: list[BaseProcess] = []
        for rank, (_, theirs) in enumerate(pipes):
            # a forked child inherits every pipe end made so far; it must close all but its own,
            # or the driver's death (or a sibling's) would never close a pipe
            inherited = [] if cuda else [c for pair in pipes for c in pair if c is not theirs]
            proc = ctx.Process(target=_worker_main, name=f"kvlab-tp{rank}", daemon=True,
                               args=(model, rank, tp, device, init, timeout_s, threads, theirs, inherited))
            proc.start()
            self.procs.append(proc)
        for _, theirs in pipes:
            theirs.close()  # only the children hold these ends: their death closes the pipe
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self._start(tp)

    def close(self) -> None:
        """Stop every worker process (idempotent)."""
        self._finalizer()

    # --- the pipes ---------------------------------------------------------------------------------
    def _exchange(self, method: str, args: tuple[Any, ...]) -> Iterator[tuple[int, Reply]]:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:  # its end is closed: the process is gone
                self._fail(self._death(rank))
        waiting = dict(enumerate(self.conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            ready = connection.wait([*waiting.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = ", ".join(map(str, sorted(waiting)))
                self._fail(f"tensor-parallel worker(s) {ranks} did not answer {method} within "
                           f"{self.timeout_s:g} s (hung?); all workers stopped")
            for obj in ready:
                if isinstance(obj, int):  # a sentinel: that process ended, which no call asks of it
                    self._fail(self._death(sentinels[obj]))
                rank = next(r for r, c in waiting.items() if c is obj)
                try:
                    reply = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death(rank))
                del waiting[rank]
                yield rank, reply

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited with status {code}" if code is not None else "closed its pipe")
        return f"tensor-parallel worker {rank} (pid {proc.pid}) {how}; all workers stopped"

    def _abort(self) -> None:
        for proc in self.procs:  # at once: a hung (or stopped) worker would not heed SIGTERM
            proc.kill()
        self.close()


class TorchrunExecutor(_RankedExecutor):
    """Rank 0 of the processes ``torchrun`` started, one per rank, on one machine or several: this
    process is the driver and runs rank 0's shard itself; every other rank runs
    ``serve_torchrun_rank``. Each message is broadcast from rank 0 and the replies gathered back
    on a gloo group of their own (``_TorchrunGroups``), whatever the backend of the model's
    all-reduces (NCCL on CUDA)."""

    def __init__(self, model: CausalLM, where: TorchrunRank, device: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.groups = _TorchrunGroups.join(where, device, timeout_s)
        # the caller keeps the whole model (bench reads its bounds from it): the shard is cut from
        # a copy of the modules whose tensors share the model's memory, so only the shard's slices
        # are new; its parameters are new objects, as moving a shard to CUDA replaces their data
        memo: dict[int, Any] = {id(p): nn.Parameter(p.detach(), requires_grad=False) for p in model.parameters()}
        memo |= {id(b): b for b in model.buffers()}
        self.worker = _shard_worker(copy.deepcopy(model, memo), 0, where.world_size, self.groups.device)
        self._finalizer = weakref.finalize(self, self.groups.close)
        self._start(where.world_size)

    def close(self) -> None:
        """Tell the other ranks to leave, then leave the process group (idempotent)."""
        self._finalizer()

    def _exchange(self, method: str, args: tuple[Any, ...]) -> Iterator[tuple[int, Reply]]:
        try:
            dist.broadcast_object_list([(method, args)], src=0, group=self.groups.control)
        except RuntimeError as e:  # a rank's connection closed (it is gone), or it took nothing
            self._fail(f"tensor-parallel ranks could not be sent {method} (gone or hung): {e}")
        mine = self.worker.answer(method, args)
        yield 0, mine  # a failure here (a peer gone inside an all-reduce) ends the run before the gather
        replies: list[Any] = [None] * self.tp
        try:
            dist.gather_object(mine, replies, dst=0, group=self.groups.control)
        except RuntimeError as e:  # a rank died, or did not answer within the timeout
            self._fail(f"tensor-parallel ranks did not answer {method} within {self.timeout_s:g} s "
                       f"(gone or hung): {e}")
        yield from ((rank, replies[rank]) for rank in range(1, self.tp))

    def _abort(self) -> None:
        # the other ranks leave when this process's connections close (its exit) or their
        # collectives time out: nothing is sent to ranks that may be dead or stuck
        self._finalizer.detach()
        dist.destroy_process_group()


@dataclass(frozen=True)
class _TorchrunGroups:
    """A torchrun rank's process groups: the default one for the model's all-reduces (gloo on
    CPU, NCCL on CUDA), and a gloo group for the driver's messages, on host memory whatever the
    device. A group's timeout is each process's own: rank 0 waits for a message to be taken and
    answered --tp-timeout at most, or ends the run; the other ranks wait for rank 0's next message
    without a timeout that matters (an idle server sends none for hours)."""

    control: dist.ProcessGroup
    device: torch.device  # this rank's

    @staticmethod
    def join(where: TorchrunRank, device: str, timeout_s: float) -> _TorchrunGroups:
        """Join torchrun's rendezvous (MASTER_ADDR / MASTER_PORT, RANK, WORLD_SIZE)."""
        cuda = torch.device(device).type == "cuda"
        here = torch.device("cuda", where.local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(here)
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        waits = timeout if where.rank == 0 else timedelta(days=365)
        return _TorchrunGroups(dist.new_group(backend="gloo", timeout=waits), here)

    def close(self) -> None:
        """Rank 0: tell the other ranks to leave, then leave the process group."""
        try:
            dist.broadcast_object_list([("close", ())], src=0, group=self.control)
        finally:
            dist.destroy_process_group()


def serve_torchrun_rank(model: CausalLM, where: TorchrunRank, device: str, timeout_s: float) -> None:
    """A torchrun rank above 0: cut this rank's shard from `model` (in place), then answer rank
    0's messages until it closes. A failed call is answered (rank 0 ends the run); a lost rank 0
    (its connection closed) raises here."""
    groups = _TorchrunGroups.join(where, device, timeout_s)
    try:
        worker = _shard_worker(model, where.rank, where.world_size, groups.device)
        while True:
            order: list[Any] = [None]
            dist.broadcast_object_list(order, src=0, group=groups.control)
            method, args = order[0]
            if method == "close":
                return
            dist.gather_object(worker.answer(method, args), None, dst=0, group=groups.control)
    finally:
        dist.destroy_process_group()


def make_executor(model: CausalLM, tp: int = 1, device: str | None = None,
                  timeout_s: float = 300.0) -> Executor:
    """The whole model here (tp=1), or `tp` ranks on `device` (default: the model's): worker
    processes started here, or, under torchrun, its processes (`tp` must be their number).

    Under torchrun every process runs the same command; on ranks above 0 this call does not
    return: the rank serves rank 0's steps, then the process exits (status 0) when rank 0 closes,
    so what the command does with the engine (print, serve HTTP) happens on rank 0 alone."""
    where = torchrun_rank()
    if where is not None:
        check_torchrun_tp(tp)
    if tp == 1:
        return LocalExecutor(model)
    device = device or str(model.device)
    if where is None:
        return TPExecutor(model, tp, device, timeout_s)
    check_tp(model.spec, tp)
    if where.rank > 0:
        serve_torchrun_rank(model, where, device, timeout_s)
        raise SystemExit(0)
    return TorchrunExecutor(model, where, device, timeout_s)


# --- the worker process ------------------------------------------------------------------------------

def _worker_main(model: CausalLM, rank: int, tp: int, device: str, init: str, timeout_s: float,
                 threads: int, conn: connection.Connection,
                 inherited: list[connection.Connection]) -> None:
    """A rank's life: join the process group, keep its shard, then answer the driver's calls
    until the pipe closes (the driver is gone or closed the executor)."""
    for end in inherited:
        end.close()
    torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=tp,
                            timeout=timedelta(seconds=timeout_s))
    try:
        worker = _shard_worker(model, rank, tp, torch.device(f"cuda:{rank}") if cuda else model.device)
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            conn.send_bytes(pickle.dumps(worker.answer(method, args), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        dist.destroy_process_group()


def _shard_worker(model: CausalLM, rank: int, tp: int, device: torch.device) -> Worker:
    """Cut rank `rank`'s shard from `model` (in place), move it to `device`, and wrap it: the
    process group (its all-reduces) must be up."""
    shard_model(model, rank, tp)
    if device.type == "cuda":
        model.to(device)
    return Worker(model, rank, tp, dist.group.WORLD)


def _stop(procs: list[BaseProcess], conns: list[connection.Connection]) -> None:
    """Close the pipes (idle workers leave on their own), then terminate, then kill."""
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=2.0)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
