"""Remote tier: chunks in Redis (standalone or Cluster), shared by every store that points at
the same deployment, on any host.

It is the last tier of a ``ChunkStore`` and differs from the local tiers in one way: nobody
holds an index of it (other hosts write to it, Redis evicts from it on its own), so the store
asks it. Lookups ask for presence (``EXISTS``), gets read and check values (``GET``), both
as one pipeline per node, all nodes at once; answers must be in within ``timeout_s``
(``kvstore.tiers.redis_nodes``; decoding the values that came in time runs after, outside it).
A node that fails or is late costs misses for its keys (late ones counted and warned about,
``kvstore.tiers.remote_late``); the engine never gets an error from this tier. A node whose
circuit breaker opens is logged when it goes down, then at most once per ``RemoteTier.down_relog_s`` (10 min) while its trial
calls keep failing, and once (INFO) when it answers again (``kvstore.cause_log.OutageLog``).

Writes are write-behind (``kvstore.tiers.remote_writer``): the store hands over a copy of each
chunk it newly stores (``put_behind``), a background thread writes them (``SET``, with
``EX ttl_s`` when set) in batches, one pipeline per node. The queue is bounded in bytes; a chunk
that does not fit, a write a full Redis refuses (``maxmemory`` with ``noeviction``) or a write
to a failed node is dropped and counted (``kvstore_remote_dropped_writes_total{reason}``),
never raised.

Keys and values:

* key: ``<prefix>:<namespace id hex>:<prefix hash hex>``. The namespace id covers the model,
  layout, dtype and ``cache_salt``, so tenants and models never share a key; the deployment
  prefix keeps several deployments on one Redis apart. No hash tags: a prompt's chunks spread
  over every master.
* value: ``kvstore.codec``'s self-describing format (version, codec, dtype, shape, the chunk's
  own key (namespace id + prefix hash), its parent's key, checksums), then the payload. A
  value that fails any check (other key or namespace, shape or dtype other than the layout's,
  checksum, truncated, unknown version) is a miss, counted
  (``kvstore_remote_validation_failures_total{reason}``) and deleted.

Capacity is Redis's own: run it with ``maxmemory`` and an eviction policy (``allkeys-lru``);
a value Redis evicted is simply a miss. For the same reason ``ChunkStore.demote`` changes
nothing here: no eviction order of ours to move a key to the front of (a demoted tail piece
stays in Redis until its TTL or Redis's own policy takes it).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Sequence

import torch
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from kvstore.cause_log import OutageLog
from kvstore.codec import CODECS
from kvstore.keys import ChunkKey
from kvstore.kv_codec import chunk_codec
from kvstore.layout import KVLayout
from kvstore.tiers.redis_nodes import RedisNodes
from kvstore.tiers.redis_url import parse_redis_url
from kvstore.tiers.remote_late import LateNodes
from kvstore.tiers.remote_metrics import RemoteMetrics
from kvstore.tiers.remote_restart import DEFAULT_CHECK_S, RestartWatch
from kvstore.tiers.remote_values import check_key_prefix, decode_value, failure_reason
from kvstore.tiers.remote_writer import WriteBehind

log = logging.getLogger("kvstore.tiers.remote")

#: A get's deadline is ``timeout_s`` plus this many seconds per GiB of chunks asked (a floor
#: of 256 MiB/s: a long prompt's chunks are not cut off by a deadline sized for a lookup).
GET_SECONDS_PER_GIB = 4.0


class RemoteTier:
    """Chunks in Redis, written behind and read with validation (see module docstring).
    Thread-safe.

    Args:
        url: ``redis://[user:password@]host:port[,host:port...]`` (``kvstore.tiers.redis_url``;
            several addresses: startup nodes of a cluster).
        key_prefix: deployment prefix of every key (letters, digits, ``_.-/``; 1-64 chars).
        ttl_s: seconds a value lives after its last write or read (``GETEX`` refreshes it);
            0 = no expiry (Redis's ``maxmemory`` policy decides).
        timeout_s: deadline of a lookup's network wait (seconds) and socket timeout of every
            call; a get's deadline adds ``GET_SECONDS_PER_GIB`` per GiB of chunks asked
            (decoding the values that came in time is not charged to it).
        queue_bytes: most bytes of chunks waiting to be written; beyond, writes are dropped.
        password: used when the URL has none (else ``$KVSTORE_REMOTE_PASSWORD``).
        codec: value codec (``raw`` default: fp16 KV rarely compresses; ``auto``, ``lz4``,
            ``shuffle-lz4`` as the disk tier; lossy ``int8``/``fp8`` only for the chunks of
            namespaces that accept it, ``lossy_codec_of`` set by the store, others ``raw``).
        registry: Prometheus registry for ``kvstore_remote_*`` (the store's).
        breaker_threshold, breaker_reset_s: per-node circuit breaker (consecutive failures that
            open it; seconds before a trial request).
        clock: monotonic seconds of the breakers and of the outage log lines (tests pass
            their own; call deadlines stay on ``time.monotonic``).
        restart_check_s: seconds between two checks of every master's ``run_id``
            (``kvstore.tiers.remote_restart``; 0: no check); a restart noticed calls
            ``on_node_restart``.

    Attributes:
        down_relog_s: least seconds between two WARNING lines of one node's outage (600).
        on_node_restart: called with a node's name when it restarted (the store sets it).
        on_close: called first by ``close`` (the store sets it: its restart pass ends).

    Raises:
        ValueError: a bad URL, prefix, ttl, timeout, queue size, codec or restart check.
        kvstore.tiers.redis_nodes.RemoteConfigError (a ValueError): Redis unreachable, the
            password refused, or several addresses that are not a cluster.
    """

    name = "remote"

    def __init__(self, url: str, key_prefix: str = "kvstore", ttl_s: float = 0.0,
                 timeout_s: float = 0.25, queue_bytes: int = 256 * 2**20,
                 password: str | None = None, codec: str = "raw",
                 registry: CollectorRegistry | None = None, breaker_threshold: int = 3,
                 breaker_reset_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 restart_check_s: float = DEFAULT_CHECK_S) -> None:
        check_key_prefix(key_prefix)
        if (not 0 <= ttl_s < math.inf or not 0 < timeout_s < math.inf
                or not isinstance(queue_bytes, int) or queue_bytes <= 0):
            raise ValueError(f"remote tier needs a finite ttl_s >= 0, a finite timeout_s > 0 and "
                             f"a whole queue_bytes > 0, got {ttl_s}, {timeout_s}, {queue_bytes}")
        if not 0 <= restart_check_s < math.inf:
            raise ValueError(f"remote tier needs a finite restart_check_s >= 0 (0: off), got "
                             f"{restart_check_s!r}")
        if codec != "auto" and codec not in CODECS:
            raise ValueError(f"unknown remote codec {codec!r}; choose one of {CODECS} or 'auto'")
        self.endpoint = parse_redis_url(url, password)
        self.key_prefix, self.ttl_s, self.timeout_s = key_prefix, float(ttl_s), float(timeout_s)
        self.queue_capacity, self.codec = int(queue_bytes), codec
        #: ``ns_id -> lossy codec the namespace accepts`` (``""``: none; set by the store)
        self.lossy_codec_of: Callable[[bytes], str] = lambda ns_id: ""
        self.metrics = RemoteMetrics(registry)
        self.late = LateNodes(self.metrics, log)
        self._clock, self._down_relog_s = clock, 600.0
        self._outages: dict[str, OutageLog] = {}   # node -> its outage log
        self._outage_lock = threading.Lock()
        self.nodes = RedisNodes(self.endpoint, self.timeout_s, breaker_threshold,
                                breaker_reset_s, on_breaker=self._on_breaker, clock=clock)
        self._prefix = key_prefix.encode() + b":"
        self.writer = WriteBehind(self.nodes, self.metrics, self.redis_key, self.ttl_s,
                                  self.queue_capacity)
        for node in self.nodes.primaries():  # (every master's series exists from the start)
            self.nodes.breaker(node)
            self.metrics.add_node(node)
        self.on_node_restart: Callable[[str], None] = lambda node: None
        self.on_close: Callable[[], None] = lambda: None  # (first thing ``close`` does)
        self.restarts = (RestartWatch(self.nodes.primaries, self.nodes.client, restart_check_s,
                                      self._restarted) if restart_check_s else None)
        log.info("remote tier: %s %s, key prefix %r, ttl %s, deadline %.3fs",
                 "Redis Cluster" if self.nodes.cluster else "Redis", self.endpoint,
                 key_prefix, f"{max(1, round(self.ttl_s))}s" if self.ttl_s else "none",
                 self.timeout_s)

    @property
    def down_relog_s(self) -> float:
        """Least seconds between two WARNING lines of one node's outage (default 600)."""
        return self._down_relog_s

    @down_relog_s.setter
    def down_relog_s(self, seconds: float) -> None:
        with self._outage_lock:
            self._down_relog_s = seconds
            for outage in self._outages.values():
                outage.relog_s = seconds

    def _outage(self, node: str) -> OutageLog:
        with self._outage_lock:
            outage = self._outages.get(node)
            if outage is None:
                outage = self._outages[node] = OutageLog(self._down_relog_s, self._clock)
            return outage

    def _on_breaker(self, node: str, state: str) -> None:
        """A node's breaker changed state: its gauge and counter, and the outage's lines. The
        breaker reopens after each failed trial call (every ``reset_s``) while the node stays
        down; that is logged at most once per ``down_relog_s``."""
        self.metrics.breaker(node, state)
        if state == "open":
            breaker = self.nodes.breaker(node)
            failures = breaker.failures
            cause = self.nodes.last_error(node).split(":", 1)[0]  # (the error's class)
            line = self._outage(node).failed(failures, cause=cause or None)
            if line == "down":
                log.warning("remote tier: node %s is down (%d calls failed in a row, the last: "
                            "%s); its keys miss, and one call every %.1f s tries it (circuit "
                            "breaker open; logged again at most every %.0f s while it stays "
                            "down)", node, failures, self.nodes.last_error(node),
                            breaker.reset_s, self.down_relog_s)
            elif line is not None:
                log.warning("remote tier: node %s still down after %.0f s (%d failed calls, "
                            "the last: %s); its keys miss", node, line[0], line[1],
                            self.nodes.last_error(node))
        elif state == "closed":
            back = self._outage(node).recovered()
            if back is not None:
                log.info("remote tier: node %s answers again (down %.1f s, %d failed calls; "
                         "circuit breaker closed)", node, *back)

    def _restarted(self, node: str) -> None:
        self.metrics.inc("node_restarts", label=node)
        self.on_node_restart(node)

    # ---- keys -------------------------------------------------------------------------------
    def redis_key(self, key: ChunkKey) -> bytes:
        """``<prefix>:<ns id hex>:<prefix hash hex>`` (bytes)."""
        return self._prefix + key.ns_id.hex().encode() + b":" + key.prefix_hash.hex().encode()

    def _pattern(self, ns_id: bytes | None) -> bytes:
        return self._prefix + (ns_id.hex().encode() + b":*" if ns_id is not None else b"*")

    def _group(self, rkeys: Sequence[bytes], cmd) -> tuple[dict, list]:
        """node -> commands, and per key (node, index in that node's commands)."""
        groups: dict = {}
        where = []
        for rk in rkeys:
            node = self.nodes.node_of(rk)
            cmds = groups.setdefault(node, [])
            where.append((node, len(cmds)))
            cmds.append(cmd(rk))
        return groups, where

    # ---- reads ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key has a value in Redis now (one ``EXISTS`` per key, one pipeline per
        node, within ``timeout_s``). A failed or late node answers False for its keys."""
        if not keys:
            return []
        t0 = time.perf_counter()
        found = [e is True for e in self.exists(keys)]
        self.metrics.inc("lookups", len(keys))
        self.metrics.inc("lookup_hits", sum(found))
        self.metrics.observe("lookup", time.perf_counter() - t0)
        return found

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool | None]:
        """``lookup`` without its metrics, telling a miss (False) from a failed or late node
        (None)."""
        groups, where = self._group([self.redis_key(k) for k in keys], lambda rk: ("EXISTS", rk))
        res = self.late.run(self.nodes, "lookup", groups, where, self.timeout_s)
        out: list[bool | None] = []
        for node, i in where:
            r = res.get(node)
            out.append(None if r is None or isinstance(r[i], Exception) else r[i] == 1)
        return out

    def get(self, keys: Sequence[ChunkKey], layout: KVLayout
            ) -> list[tuple[torch.Tensor, ChunkKey | None] | None]:
        """Read and check each key's value.

        Returns:
            Per key: ``(kv, parent)`` with ``kv`` a CPU tensor
            ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` of ``layout``'s dtype (over
            the received value's own memory for a ``raw`` value: read it, copy it, do not
            write it) and
            ``parent`` the key recorded with it; or None (absent, its node failed or was late,
            or the value failed a check: then it is also deleted and counted).
        """
        if not keys:
            return []
        t0 = time.perf_counter()
        rkeys = [self.redis_key(k) for k in keys]
        if self.ttl_s:
            ttl = max(1, int(round(self.ttl_s)))
            cmd = lambda rk: ("GETEX", rk, "EX", ttl)  # noqa: E731
        else:
            cmd = lambda rk: ("GET", rk)  # noqa: E731
        groups, where = self._group(rkeys, cmd)
        order = {node: [] for node in groups}  # node -> its keys in command order
        for key, rk, (node, _) in zip(keys, rkeys, where):
            order[node].append((key, rk))
        shape, dtype = layout.shape(), layout.dtype

        def check(node, values):  # on the node's worker once its answers are in (no deadline)
            return [decode_value(key, value, shape, dtype) if isinstance(value, (bytes, bytearray))
                    else None for (key, _), value in zip(order[node], values)]

        allowance = len(keys) * layout.chunk_bytes / 2**30 * GET_SECONDS_PER_GIB
        res = self.late.run(self.nodes, "get", groups, where, self.timeout_s + allowance, check)
        out: list = []
        nbytes = 0
        for key, rk, (node, i) in zip(keys, rkeys, where):
            r = res.get(node)
            item = r[i] if r is not None else None
            if item is None:
                out.append(None)
                continue
            nbytes += item[2]
            if isinstance(item[0], str):  # ("invalid", why, nbytes, value)
                self._invalid(key, rk, item[3], item[1])
                out.append(None)
            else:
                out.append(item[:2])
        hits = sum(o is not None for o in out)
        self.metrics.inc("reads", len(keys))
        self.metrics.inc("hits", hits)
        self.metrics.inc("misses", len(keys) - hits)
        self.metrics.inc("read_bytes", nbytes)
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def _invalid(self, key: ChunkKey, rk: bytes, value: bytes, why: str) -> None:
        reason = failure_reason(value, why)
        log.warning("remote tier: value of %r failed a check (%s: %s); deleting it", key,
                    reason, why)
        self.metrics.inc("validation_failures", label=reason)
        self.writer.delete_later(rk)

    # ---- writes -----------------------------------------------------------------------------
    def put_behind(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None) -> bool:
        """Queue ``kv`` (a CPU tensor the caller hands over and no longer writes) to be written
        as ``key``'s value. Returns False when it was dropped (queue full, tier closed)."""
        codec = chunk_codec(self.codec, self.lossy_codec_of(key.ns_id), "raw")
        return self.writer.put(key, kv, parent, codec)

    # ---- removal ----------------------------------------------------------------------------
    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete the values of ``keys`` now (and their queued writes). Returns, per key,
        whether a value was deleted (False also for a key on a failed node: its value stays,
        which is stale data for nobody: a value is only ever the right KV of its key)."""
        keys = list(keys)
        if not keys:
            return []
        wanted = set(keys)
        self.writer.forget(lambda k: k in wanted)
        groups, where = self._group([self.redis_key(k) for k in keys], lambda rk: ("UNLINK", rk))
        res = self.nodes.run(groups, None)
        out = [res.get(node) is not None and not isinstance(res[node][i], Exception)
               and int(res[node][i] or 0) > 0 for node, i in where]
        self.metrics.inc("deleted", sum(out))
        return out

    def chunk_key(self, rk: bytes) -> ChunkKey | None:
        """Inverse of ``redis_key`` (None for a key of another form)."""
        parts = rk[len(self._prefix):].split(b":")
        try:
            return ChunkKey(bytes.fromhex(parts[0].decode()), bytes.fromhex(parts[1].decode()))
        except (IndexError, ValueError, UnicodeDecodeError):
            return None

    @staticmethod
    def _unlink_each(client, rkeys: list[bytes]) -> list[bytes]:
        """``UNLINK`` each key (one command per key, one pipeline: a cluster node refuses a
        multi-key command across slots); returns the keys that existed."""
        pipe = client.pipeline(transaction=False)
        for rk in rkeys:
            pipe.unlink(rk)
        return [rk for rk, n in zip(rkeys, pipe.execute()) if n]

    def clear(self, ns_id: bytes | None = None) -> set[ChunkKey]:
        """Delete every value of namespace ``ns_id`` (None: every value under this tier's key
        prefix) on every master (``SCAN`` + ``UNLINK``), and the queued writes. Returns the
        keys deleted; a master that fails is logged and skipped."""
        self.writer.forget(lambda k: ns_id is None or k.ns_id == ns_id)
        pattern, gone = self._pattern(ns_id), set()
        for node in self.nodes.primaries():
            try:
                client = self.nodes.client(node)
                batch = []
                for rk in client.scan_iter(match=pattern, count=1000):
                    batch.append(rk)
                    if len(batch) >= 500:
                        gone.update(self._unlink_each(client, batch))
                        batch = []
                if batch:
                    gone.update(self._unlink_each(client, batch))
            except RedisError as e:
                log.warning("remote tier: clear on %s failed: %s", node, e)
        self.metrics.inc("deleted", len(gone))
        return {k for k in map(self.chunk_key, gone) if k is not None}

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def queued_bytes(self) -> int:
        return self.writer.queued_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (written or dropped). False on timeout."""
        return self.writer.flush(timeout)

    def stats(self) -> dict:
        """Address (no password), mode, settings, queue, breaker states and counters."""
        return {"url": self.endpoint.redacted(), "cluster": self.nodes.cluster,
                "key_prefix": self.key_prefix, "ttl_s": self.ttl_s, "timeout_s": self.timeout_s,
                "queue_bytes": self.writer.queued_bytes,
                "queue_capacity_bytes": self.queue_capacity,
                "breakers": self.nodes.breaker_states(), **self.metrics.snapshot()}

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (its queue takes nothing more)."""
        return self.writer.closed

    def close(self, flush_timeout: float = 10.0) -> None:
        """Write what is queued (up to ``flush_timeout`` seconds), then close. Idempotent."""
        self.on_close()  # (the store's restart pass ends before the queue closes)
        if self.restarts is not None:
            self.restarts.close()
        if self.writer.close(flush_timeout):
            self.nodes.close()
