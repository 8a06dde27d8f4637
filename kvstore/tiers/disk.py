"""Disk tier: an lmdb environment of chunk values written by a background thread.

Each value is ``kvstore.codec``'s header + payload (codec chosen per chunk). A lossy tier codec
(``int8``, ``fp8``) is used only for chunks whose namespace accepts it (``lossy_codec_of``, set
by the store; ``kvstore.kv_codec``'s rule); other chunks are written with ``auto``. ``put`` queues the
chunk and returns; the writer thread encodes and commits queued operations in order, a batch
per transaction. Until committed, a chunk is served from the queue, so it is visible at once.

Space: ``capacity_bytes`` bounds the sum of stored value sizes (a queued chunk counts with its
raw size + header until it is encoded). The lmdb map is larger (``map_bytes``) to leave room
for lmdb's own pages; if lmdb still reports the map full, the writer evicts committed chunks as
the store's eviction would choose them (``DiskWriter._room_victim``; counted in ``evictions``
and, through ``evicted``, ``dropped_chunks``) and retries, else drops the write (counted as
``dropped_write``, logged) and the chunk disappears from the index, so lookups never report it.
The capacity is lowered at open, and again when a write finds the filesystem full, to what the
filesystem can hold, and raised back toward the configured capacity
(``configured_capacity_bytes``) when free space returns (``kvstore.tiers.disk_writer``).

Opening refuses a ``data.mdb`` shorter than the pages lmdb's metadata uses (a read past its end
is a SIGBUS; a file truncated while open cannot be guarded against) and, unless
``allow_shrink``, a path holding more than ``capacity_bytes`` (``kvstore.tiers.disk_space``).

Reads verify the header (magic, version, key, sizes) and the payload checksum; a bad value is
deleted, counted as ``corruption`` and reported as a miss. Reopening a path re-indexes every
value from its header; the store then makes the chunks whose parent is not on disk (stored
nowhere after a restart: unreachable) the first victims (``demote_unreachable``), until
their parent is stored again (``revive``).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import lmdb
import torch

from kvstore.codec import HEADER_BYTES_MAX, CorruptChunkError, unpack_header, unpack_value
from kvstore.keys import ChunkKey
from kvstore.kv_codec import chunk_codec
from kvstore.layout import DTYPES
from kvstore.tiers.base import Tier, TierFullError
from kvstore.tiers.disk_space import DiskShrinkRefused, check_data_file
from kvstore.tiers.disk_writer import BATCH_OPS, DiskWriter, _PutOp  # noqa: F401 (re-export)
from kvstore.tiers.pathlock import PathLock
from kvstore.units import format_size

log = logging.getLogger("kvstore.tiers.disk")

#: Queued (not yet written) bytes above which ``put`` waits for the writer.
QUEUE_BYTES = 256 * 2**20


@dataclass
class _DiskEntry:
    nbytes: int
    parent: ChunkKey | None


def default_map_bytes(capacity_bytes: int) -> int:
    """lmdb map size for a capacity: 1.5x plus 32 MiB for lmdb's B-tree and free pages."""
    return (int(capacity_bytes * 1.5) + 32 * 2**20 + 4095) // 4096 * 4096


class DiskTier(DiskWriter, Tier):
    """lmdb-backed tier at ``path`` (a directory, created if missing).

    ``codec``: see ``StoreConfig.disk_codec``. ``allow_shrink``: when ``path`` holds more
    than ``capacity_bytes``, evict down to it at open (else refuse: ``DiskShrinkRefused``).
    ``lossy_codec_of(ns_id)`` (set by the store; default: none accepted) names the lossy codec
    a namespace accepts (``""``: none). The capacity is lowered at open to what the filesystem
    can hold (``DiskWriter.cap_to_filesystem``).

    The tier holds an exclusive lock on ``path`` (``kvstore.tiers.pathlock``) from open to
    ``close``: one open disk tier per path, in any process.

    Raises:
        ValueError: capacity <= 0. DiskFileTruncated (a ``ValueError``): ``data.mdb`` is
            shorter than lmdb's metadata says it uses (``kvstore.tiers.disk_space``).
            DiskShrinkRefused (a ``ValueError``): ``path`` holds more than ``capacity_bytes``
            and ``allow_shrink`` is False, naming both sizes. NotADirectoryError: ``path`` is
            a file. lmdb.Error: the environment cannot be opened.
        DiskPathInUse (an ``OSError`` and a ``ValueError``): another open disk tier holds
            ``path`` (the message names the path and the holder's pid).
    """

    def __init__(self, path: str, capacity_bytes: int, policy_name: str = "lru",
                 codec: str = "auto", map_bytes: int | None = None,
                 allow_shrink: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0, got {capacity_bytes}")
        super().__init__("disk", capacity_bytes, policy_name)
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(f"disk tier path {path!r} is a file, not a directory")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.codec = codec
        self.allow_shrink = allow_shrink
        self.lossy_codec_of: Callable[[bytes], str] = lambda ns_id: ""
        self._path_lock = PathLock(path)
        self.env = None
        self._index: dict[ChunkKey, _DiskEntry] = {}
        self._pending: dict[ChunkKey, _PutOp] = {}
        #: chunks deleted from the index whose lmdb delete failed: their stored bytes
        self._doomed: dict[ChunkKey, int] = {}
        #: chunks ``demote_unreachable`` demoted, until ``revive`` finds them reachable again
        self._unreachable_demoted: set[ChunkKey] = set()
        self._init_writer_logs()
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._inflight = 0
        self._used = 0
        self._cond = threading.Condition(self._lock)
        self._closed = False
        try:
            # readahead stays on: values are whole chunks (megabytes) read front to back, and
            # without it (MADV_RANDOM on the map) a cold read faults 4 KiB at a time: 27-37 MB/s
            # against 1.2-1.35 GB/s with it on this machine's disk (bench.store_micro's
            # disk_cold_get_gbps)
            self.env = lmdb.open(path, map_size=map_bytes or default_map_bytes(capacity_bytes),
                                 subdir=True, readahead=True, max_readers=512, metasync=False)
            check_data_file(self.env, path)  # a short data.mdb: SIGBUS on the first read
            self._reindex()
            self.cap_to_filesystem()  # a disk tier larger than its filesystem evicts, not fails
        except BaseException:
            if self.env is not None:
                self.env.close()
            self._path_lock.release()
            raise
        self._writer = threading.Thread(target=self._writer_loop, name="kvstore-disk-writer", daemon=True)
        self._writer.start()

    # ---- index ------------------------------------------------------------------------------
    def _reindex(self) -> None:
        """Rebuild the index from the values' headers; drop values whose header is bad."""
        bad = []
        with self.env.begin(buffers=True) as txn:
            for raw_key, value in txn.cursor():
                try:
                    key = ChunkKey.from_bytes(bytes(raw_key))
                    h = unpack_header(value)
                    if h.key != bytes(key):
                        raise CorruptChunkError("header key differs from the lmdb key")
                    parent = ChunkKey.from_bytes(h.parent) if h.parent else None
                except (CorruptChunkError, ValueError):
                    bad.append(bytes(raw_key))
                    continue
                self._index[key] = _DiskEntry(len(value), parent)
                self._used += len(value)
                self._largest_value = max(self._largest_value, len(value))
                self.policy.on_insert(key, len(value), parent)
        if bad:
            with self.env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k)
            log.warning("disk tier %s: dropped %d values with a bad header at open", self.path, len(bad))
            self.listener("corruption", self.name, len(bad))
        if self._used > self.capacity_bytes and not self.allow_shrink:
            raise DiskShrinkRefused(
                f"disk tier {self.path} holds {self._used} bytes ({format_size(self._used)}) in "
                f"{len(self._index)} chunks, more than its capacity of {self.capacity_bytes} "
                f"bytes ({format_size(self.capacity_bytes)}, --disk-bytes): refusing to evict "
                f"them at open; give the capacity they need, or allow the eviction with "
                f"--disk-shrink (StoreConfig.allow_disk_shrink)")
        shrunk, before = 0, self._used
        # capacity shrank since last run (allowed): the chunks whose parent is not on disk go
        # first (deepest first), then the policy's victims
        cut = self._unreachable() if self._used > self.capacity_bytes else []
        while self._used > self.capacity_bytes:
            victim = cut.pop() if cut else self.policy.next_victim()
            self.delete(victim)
            self.listener("eviction", self.name, 1)
            shrunk += 1
        if shrunk:
            log.warning("disk tier %s: held %d bytes, more than its capacity of %d bytes "
                        "(shrinking allowed): evicted %d chunks (%d bytes) at open", self.path,
                        before, self.capacity_bytes, shrunk, before - self._used)
        self.num_bad_at_open = len(bad)

    def demote_unreachable(self) -> tuple[int, int]:
        """Demote (``Tier.demote``: first victims, deepest first) every chunk whose chain of
        recorded parents leaves this tier (its parent, or an ancestor's, is not here). Meant
        for the store's open, when no other tier holds a chunk yet (and none below this one
        may hold the parent: no remote tier): such chunks are unreachable (``unreachable_bytes``)
        until their parent is stored again. They are kept, not deleted (a recomputed parent
        makes them reachable again: reading one lifts its demotion, and so does ``revive`` when
        one comes up as a victim while reachable). A parent cycle (which only
        a lying client can record) is not looked for. O(chunks here). Logs one line when some
        are demoted. Returns (chunks, bytes) demoted."""
        with self._lock:
            cut = self._unreachable()
            for k in cut:
                self._policy_call("demote", k)
            self._unreachable_demoted.update(cut)
            nbytes = sum(self._index[k].nbytes for k in cut)
        if cut:
            log.info("disk tier %s: %d chunks (%s) whose parent is stored nowhere are kept as "
                     "the first victims (reachable again if their parent is stored again)",
                     self.path, len(cut), format_size(nbytes))
        return len(cut), nbytes

    def revive(self, key: ChunkKey, reachable: Callable[[ChunkKey], bool]) -> bool:
        """Lift the demotion of ``key`` (its rank in the policy's order stays) when
        ``demote_unreachable`` demoted it and ``reachable(key)`` says a lookup reaches it now
        (its parent was stored again, in any tier). Asked by the store of the victim it is
        about to evict (``kvstore.movement.TierMover``), so a chunk made reachable again is
        not evicted first; O(1) for any other key. Returns whether it lifted the demotion."""
        if key not in self._unreachable_demoted or not reachable(key):  # (other tiers: no lock)
            return False
        with self._lock:
            self._unreachable_demoted.discard(key)
            self._policy_call("undemote", key)
        return True

    def _unreachable(self) -> list[ChunkKey]:
        """Keys whose parent, or an ancestor's, is not in the index (a parent cycle is not
        looked for), breadth first from those whose parent is missing: deepest last."""
        index = self._index
        frontier = [k for k, e in index.items() if e.parent is not None and e.parent not in index]
        cut = list(frontier)
        while frontier:  # their descendants (each key has one parent: none twice)
            frontier = [c for k in frontier for c in self.policy.children(k)]
            cut.extend(frontier)
        return cut

    @property
    def used_bytes(self) -> int:
        return self._used + sum(self._doomed.values())

    def footprint(self, nbytes: int) -> int:
        return nbytes + HEADER_BYTES_MAX

    def contains(self, key: ChunkKey) -> bool:
        return key in self._index

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._index)

    @property
    def num_chunks(self) -> int:
        return len(self._index) + len(self._doomed)

    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        e = self._index.get(key)
        return e.parent if e else None

    def nbytes_of(self, key: ChunkKey) -> int:
        e = self._index.get(key)
        return e.nbytes if e else 0

    def is_pending(self, key: ChunkKey) -> bool:
        return key in self._pending

    def _index_items(self):
        return [(k, e.nbytes, e.parent) for k, e in self._index.items()]

    # ---- put / delete -------------------------------------------------------------------------
    def put(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
            owned: bool = False) -> None:
        cpu = kv.detach()
        if cpu.device.type != "cpu":
            cpu = cpu.to("cpu")  # a new tensor
        elif not owned:
            cpu = cpu.clone()  # the caller may reuse its buffer once put returns
        cpu = cpu.contiguous()  # [num_layers, 2, chunk, heads, head_dim]
        nbytes = self.footprint(cpu.numel() * cpu.element_size())
        with self._cond:
            if self._closed:
                raise RuntimeError("disk tier is closed")
            if key in self._index:
                raise KeyError(f"{key!r} already in disk tier")
            if nbytes > self.free_bytes:
                raise TierFullError(f"disk tier: need {nbytes} bytes, {self.free_bytes} free")
            while self._queued_bytes > QUEUE_BYTES:
                self._cond.wait()
            op = _PutOp(key, cpu, parent,
                        chunk_codec(self.codec, self.lossy_codec_of(key.ns_id), "auto"))
            self._index[key] = _DiskEntry(nbytes, parent)
            self._used += nbytes
            self._pending[key] = op
            self._queue.append(op)
            self._queued_bytes += nbytes
            self._track(key, nbytes, parent)
            self._cond.notify_all()

    def delete(self, key: ChunkKey) -> bool:
        with self._cond:
            e = self._index.pop(key, None)
            if e is None:
                return False
            self._used -= e.nbytes
            self._pending.pop(key, None)
            self._unreachable_demoted.discard(key)
            self._queue.append(("del", key))
            self._policy_call("on_remove", key)
            self._cond.notify_all()
            return True

    # ---- read ---------------------------------------------------------------------------------
    def read(self, key: ChunkKey, device: torch.device | str = "cpu") -> torch.Tensor | None:
        with self._lock:
            op = self._pending.get(key)
            if op is not None:
                return op.kv.to(device, copy=True)
            if key not in self._index:
                return None
        try:
            with self.env.begin(buffers=True) as txn:
                buf = txn.get(bytes(key))
                if buf is None:
                    return None  # deleted since the index check
                h, raw = unpack_value(buf, bytes(key))
        except CorruptChunkError as e:
            self._corrupt(key, str(e))
            return None
        t = torch.from_numpy(raw).view(DTYPES[h.dtype]).view(h.shape)  # [layers, 2, chunk, heads, head_dim]
        return t if str(device) == "cpu" else t.to(device)

    def _corrupt(self, key: ChunkKey, why: str) -> None:
        log.warning("disk tier %s: chunk %r is corrupt (%s); deleted", self.path, key, why)
        self.listener("corruption", self.name, 1)
        with self._lock:
            gone = key in self._index and key not in self._pending and self.delete(key)
        if gone:
            self.lost(key)

    # ---- lifecycle ----------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued operation is committed. Returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout)

    def wait_committed(self, keys, timeout: float | None = None) -> bool:
        """Wait until no put of ``keys`` is queued (each one committed, or dropped and gone
        from the index). Returns False on timeout."""
        keys = list(keys)
        with self._cond:
            return self._cond.wait_for(lambda: not any(k in self._pending for k in keys), timeout)

    def check_integrity(self) -> None:
        with self._lock:
            super().check_integrity()
            assert self._used == sum(e.nbytes for e in self._index.values()), "disk: used bytes drifted"
            assert set(self._pending) <= set(self._index), "disk: a queued put is not indexed"

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        try:
            self._retry_doomed_at_close()
            self.env.sync(True)
            self.env.close()
        finally:
            self._path_lock.release()
