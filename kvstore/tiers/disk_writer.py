"""The disk tier's writer thread (a mixin of ``kvstore.tiers.disk.DiskTier``).

It commits queued operations in order, a batch per lmdb transaction. When a batch cannot be
committed because lmdb's map is full, or because the filesystem is full (lmdb reports a short
write as ``Input/output error``; the free space ``statvfs`` reports tells the two apart), it
commits the batch's operations one by one, evicting committed unpinned chunks while a put does
not fit (chosen and counted as the store's own eviction: ``_room_victim``, ``evicted``), and
drops a put only when nothing is evictable. On a full filesystem the
tier's capacity is also lowered to what the filesystem can hold (``disk_space.filesystem_cap``,
never below the bytes stored), so the store evicts before writing instead of after failing; one
line (rate-limited) says both. While the capacity is below the configured one, the writer checks
the filesystem's free space (``statvfs``) at most every ``CAPACITY_CHECK_INTERVAL_S`` after a
batch, and raises the capacity back toward the configured one (never above it nor above what
the filesystem can hold) when space came back, with one INFO line.

A delete that cannot be committed (a full filesystem leaves lmdb no page for it) keeps its
chunk's bytes counted in ``used_bytes`` and ``num_chunks`` (the chunk is no longer served) and
is retried with every later batch; one still failing at ``close`` leaves that chunk in lmdb,
found again by the next open. Errors are logged at most once per ``ERROR_LOG_INTERVAL_S`` with
a count of the lines left out.
"""
from __future__ import annotations

import logging
import time

import lmdb
import torch

from kvstore.codec import pack_value
from kvstore.layout import dtype_name
from kvstore.tiers.disk_space import RateLimitedLog, filesystem_cap, free_bytes

log = logging.getLogger("kvstore.tiers.disk")

#: Operations committed per lmdb transaction at most.
BATCH_OPS = 64
#: Seconds between two log lines of the same repeated writer error.
ERROR_LOG_INTERVAL_S = 10.0
#: Free bytes below which a failed write (beyond what it needed) counts as a full filesystem.
FS_FULL_SLACK_BYTES = 1 << 20
#: Seconds between two checks of whether a lowered capacity can be raised again.
CAPACITY_CHECK_INTERVAL_S = 10.0
#: Least raise of a lowered capacity worth making (with at least the largest value's bytes).
CAPACITY_RAISE_MIN_BYTES = 1 << 20


class _PutOp:
    __slots__ = ("key", "kv", "parent", "codec")

    def __init__(self, key, kv: torch.Tensor, parent, codec: str) -> None:
        self.key, self.kv, self.parent = key, kv, parent  # kv: CPU, contiguous, owned
        self.codec = codec


class DiskWriter:
    """Writer-thread methods of ``DiskTier`` (uses its ``env``, ``_cond``, ``_queue``,
    ``_pending``, ``_index``, ``_doomed`` and policy)."""

    def _init_writer_logs(self) -> None:
        """Set up the writer's logs and capacity state (call after ``capacity_bytes`` is set
        to the configured capacity)."""
        self._error_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._full_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._drop_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        #: bytes of the largest value written or found at open (``cap_to_filesystem``)
        self._largest_value = 0
        #: the capacity asked for (``--disk-bytes``): a lowered capacity is raised up to it
        self.configured_capacity_bytes = self.capacity_bytes
        #: seconds between two checks of the free space while the capacity is lowered
        self.capacity_check_s = CAPACITY_CHECK_INTERVAL_S
        self._capacity_checked = time.monotonic()
        self._capacity_logged = self.capacity_bytes   # as the last full-filesystem line said

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH_OPS, len(self._queue)))]
                batch = [("del", k) for k in self._doomed] + batch  # retried until committed
                self._inflight += 1
            try:
                self._write_batch(batch)
            except Exception as e:
                if isinstance(e, (lmdb.Error, OSError)):  # an I/O error: one line per interval
                    self._error_log.log(
                        logging.ERROR, "disk tier %s: writing a batch of %d failed (%s: %s; %s); "
                        "dropping its puts", self.path, len(batch), type(e).__name__, e,
                        self._free_text())
                else:
                    log.exception("disk tier %s: writer failed on a batch; dropping its puts",
                                  self.path)
                self.listener("error", self.name, 1)
                for op in batch:
                    if isinstance(op, _PutOp):
                        self._drop(op, "writer error", quiet=True)
                    else:
                        self._delete_failed(op[1])
            finally:
                try:
                    self._raise_capacity()   # (a no-op unless the capacity was lowered)
                finally:
                    with self._cond:
                        self._inflight -= 1
                        self._queued_bytes -= sum(
                            self.footprint(op.kv.numel() * op.kv.element_size())
                            for op in batch if isinstance(op, _PutOp))
                        self._cond.notify_all()

    def _free_text(self) -> str:
        free = free_bytes(self.path)
        return f"{free} bytes free on {self.path}" if free is not None else "free space unknown"

    def _encode(self, op: _PutOp) -> bytes:
        raw = op.kv.reshape(-1).view(torch.uint8).numpy()  # [nbytes]
        parent = bytes(op.parent) if op.parent is not None else None
        return pack_value(bytes(op.key), parent, raw, dtype_name(op.kv.dtype), tuple(op.kv.shape),
                          op.codec, fallback="auto")

    def _fs_full(self, need: int) -> bool:
        """Is the filesystem too full for ``need`` more bytes? When so: lower the capacity to
        what the filesystem holds (``filesystem_cap``) and log both in one line (at most one
        per ``ERROR_LOG_INTERVAL_S``; it names the capacity change since the previous one)."""
        free = free_bytes(self.path)
        if free is None or free >= need + FS_FULL_SLACK_BYTES:
            return False
        self.cap_to_filesystem(quiet=True)
        with self._lock:
            before, now = self._capacity_logged, self.capacity_bytes
        lowered = (f"; capacity lowered from {before} to {now} bytes, what the filesystem can "
                   f"hold (data file + free space)" if now < before else "")
        if self._full_log.log(logging.ERROR, "disk tier %s: filesystem full: %d bytes free on "
                              "%s%s; committing one operation at a time, evicting to make room",
                              self.path, free, self.path, lowered):
            with self._lock:
                self._capacity_logged = now
        return True

    def cap_to_filesystem(self, quiet: bool = False) -> None:
        """Lower ``capacity_bytes`` to what the filesystem can hold (``filesystem_cap`` with
        the largest value stored so far), never below ``used_bytes``; logs the change unless
        ``quiet``. No-op when the free space cannot be read."""
        cap = filesystem_cap(self.path, self._largest_value)
        with self._lock:
            if cap is None or cap >= self.capacity_bytes:
                return
            old, self.capacity_bytes = self.capacity_bytes, max(cap, self.used_bytes)
            new = self.capacity_bytes
            if not quiet:
                self._capacity_logged = new
        if new < old and not quiet:
            log.warning("disk tier %s: capacity lowered from %d to %d bytes, what its "
                        "filesystem can hold (data file + free space)", self.path, old, new)

    def _raise_capacity(self) -> None:
        """Raise a lowered ``capacity_bytes`` toward ``configured_capacity_bytes`` when the
        filesystem has room again (``filesystem_cap``, never above it nor above the configured
        capacity), by at least ``CAPACITY_RAISE_MIN_BYTES`` and the largest value; logs the
        change at INFO. Reads the free space at most once per ``capacity_check_s`` seconds,
        and not at all while the capacity is the configured one."""
        if self.capacity_bytes >= self.configured_capacity_bytes:
            return
        now = time.monotonic()
        if now - self._capacity_checked < self.capacity_check_s:
            return
        self._capacity_checked = now
        cap = filesystem_cap(self.path, self._largest_value)
        if cap is None:
            return
        with self._lock:
            old = self.capacity_bytes
            new = min(cap, self.configured_capacity_bytes)
            if new - old < max(CAPACITY_RAISE_MIN_BYTES, self._largest_value) and \
                    new < self.configured_capacity_bytes:
                return
            if new <= old:
                return
            self.capacity_bytes = self._capacity_logged = new
        log.info("disk tier %s: its filesystem has room again (%s): capacity raised from %d to "
                 "%d bytes (configured: %d)", self.path, self._free_text(), old, new,
                 self.configured_capacity_bytes)

    def _write_batch(self, batch: list) -> None:
        values = {}
        for op in batch:
            if isinstance(op, _PutOp) and self._pending.get(op.key) is op:
                values[id(op)] = self._encode(op)
        try:
            with self.env.begin(write=True) as txn:
                for op in batch:
                    if isinstance(op, _PutOp):
                        if id(op) in values:
                            txn.put(bytes(op.key), values[id(op)])
                    else:
                        txn.delete(bytes(op[1]))
        except lmdb.MapFullError:
            return self._one_by_one(batch, values)
        except (lmdb.Error, OSError):
            if not self._fs_full(sum(len(v) for v in values.values())):
                raise
            return self._one_by_one(batch, values)
        for op in batch:
            if isinstance(op, _PutOp):
                if id(op) in values:
                    self._committed(op, len(values[id(op)]))
            else:
                self._delete_committed(op[1])

    def _one_by_one(self, batch: list, values: dict) -> None:
        """Commit each operation on its own, evicting to make room for puts."""
        for op in batch:
            if isinstance(op, _PutOp):
                if id(op) in values and self._put_with_eviction(op, values[id(op)]):
                    self._committed(op, len(values[id(op)]))
            elif self._delete_now(op[1]):
                self._delete_committed(op[1])
            else:
                self._delete_failed(op[1])

    def _delete_now(self, key) -> bool:
        """Commit the delete of ``key`` in its own transaction; False when lmdb cannot."""
        try:
            with self.env.begin(write=True) as txn:
                txn.delete(bytes(key))
            return True
        except (lmdb.Error, OSError) as e:
            self._error_log.log(logging.ERROR, "disk tier %s: deleting a chunk failed (%s: %s; "
                                "%s); retried with the next write", self.path,
                                type(e).__name__, e, self._free_text())
            return False

    def _delete_failed(self, key) -> None:
        """A delete of ``key`` was not committed: count the bytes lmdb still holds for it
        (unless a newer put of the key is indexed) until a retry commits it."""
        try:
            with self.env.begin() as txn:
                value = txn.get(bytes(key))
        except lmdb.Error:  # cannot even read: nothing known to count
            return
        with self._lock:
            if value is None:
                self._doomed.pop(key, None)
            elif key not in self._index and key not in self._doomed:
                self._doomed[key] = len(value)

    def _retry_doomed_at_close(self) -> None:
        """Last try at the deletes lmdb could not commit (the writer has stopped); those that
        still fail are logged: the next open finds their chunks again."""
        for key in list(self._doomed):
            if self._delete_now(key):
                self._delete_committed(key)
        if self._doomed:
            log.warning("disk tier %s: %d deleted chunks could not be removed from lmdb (%s); "
                        "the next open finds them again", self.path, len(self._doomed),
                        self._free_text())

    def _delete_committed(self, key) -> None:
        with self._lock:
            self._doomed.pop(key, None)

    def _committed(self, op: _PutOp, stored: int) -> None:
        with self._lock:
            self._largest_value = max(self._largest_value, stored)
            self._doomed.pop(op.key, None)  # the put replaced a value whose delete failed
            if self._pending.get(op.key) is op:
                del self._pending[op.key]
                e = self._index[op.key]
                self._used += stored - e.nbytes
                e.nbytes = stored

    def _put_with_eviction(self, op: _PutOp, value: bytes) -> bool:
        """Write one value, evicting committed unpinned chunks while lmdb's map or the
        filesystem is full. Returns whether it was written (False: superseded or dropped)."""
        while True:
            if self._pending.get(op.key) is not op:
                return False
            try:
                with self.env.begin(write=True) as txn:
                    txn.put(bytes(op.key), value)
                return True
            except lmdb.MapFullError:
                why = "lmdb map full"
            except (lmdb.Error, OSError):
                if not self._fs_full(len(value)):
                    raise
                why = "filesystem full"
            with self._lock:
                victim = self._room_victim()
                if victim is not None:
                    self.delete(victim)
                    self._queue.remove(("del", victim))
            if victim is None:  # (the store lock may be taken by ``lost``: not under ours)
                self._drop(op, f"{why} and nothing evictable")
                return False
            # out of the index now (no longer served): counted as the store counts its own
            self.listener("eviction", self.name, 1)
            self.evicted(victim)
            if not self._delete_now(victim):
                self._delete_failed(victim)
                self._drop(op, f"{why} and evicting failed", quiet=True)
                return False
            log.debug("disk tier %s: %s; evicted %r", self.path, why, victim)

    def _room_victim(self):
        """The victim the store's own eviction would take from this tier
        (``kvstore.movement.TierMover._pick``): the policy's next committed key the store
        lets go (``evictable``: unpinned, and its going strands no stored chunk, so a head
        never goes before its stored tail), a chunk demoted as unreachable at open first
        unless ``reachable`` says its parent is stored again (then its demotion is lifted,
        ``revive``, and the policy asked again). None when no key may go. Under the lock."""
        def can_evict(k) -> bool:
            return k not in self._pending and self.evictable(k)

        while True:
            victim = self.next_victim(can_evict)
            if victim is None or not self.revive(victim, self.reachable):
                return victim

    def _drop(self, op: _PutOp, why: str, quiet: bool = False) -> None:
        """Forget a queued write that will not be made; the store learns the chunk is lost
        (``lost``: its stored descendants go). ``quiet``: the cause was logged already."""
        with self._lock:
            dropped = self._pending.get(op.key) is op
            if dropped:
                self.delete(op.key)
                self._queue.remove(("del", op.key))
        if not quiet:
            self._drop_log.log(logging.WARNING, "disk tier %s: %s; dropped the write of %r",
                               self.path, why, op.key)
        self.listener("dropped_write", self.name, 1)
        if dropped:
            self.lost(op.key)
