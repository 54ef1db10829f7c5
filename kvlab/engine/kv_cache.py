"""The KV tensors: per layer one K and one V tensor of blocks, in the storage format asked for,
and a host pool (RAM, or a file on disk) that preempted sequences' blocks are swapped to.

Layout per layer: [kv_heads, num_blocks, block_size, head_dim], so token slot s = block *
block_size + offset is row s of each head's flattened [slots, head_dim] matrix; the runner hands
out slots, this module only writes rows and reads them back. Heads outermost: a read of a
sequence's slots gives each head's keys as one contiguous [L, head_dim] matrix, which attention
reads fastest (and gathering 128-byte rows per head beats gathering interleaved heads).
Formats (``kvlab.dtypes``):
- fp32 / bf16 / fp16: stored as is (cast if it differs from the model's dtype);
- fp8_e4m3 / fp8_e5m2: torch.float8_* with one fp32 scale per layer for K and one for V, set
  once at start-up from a fixed calibration text (``calibrate``: amax / fp8 max, with headroom),
  so a request's tokens never depend on which requests came before; values beyond saturate and
  are counted (``saturated``);
- int8: q8_0 style, one fp16 scale per 32 elements of each head vector.
Each layer's bytes per slot equal ``LayerSpec.kv_bytes_per_token`` for that format, so the cache
holds exactly what ``kvlab plan`` prints.

The disk host pool is a file written and read with pwrite / pread (``SwapFile``), not a memory
map: when the disk fills up or the file system turns read-only, a write fails with an OSError the
engine recovers from (the sequence recomputes instead), where a store into a map would kill the
process with SIGBUS.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Literal

import torch
from torch import Tensor

from kvlab import dispatch, kernels
from kvlab.dtypes import kv_dtype as lookup_kv_dtype
from kvlab.engine.kv_manager import BlockCopies
from kvlab.layout import LayerGroup
from kvlab.models.attention import NoCache
from kvlab.models.llama import CausalLM
from kvlab.spec import ModelSpec

STORAGE: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
}
FP8_HEADROOM = 4.0  # the calibration text's largest value lands at 1/4 of the fp8 range
CALIBRATION_TOKENS = 256
INT8_GROUP = 32


class PagedKVCache:
    """Block tensors of every layer with a KV cache, grouped as the block pools are."""

    def __init__(self, spec: ModelSpec, groups: list[LayerGroup], num_blocks: int, block_size: int,
                 kv_dtype: str, device: torch.device | str = "cpu") -> None:
        self.format = lookup_kv_dtype(kv_dtype)
        if self.format.name not in STORAGE:
            raise ValueError(f"the engine stores KV as {', '.join(STORAGE)}; not {self.format.name}")
        self.storage = STORAGE[self.format.name]
        self.device = torch.device(device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.groups = groups
        self.group_of: dict[int, int] = {i: g for g, grp in enumerate(groups) for i in grp.layers}
        self.quantised = self.format.name.startswith("fp8") or self.format.name == "int8"
        self.native = bool(dispatch.backends().native)  # kvlab's kernels write (and read) it
        # per layer: the tensors indexed by block (K, V, and for int8 their scales)
        self.blocks: dict[int, list[Tensor]] = {}
        self.scales: dict[int, Tensor] = {}  # fp8: [2] fp32 (K scale, V scale)
        self.saturated = 0  # fp8 values beyond the format's range, clamped (cumulative)
        for i in self.group_of:
            layer = spec.layers[i]
            if self.format.name == "int8" and layer.head_dim % INT8_GROUP:
                raise ValueError(f"int8 KV needs head_dim divisible by {INT8_GROUP}, "
                                 f"layer {i} has {layer.head_dim}")
            tensors = [torch.zeros(layer.kv_heads, num_blocks, block_size, d, dtype=self.storage,
                                   device=device)
                       for d in (layer.head_dim, layer.v_head_dim or layer.head_dim)]
            if self.format.name == "int8":
                tensors += [torch.zeros(*t.shape[:3], t.shape[3] // INT8_GROUP, dtype=torch.float16,
                                        device=device) for t in tensors]
            self.blocks[i] = tensors
            if self.format.name.startswith("fp8"):
                self.scales[i] = torch.zeros(2, dtype=torch.float32, device=device)
        self.host: dict[int, list[Tensor]] = {}  # the RAM host pool: views of one buffer
        self.swap_file: SwapFile | None = None  # the disk host pool

    @property
    def nbytes(self) -> int:
        """Bytes allocated on the device: block tensors plus the fp8 per-layer scales."""
        return (sum(t.numel() * t.element_size() for ts in self.blocks.values() for t in ts)
                + sum(s.numel() * s.element_size() for s in self.scales.values()))

    @torch.inference_mode()
    def calibrate(self, model: CausalLM, ids: list[int]) -> None:
        """Set every fp8 layer's K and V scale from one forward pass over ``ids`` (a fixed text):
        amax x headroom / the format's largest value. A no-op for other formats."""
        if not self.scales:
            return
        amax: dict[int, Tensor] = {}

        class Recorder(NoCache):
            def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                amax[layer_idx] = torch.stack([k.abs().max(), v.abs().max()]).float()
                return super().attend(layer_idx, q, k, v)
        backend = Recorder(model.spec)
        device = model.device
        model(torch.tensor(ids, device=device), backend.prepare(len(ids), device), backend,
              torch.tensor([len(ids) - 1], device=device))
        fmax = torch.finfo(self.storage).max
        for layer, scale in self.scales.items():
            scale.copy_((amax[layer] * FP8_HEADROOM / fmax).clamp(min=1e-12))

    # --- writing and reading slots --------------------------------------------------------------
    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """Store new tokens' K/V [T, kv_heads, D] at slots [T]."""
        tensors = self.blocks[layer]
        plain = self.plain(layer)
        if self.native and plain is not None and kernels.rowwise_usable(k, v) and kernels.rowwise_usable(*plain):
            kernels.store_kv(k, v, _rows(plain[0]), _rows(plain[1]), slots)  # one call, no copies
            return
        for j, x in enumerate((k, v)):
            flat = _rows(tensors[j])  # [kv_heads, slots, D]
            if self.format.name == "int8":
                q, scale = _int8_quantise(x)
                flat.index_copy_(1, slots, q.transpose(0, 1))
                _rows(tensors[2 + j]).index_copy_(1, slots, scale.transpose(0, 1))
            elif layer in self.scales:
                scale = self.scales[layer]
                if not bool(scale.all()):
                    raise RuntimeError("fp8 KV cache written before calibrate() set its scales")
                fmax = torch.finfo(self.storage).max
                y = x.float() / scale[j]
                self.saturated += int((y.abs() > fmax).sum())
                y = y.clamp(-fmax, fmax).to(self.storage)
                # no fp8 index_copy_ kernel: copy the bytes
                flat.view(torch.uint8).index_copy_(1, slots, y.view(torch.uint8).transpose(0, 1))
            else:
                flat.index_copy_(1, slots, x.to(self.storage).transpose(0, 1))

    def plain(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """This layer's K and V block tensors [kv_heads, blocks, block_size, D] where their values
        are stored as they are (no scales: not fp8 or int8), for kernels that read them in place."""
        if self.format.name == "int8" or layer in self.scales:
            return None
        k, v = self.blocks[layer][:2]
        return k, v

    def read(self, layer: int, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """K and V at slots (any shape S) -> [kv_heads, *S, D] in `dtype`, dequantised."""
        tensors = self.blocks[layer]
        out = []
        index = slots.reshape(-1)  # index_select: ~10x faster on CPU than advanced indexing
        for j in range(2):
            flat = _rows(tensors[j])
            x = flat.index_select(1, index).view(flat.shape[0], *slots.shape, flat.shape[-1])
            if self.format.name == "int8":
                sflat = _rows(tensors[2 + j])
                scale = sflat.index_select(1, index).view(sflat.shape[0], *slots.shape, sflat.shape[-1])
                x = (x.float().unflatten(-1, (-1, INT8_GROUP)) * scale.float()[..., None]).flatten(-2)
            elif layer in self.scales:
                x = x.float() * self.scales[layer][j]
            out.append(x.to(dtype))
        return out[0], out[1]

    # --- whole blocks as bytes (the prefix tiers) ------------------------------------------------
    def block_bytes(self, group: int, blocks: list[int]) -> Tensor:
        """[n, bytes] uint8 on the CPU: each block's bytes in every tensor of the group's layers
        (K, V and int8's scales, as stored), in one fixed order: what a prefix tier keeps."""
        index = torch.tensor(blocks, device=self.device)
        parts = [t.view(torch.uint8).index_select(1, index).transpose(0, 1).reshape(len(blocks), -1)
                 for layer in self.groups[group].layers for t in self.blocks[layer]]
        return torch.cat(parts, dim=1).cpu()

    def put_block_bytes(self, group: int, blocks: list[int], data: Tensor) -> None:
        """Write ``block_bytes``' rows back into these blocks (one copy per tensor for the run)."""
        raws = [t.view(torch.uint8) for layer in self.groups[group].layers for t in self.blocks[layer]]
        widths = [raw[:, 0].numel() for raw in raws]  # raw: [kv_heads, num_blocks, block_size, row bytes]
        if sum(widths) != data.shape[1]:
            raise ValueError(f"a tier block of {data.shape[1]} B for blocks of {sum(widths)} B")
        index = torch.tensor(blocks, device=self.device)
        for raw, part in zip(raws, data.to(self.device).split(widths, dim=1)):
            raw.index_copy_(1, index, part.view(len(blocks), raw.shape[0], *raw.shape[2:]).transpose(0, 1))

    # --- swapping ------------------------------------------------------------------------------
    def attach_host_pool(self, num_blocks: int, where: Literal["ram", "disk"]) -> None:
        """Allocate the host pool: the same block tensors with `num_blocks` blocks, in RAM or in a
        file in the temp directory (``SwapFile``)."""
        if where == "disk":
            self.swap_file = SwapFile(self.blocks, num_blocks)
            return
        sizes = [t[:, 0].numel() * t.element_size() * num_blocks for ts in self.blocks.values() for t in ts]
        storage = torch.zeros(sum(-(-s // 64) * 64 for s in sizes), dtype=torch.uint8)  # 64-byte aligned slices
        offset = 0
        for layer, tensors in self.blocks.items():
            views = []
            for t in tensors:
                n = t[:, 0].numel() * t.element_size() * num_blocks
                views.append(storage[offset:offset + n].view(t.dtype).view(t.shape[0], num_blocks,
                                                                            *t.shape[2:]))
                offset += -(-n // 64) * 64
            self.host[layer] = views

    def swap_out(self, copies: BlockCopies) -> None:
        """Copy (device block, host block) pairs, per group, to the host pool. OSError if the
        swap file cannot be written (then the host copies are incomplete: do not swap them in)."""
        if self.swap_file is not None:
            for group, pairs in zip(self.groups, copies):
                if pairs:
                    self.swap_file.write_blocks(self.blocks, group.layers, pairs)
            return
        self._copy(copies, self.blocks, self.host)

    def swap_in(self, copies: BlockCopies) -> None:
        """Copy (host block, device block) pairs, per group, back to the device."""
        if self.swap_file is not None:
            for group, pairs in zip(self.groups, copies):
                if pairs:
                    self.swap_file.read_blocks(self.blocks, group.layers, pairs)
            return
        self._copy(copies, self.host, self.blocks)

    def _copy(self, copies: BlockCopies, src: dict[int, list[Tensor]],
              dst: dict[int, list[Tensor]]) -> None:
        for group, pairs in zip(self.groups, copies):
            if not pairs:
                continue
            a = torch.tensor([p[0] for p in pairs])
            b = torch.tensor([p[1] for p in pairs])
            for layer in group.layers:
                for s, d in zip(src[layer], dst[layer]):  # blocks are dim 1
                    d[:, b.to(d.device)] = s[:, a.to(s.device)].to(d.device)


class SwapFile:
    """The disk host pool: per layer tensor a region of one temporary file, block by block (one
    block of one tensor = all its heads' rows, contiguous), so a block moves in one pwrite.

    The file is unlinked as soon as it is created (it disappears with the process, whatever way
    the process ends) and sparse: it takes disk space only as blocks are written, so a disk that
    fills up mid-run shows as an OSError (ENOSPC) from ``write``, which the engine survives."""

    def __init__(self, blocks: dict[int, list[Tensor]], num_blocks: int) -> None:
        fd, path = tempfile.mkstemp(prefix="kvlab-swap-", suffix=".bin")
        os.unlink(path)
        self.file = os.fdopen(fd, "r+b", buffering=0)
        self.regions: dict[int, list[tuple[int, int]]] = {}  # per layer tensor: (offset, block bytes)
        offset = 0
        for layer, tensors in blocks.items():
            self.regions[layer] = []
            for t in tensors:
                size = t[:, 0].numel() * t.element_size()
                self.regions[layer].append((offset, size))
                offset += size * num_blocks
        self.file.truncate(offset)

    def write_blocks(self, blocks: dict[int, list[Tensor]], layers: list[int],
                     pairs: list[tuple[int, int]]) -> None:
        """(device block, file block) pairs of these layers' tensors to the file."""
        src = torch.tensor([p[0] for p in pairs])
        for layer in layers:
            for t, (start, size) in zip(blocks[layer], self.regions[layer]):
                rows = t[:, src.to(t.device)].transpose(0, 1).contiguous().cpu()
                data = rows.view(torch.uint8).reshape(len(pairs), size).numpy()
                for row, (_, host) in zip(data, pairs):
                    self.write(memoryview(row), start + host * size)

    def read_blocks(self, blocks: dict[int, list[Tensor]], layers: list[int],
                    pairs: list[tuple[int, int]]) -> None:
        """(file block, device block) pairs back into these layers' tensors."""
        dst = torch.tensor([p[1] for p in pairs])
        for layer in layers:
            for t, (start, size) in zip(blocks[layer], self.regions[layer]):
                buf = torch.empty(len(pairs), size, dtype=torch.uint8)
                for row, (host, _) in zip(buf.numpy(), pairs):
                    self.read_into(memoryview(row), start + host * size)
                rows = buf.view(t.dtype).view(len(pairs), t.shape[0], *t.shape[2:]).transpose(0, 1)
                t[:, dst.to(t.device)] = rows.to(t.device)

    def write(self, data: memoryview, offset: int) -> None:
        """All of ``data`` at ``offset`` (pwrite may write less than asked)."""
        while data:
            n = os.pwrite(self.file.fileno(), data, offset)
            data, offset = data[n:], offset + n

    def read_into(self, buf: memoryview, offset: int) -> None:
        while buf:
            n = os.preadv(self.file.fileno(), [buf], offset)
            if n == 0:
                raise OSError(errno.EIO, "the swap file ended early")
            buf, offset = buf[n:], offset + n


def _rows(blocks: Tensor) -> Tensor:
    """[kv_heads, num_blocks, block_size, D] -> [kv_heads, slots, D] (a view)."""
    return blocks.view(blocks.shape[0], -1, blocks.shape[-1])


def _int8_quantise(x: Tensor) -> tuple[Tensor, Tensor]:
    """[..., D] -> int8 values and one fp16 scale per 32 elements (amax / 127)."""
    groups = x.float().unflatten(-1, (-1, INT8_GROUP))
    scale = (groups.abs().amax(-1) / 127).to(torch.float16)
    safe = scale.float().clamp(min=torch.finfo(torch.float16).tiny)
    q = (groups / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), scale
