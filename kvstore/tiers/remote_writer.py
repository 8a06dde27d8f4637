"""The remote tier's write-behind queue: chunks handed over by ``RemoteTier.put_behind`` and
deletions of values that failed a check wait here, bounded in bytes, until a background thread
writes them to Redis in batches (``SET``, with ``EX ttl`` when set, or ``UNLINK``), one pipeline
per node (``kvstore.tiers.redis_nodes``).

Nothing here raises to the caller: a chunk that does not fit the queue, a write a full Redis
refuses (``maxmemory`` with ``noeviction``), a write to a failed node and a batch the writer
fails on are dropped and counted (``kvstore_remote_dropped_writes_total{reason}``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import torch
from redis.exceptions import AskError, MovedError, OutOfMemoryError, RedisError, ResponseError

from kvstore.codec import pack_value
from kvstore.keys import ChunkKey
from kvstore.layout import dtype_name
from kvstore.tiers.redis_nodes import RedisNodes
from kvstore.tiers.remote_metrics import RemoteMetrics

log = logging.getLogger("kvstore.tiers.remote")

#: least seconds between two lines about writes one node refused for one reason
REFUSAL_RELOG_S = 600.0

#: Puts written per batch at most (one pipeline per node per batch).
BATCH_OPS = 64
#: Bytes of values written per batch at most.
BATCH_BYTES = 32 * 2**20


class WriteBehind:
    """Queued writes of one remote tier and the thread that does them. Thread-safe.

    Args:
        nodes: the tier's Redis nodes (pipelines, cluster redirects).
        metrics: the tier's counters (``writes``, ``written_bytes``, ``deleted``,
            ``dropped_writes``) and its ``queue_bytes`` gauge.
        redis_key: a chunk's Redis key (``RemoteTier.redis_key``).
        ttl_s: seconds a written value lives (0: no expiry).
        capacity_bytes: most bytes of chunks waiting; beyond, ``put`` drops the chunk.
    """

    def __init__(self, nodes: RedisNodes, metrics: RemoteMetrics,
                 redis_key: Callable[[ChunkKey], bytes], ttl_s: float,
                 capacity_bytes: int) -> None:
        self.nodes, self.metrics, self.redis_key = nodes, metrics, redis_key
        self.ttl_s, self.capacity_bytes = ttl_s, capacity_bytes
        self._cond = threading.Condition()
        self._queue: deque = deque()  # (("put", key, kv, parent, codec) | ("del", rk), nbytes)
        self._queued_bytes = 0
        self._refusals: dict[tuple, tuple] = {}  # (node, reason) -> (last line's time, count)
        self._inflight = 0
        self._batches = [0, 0]  # batches taken by the writer, batches done
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvstore-remote-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    @property
    def queued_bytes(self) -> int:
        """Bytes of chunks waiting or being written."""
        return self._queued_bytes

    def put(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
            codec: str) -> bool:
        """Queue ``kv`` (a CPU tensor the caller hands over and no longer writes) to be
        written as ``key``'s value with ``codec``. Returns False when it was dropped (queue
        full, closed)."""
        nbytes = kv.numel() * kv.element_size()
        with self._cond:
            if self._closed or self._queued_bytes + nbytes > self.capacity_bytes:
                self.metrics.inc("dropped_writes", label="queue_full" if not self._closed
                                 else "closed")
                return False
        return self._enqueue(("put", key, kv, parent, codec), nbytes)

    def delete_later(self, rk: bytes) -> None:
        """Queue an ``UNLINK`` of Redis key ``rk`` (a no-op once closed)."""
        self._enqueue(("del", rk), 0)

    def forget(self, match: Callable[[ChunkKey], bool], wait_s: float = 10.0) -> None:
        """Drop queued puts whose key ``match``es (they would bring removed chunks back), then
        wait (up to ``wait_s`` seconds) for the batch the writer is sending, if any: a caller
        that deletes the keys from Redis next then deletes what that batch wrote instead of
        being overtaken by it."""
        with self._cond:
            kept = deque()
            for op, n in self._queue:
                if op[0] == "put" and match(op[1]):
                    self._queued_bytes -= n
                else:
                    kept.append((op, n))
            self._queue = kept
            self.metrics.queue_bytes.set(self._queued_bytes)
            taken = self._batches[0]
            self._cond.wait_for(lambda: self._batches[1] >= taken, wait_s)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (written or dropped). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout)

    def close(self, flush_timeout: float = 10.0) -> bool:
        """Write what is queued (up to ``flush_timeout`` seconds), drop the rest (counted as
        ``closed``), stop the thread. Returns False when already closed."""
        with self._cond:
            if self._closed:
                return False
        self.flush(flush_timeout)
        with self._cond:
            self._closed = True
            dropped = sum(op[0] == "put" for op, _ in self._queue)
            self._queue.clear()  # (not written in time: the writer stops after its batch)
            self._cond.notify_all()
        if dropped:
            self.metrics.inc("dropped_writes", dropped, "closed")
        self._thread.join(timeout=flush_timeout)
        return True

    def _enqueue(self, op: tuple, nbytes: int) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._queue.append((op, nbytes))
            self._queued_bytes += nbytes
            self.metrics.queue_bytes.set(self._queued_bytes)
            self._cond.notify_all()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, size = [], 0
                while self._queue and len(batch) < BATCH_OPS and size < BATCH_BYTES:
                    op, n = self._queue.popleft()
                    batch.append(op)
                    size += n
                self._inflight += 1
                self._batches[0] += 1
            try:
                self._write_batch(batch)
            except Exception:
                log.exception("remote tier: writer failed on a batch; dropping it")
                self.metrics.inc("dropped_writes", sum(op[0] == "put" for op in batch), "error")
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._batches[1] += 1
                    self._queued_bytes -= size
                    self.metrics.queue_bytes.set(self._queued_bytes)
                    self._cond.notify_all()

    @staticmethod
    def _encode(key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None, codec: str) -> bytes:
        raw = kv.reshape(-1).view(torch.uint8).numpy()  # [nbytes]
        return pack_value(bytes(key), bytes(parent) if parent is not None else None, raw,
                          dtype_name(kv.dtype), tuple(kv.shape), codec)

    def _write_batch(self, batch: list) -> None:
        t0 = time.perf_counter()
        ex = ("EX", max(1, int(round(self.ttl_s)))) if self.ttl_s else ()
        groups: dict = {}
        items = []  # (node, index, kind, redis key, value)
        for op in batch:
            if op[0] == "put":
                rk, value = self.redis_key(op[1]), self._encode(*op[1:])
                cmd = ("SET", rk, value) + ex
            else:
                rk, value = op[1], None
                cmd = ("UNLINK", rk)
            node = self.nodes.node_of(rk)
            cmds = groups.setdefault(node, [])
            items.append((node, len(cmds), op[0], rk, value))
            cmds.append(cmd)
        res = self.nodes.run(groups, None)
        for node, i, kind, rk, value in items:
            r = res.get(node)
            r = r[i] if r is not None else ConnectionError("node unavailable")
            if isinstance(r, (MovedError, AskError)):
                r = self._redirected(kind, rk, value, ex)
            if kind == "del":
                if not isinstance(r, Exception):
                    self.metrics.inc("deleted", int(r or 0))
                continue
            if isinstance(r, Exception):
                reason = ("full" if isinstance(r, OutOfMemoryError) else
                          "error" if isinstance(r, ResponseError) else "unavailable")
                self.metrics.inc("dropped_writes", label=reason)
                log.debug("remote tier: write of %r dropped: %s", rk, r)
                if reason != "unavailable":  # (a node down is the breaker's to log)
                    self._refused(node, reason, r)
            else:
                self.metrics.inc("writes")
                self.metrics.inc("written_bytes", len(value))
        self.metrics.observe("put", time.perf_counter() - t0)

    def _refused(self, node: str | None, reason: str, err: Exception) -> None:
        """Count a write ``node`` refused (``full``: Redis at ``maxmemory`` with
        ``noeviction``; ``error``: another error answer) and log it: the first at once, then
        one line per ``REFUSAL_RELOG_S`` per node and reason with the count since the last."""
        now = time.monotonic()
        key = (node, reason)
        last, count = self._refusals.get(key, (None, 0))
        count += 1
        if last is not None and now - last < REFUSAL_RELOG_S:
            self._refusals[key] = (last, count)
            return
        self._refusals[key] = (now, 0)
        why = ("it is full (maxmemory reached with an eviction policy that evicts nothing: "
               "raise maxmemory, or use allkeys-lru)" if reason == "full" else f"{err}")
        log.warning("remote tier: Redis node %s refused %d write(s)%s: %s; those chunks stay "
                    "local only (kvstore_remote_dropped_writes_total{reason=\"%s\"}; logged "
                    "again at most every %.0f s)", node, count,
                    "" if last is None else f" in the last {now - last:.0f} s", why, reason,
                    REFUSAL_RELOG_S)

    def _redirected(self, kind: str, rk: bytes, value, ex: tuple):
        """Redo one command through the cluster client (it follows MOVED/ASK)."""
        client = self.nodes.cluster_client()
        try:
            if kind == "put":
                return client.execute_command("SET", rk, value, *ex)
            return client.execute_command("UNLINK", rk)
        except RedisError as e:
            return e
