"""The prefix cache beyond the pool: a host-RAM tier and a disk tier behind the block pool.

A full, hashed block that leaves the pool (the pool's LRU of cached free blocks hands it out
again) is copied into the RAM tier; what leaves the RAM tier is dropped, as the disk tier already
has it: the disk tier is written behind as blocks are computed, so it holds them across a restart,
even after ``kill -9``. A prefix look-up that misses the pool asks RAM, then disk; the blocks they
hold are loaded into fresh pool blocks before the step runs, and prefill starts at the first miss.

A tier entry is exactly the bytes of one layer group's pool block (every layer's K and V, and
int8's scales) under a key naming the block's token prefix and its group. The disk tier's files
also carry the fingerprint of everything that shapes those bytes (``fingerprint``), and live in
a folder of that fingerprint: a block computed under one model, dtype, layout or kernel path is
never read under another.

A disk file is a header (magic, format version, fingerprint, key, payload length, CRC-32) and the
payload, written to a temporary name and renamed: a reader sees a whole file or none. A missing,
truncated, corrupt or foreign file is a miss (counted, and deleted). A write that fails (disk
full, directory read-only or gone) stops the tier's writing with one warning; its reads go on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kvlab.layout import TIER_FILE_HEADER as HEADER

log = logging.getLogger("kvlab.engine")

BLOCK_FORMAT = 1  # bump when a block's byte layout changes: older files are then foreign
MAGIC = b"KVLABKV\0"
SUFFIX = ".kvb"
STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that died
SPARE_BYTES = 256 * 2**20  # read buffers kept for reuse: fresh ones cost a page fault per 4 KiB
READERS = 16  # threads reading a run of disk blocks: 16 read 1.4x faster than 4 from a dropped page cache
MAX_PENDING_BYTES = 256 * 2**20  # writes queued behind the step; beyond, a block is not written

Key = bytes  # one byte of layer-group index + the block's 16-byte chained hash


def tier_key(group: int, block_hash: bytes) -> Key:
    return bytes([group]) + block_hash


@dataclass
class TierStats:
    """One tier's counters (blocks and bytes), for /metrics, the page and ``--json``."""

    name: str
    budget: int
    used: int = 0  # bytes held
    blocks: int = 0  # entries held
    hits: int = 0  # blocks served to a prefix look-up
    misses: int = 0  # blocks asked for and not found (or unreadable)
    stored: int = 0  # blocks taken in
    bad: int = 0  # disk: corrupt, truncated or foreign files dropped
    dropped: int = 0  # disk: blocks not written (queue full, or writing stopped)
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # time spent reading entries out for look-ups
    writable: bool = True


class RamTier:
    """Blocks in host memory, least recently used dropped first to stay within ``budget`` bytes."""

    def __init__(self, budget: int) -> None:
        self.entries: OrderedDict[Key, Tensor] = OrderedDict()
        self.stats = TierStats("ram", budget)

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def get(self, key: Key) -> Tensor | None:
        start = time.perf_counter()
        data = self.entries.get(key)
        if data is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_read += data.numel()
        self.stats.load_seconds += time.perf_counter() - start
        return data

    def put(self, key: Key, data: Tensor) -> None:
        """Hold ``data`` (a uint8 tensor this tier now owns); older entries make room."""
        size = data.numel()
        if size > self.stats.budget or key in self.entries:
            return
        while self.stats.used + size > self.stats.budget:
            _, old = self.entries.popitem(last=False)
            self.stats.used -= old.numel()
        self.entries[key] = data
        self.stats.used += size
        self.stats.stored += 1
        self.stats.bytes_written += size
        self.stats.blocks = len(self.entries)


class DiskTier:
    """Blocks as files in ``directory/<fingerprint>/``, written behind by one thread; the least
    recently used files (of every fingerprint in the directory) are deleted to stay within
    ``budget`` bytes. Safe to share between processes: each writes under its own temporary names
    and renames, and treats a file another one deleted as a miss."""

    def __init__(self, directory: Path, budget: int, fingerprint: bytes) -> None:
        self.root = Path(directory)
        self.fingerprint = fingerprint
        self.folder = self.root / fingerprint.hex()
        self.stats = TierStats("disk", budget)
        self._lock = threading.Lock()  # the index, shared with the writer thread
        self._index: OrderedDict[Path, int] = OrderedDict()  # file -> bytes, oldest first
        self._pending: set[Key] = set()
        self._unreadable: set[Key] = set()  # files this process failed to read: misses from now on
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[Key, Tensor] | None] = queue.Queue()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._stop_writing(e)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvlab-disk-tier", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvlab-disk-read")
        self._lent: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self._spare: dict[int, list[Tensor]] = {}  # by size: buffers read_many may fill again

    # --- reading --------------------------------------------------------------------------------
    def path(self, key: Key) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def __contains__(self, key: Key) -> bool:
        """Held here (written: a queued block is not yet): in the index, or written since by
        another process sharing the directory."""
        path = self.path(key)
        with self._lock:
            if key in self._unreadable:
                return False
            if path in self._index:
                return True
        return path.is_file()

    def read(self, key: Key) -> Tensor | None:
        """The block's payload, checked; None (a miss) if it is missing or not a whole, valid
        block of this fingerprint and key, which is then deleted."""
        return self.read_many([key])[0]

    def read_many(self, keys: list[Key]) -> list[Tensor | None]:
        """``read`` for a run of blocks, READERS at a time: the device then has many reads queued,
        not one (file reads and CRC-32 let go of the GIL)."""
        start = time.perf_counter()
        paths = [self.path(k) for k in keys]
        got = list(self._readers.map(self._read_checked, paths, keys))
        with self._lock:
            for key, path, data in zip(keys, paths, got):
                if data is None:
                    self.stats.misses += 1
                    self._unreadable.add(key)
                    self._forget(path)
                    continue
                self._hold(path, HEADER.size + data.numel())  # another process may have written it
                self.stats.hits += 1
                self.stats.bytes_read += HEADER.size + data.numel()
            self.stats.load_seconds += time.perf_counter() - start
        return got

    def _read_checked(self, path: Path, key: Key) -> Tensor | None:
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(HEADER.size)
                if len(header) < HEADER.size:
                    return self._bad(path, "truncated header")
                magic, version, fingerprint, file_key, length, crc = HEADER.unpack(header)
                if (magic, version, fingerprint, file_key) != (MAGIC, BLOCK_FORMAT, self.fingerprint, key):
                    return self._bad(path, "foreign or older block")
                data = self._buffer(length)
                view = memoryview(data.numpy())
                got = f.readinto(view)
                if got != length or f.read(1):
                    return self._bad(path, "truncated or overlong payload")
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("KV disk tier: cannot read %s (%s): a miss", path.name, e)
            return None
        if zlib.crc32(view) != crc:
            return self._bad(path, "checksum mismatch")
        return data

    def _buffer(self, length: int) -> Tensor:
        with self._lock:
            spare = self._spare.get(length)
            data = spare.pop() if spare else torch.empty(length, dtype=torch.uint8)
            self._lent[id(data)] = data
        return data

    def recycle(self, blocks: Iterable[Tensor]) -> None:
        """Take back buffers ``read_many`` gave once their bytes are copied out (others are
        ignored), to fill them again without faulting in fresh pages."""
        with self._lock:
            kept = sum(t.numel() for ts in self._spare.values() for t in ts)
            for data in blocks:
                if self._lent.get(id(data)) is data and kept + data.numel() <= SPARE_BYTES:
                    del self._lent[id(data)]
                    self._spare.setdefault(data.numel(), []).append(data)
                    kept += data.numel()

    def _bad(self, path: Path, why: str) -> None:
        log.warning("KV disk tier: %s is unusable (%s): a miss, deleted", path.name, why)
        with self._lock:
            self.stats.bad += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # --- writing --------------------------------------------------------------------------------
    def wants(self, key: Key) -> bool:
        """Writing is on and the block is neither held, nor queued, nor written by another process."""
        if not self.stats.writable:
            return False
        with self._lock:
            if key in self._pending:
                return False
        return key not in self

    def write_behind(self, key: Key, data: Tensor) -> None:
        """Queue ``data`` (a uint8 tensor the tier now owns) to be written off the step's path."""
        if not self.stats.writable:
            return
        with self._lock:
            if key in self._pending or self.path(key) in self._index:
                return
            if self._pending_bytes + data.numel() > MAX_PENDING_BYTES:
                self.stats.dropped += 1
                return
            self._pending.add(key)
            self._pending_bytes += data.numel()
        self._queue.put((key, data))

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer and reader threads."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._readers.shutdown()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, data = item
                if self.stats.writable:
                    try:
                        self._write(key, data)
                    except OSError as e:
                        self._stop_writing(e)
                if not self.stats.writable:
                    self.stats.dropped += 1
                with self._lock:
                    self._pending.discard(key)
                    self._pending_bytes -= data.numel()
            finally:
                self._queue.task_done()

    def _write(self, key: Key, data: Tensor) -> None:
        payload = memoryview(data.numpy())
        size = HEADER.size + len(payload)
        if size > self.stats.budget:
            return
        self._make_room(size)
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        header = HEADER.pack(MAGIC, BLOCK_FORMAT, self.fingerprint, key, len(payload), zlib.crc32(payload))
        try:
            self._write_file(tmp, header, payload)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        with self._lock:
            self._hold(path, size)
            self._unreadable.discard(key)
            self.stats.stored += 1
            self.stats.bytes_written += size

    def _write_file(self, path: Path, header: bytes, payload: memoryview) -> None:
        with open(path, "xb", buffering=0) as f:
            for part in (header, payload):
                view = memoryview(part)
                while view:
                    view = view[f.write(view):]

    def _make_room(self, size: int) -> None:
        """Delete least recently used files until ``size`` more bytes fit in the budget."""
        while True:
            with self._lock:
                if self.stats.used + size <= self.stats.budget or not self._index:
                    return
                old = next(iter(self._index))
                self._forget(old)
            try:
                old.unlink()
            except FileNotFoundError:
                pass

    def _stop_writing(self, error: OSError) -> None:
        if self.stats.writable:
            log.warning("KV disk tier: cannot write to %s (%s); it serves what it holds and writes "
                        "no more", self.root, error)
        self.stats.writable = False

    def _hold(self, path: Path, size: int) -> None:
        """Index a file as the most recently used (the lock is held)."""
        self._forget(path)
        self._index[path] = size
        self.stats.used += size
        self.stats.blocks += 1

    def _forget(self, path: Path) -> None:
        """Drop a file from the index, if it is there (the lock is held)."""
        size = self._index.pop(path, None)
        if size is not None:
            self.stats.used -= size
            self.stats.blocks -= 1

    def _scan(self) -> None:
        """Index the block files already in the directory (every fingerprint's, for the budget),
        oldest first by modification time; delete temporary files of writers long dead."""
        found = []
        now = time.time()
        try:
            folders = [d for d in self.root.iterdir() if d.is_dir()]
        except OSError:
            folders = []
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if entry.name.endswith(SUFFIX):
                    found.append((st.st_mtime, Path(entry.path), st.st_size))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
        with self._lock:
            for _, path, size in sorted(found):
                self._hold(path, size)
        if self.stats.used > self.stats.budget:
            self._make_room(0)


class TierChain:
    """RAM then disk, as the KV manager asks them: where is a block, hand it over, take one."""

    def __init__(self, ram: RamTier | None, disk: DiskTier | None) -> None:
        self.ram, self.disk = ram, disk

    @property
    def tiers(self) -> list[RamTier | DiskTier]:
        return [t for t in (self.ram, self.disk) if t is not None]

    def where(self, key: Key) -> str | None:
        """Which tier holds the block ("ram", "disk"), without reading it."""
        if self.ram is not None and key in self.ram:
            return "ram"
        if self.disk is not None and key in self.disk:
            return "disk"
        return None

    def fetch(self, keys: list[Key]) -> list[tuple[str, Tensor] | None]:
        """Each block's bytes and the tier they came from, or None (counted as a miss); the disk
        tier's in one ``read_many``."""
        got: list[tuple[str, Tensor] | None] = [None] * len(keys)
        from_disk = []
        for i, key in enumerate(keys):
            data = self.ram.get(key) if self.ram is not None and key in self.ram else None
            if data is not None:
                got[i] = ("ram", data)
            elif self.disk is not None:
                from_disk.append(i)
        if from_disk:
            assert self.disk is not None
            for i, data in zip(from_disk, self.disk.read_many([keys[i] for i in from_disk])):
                got[i] = None if data is None else ("disk", data)
        return got

    def wants_computed(self, key: Key) -> bool:
        """A newly computed block is to be written (to the disk tier, behind the step)."""
        return self.disk is not None and self.disk.wants(key)

    def computed(self, key: Key, data: Tensor) -> None:
        assert self.disk is not None
        self.disk.write_behind(key, data)

    def wants_leaving(self, key: Key) -> bool:
        """A block leaving the pool is to be kept (in the RAM tier)."""
        return self.ram is not None and key not in self.ram

    def leaving_pool(self, key: Key, data: Tensor) -> None:
        assert self.ram is not None
        self.ram.put(key, data)

    def loaded(self, blocks: Iterable[Tensor]) -> None:
        """These blocks' bytes are in the pool now: the disk tier may reuse its read buffers."""
        if self.disk is not None:
            self.disk.recycle(blocks)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


# --- the fingerprint ----------------------------------------------------------------------------
def file_digest(paths: Iterable[Path], memo: Path | None = None) -> str:
    """blake2b of the files' contents, in order; remembered in ``memo`` (a JSON file) by path,
    size and modification time, so a large GGUF is read once, not at every start."""
    paths = [Path(p).resolve() for p in paths]
    stamp = json.dumps([[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths])
    known: dict[str, str] = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
        if stamp in known:
            return known[stamp]
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        known[stamp] = digest
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, memo)
        except OSError:
            pass  # a read-only directory: hashed again next time
    return digest


def fingerprint(parts: dict[str, object]) -> bytes:
    """16 bytes naming everything in ``parts`` (JSON-serialisable), kvlab's block format included."""
    text = json.dumps({"block_format": BLOCK_FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
