"""The processes of a two-host fleet on one machine, for ``bench.fleet`` and its test.

    one Redis Cluster (3 masters, ``bench.redis_cluster.RedisClusterGroup``)
    host 1: daemon1 = kvstore serve --remote-url CLUSTER --cpu-bytes SMALL
            engine1 = engine_min serve --kvstore-url daemon1
    host 2: daemon2, engine2 likewise
    reference: engine0 without a store (the recompute baseline: same prompts, no reuse)

Every engine runs with ``--no-prefix-caching``, so reuse can only come from its daemon: a
chunk host 2 never computed is in its daemon's CPU tier only after the daemon read it from
Redis. Daemons have no disk tier. ``FleetGroup`` is a context manager: the engines, the
daemons (their write-behind queues flushed at SIGTERM) and the cluster are stopped on exit,
on an exception, on Ctrl-C and on SIGTERM (``bench.servers.install_cleanup_handlers``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from bench.redis_cluster import RedisClusterGroup
from bench.servers import ServerGroup, ServerOptions, _daemon_cmd, _engine_cmd, free_port

#: The roles of the started processes, in start order.
ROLES = ("daemon1", "daemon2", "engine0", "engine1", "engine2")


@dataclass(frozen=True)
class FleetOptions:
    """Sizes of the fleet (sizes as the servers parse them).

    Attributes:
        kv_cache_bytes: each engine's KV pool (must hold one document plus its question).
        daemon_cpu_bytes: each daemon's CPU tier (small: a few documents).
        chunk_size: the store's chunk size in tokens.
        masters: Redis Cluster masters.
        threads: torch threads per engine (``None``: all cores; requests run one at a time).
        startup_timeout_s: how long to wait for each process's health check.
        log_dir: where process logs go (a temporary folder when ``None``).
    """

    kv_cache_bytes: str = "96MiB"
    daemon_cpu_bytes: str = "512MiB"
    chunk_size: int = 256
    masters: int = 3
    threads: int | None = None
    startup_timeout_s: float = 300.0
    log_dir: str | None = None


@dataclass
class FleetGroup(ServerGroup):
    """The cluster, two daemons on it and three engines (see the module docstring). Use as
    ``with FleetGroup(fleet=FleetOptions()) as f:``; then ``f.url(role)`` is a process's base
    URL and ``f.cluster.url`` the cluster's. Given a started ``cluster``, the fleet uses it
    and leaves it running; else it starts one of ``fleet.masters`` masters and stops it.

    Raises (on enter):
        bench.redis_servers.RedisNotInstalled: no ``redis-server``/``redis-cli``.
        RuntimeError: a process exited or did not become healthy in time (with its log tail);
            everything already started is stopped first.
    """

    name: str = "fleet"
    fleet: FleetOptions = field(default_factory=FleetOptions)
    cluster: RedisClusterGroup | None = None
    _own_cluster_dir: str | None = None

    def __enter__(self) -> "FleetGroup":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        fo = self.fleet
        self.opts = ServerOptions(kv_cache_bytes=fo.kv_cache_bytes,
                                  kvstore_cpu_bytes=fo.daemon_cpu_bytes,
                                  startup_timeout_s=fo.startup_timeout_s, log_dir=fo.log_dir)
        if self.cluster is None:
            self._own_cluster_dir = tempfile.mkdtemp(prefix="bench-fleet-redis-")
            self.cluster = RedisClusterGroup(self._own_cluster_dir, masters=fo.masters).start()
        threads = fo.threads or max(1, os.cpu_count() or 1)
        for role in ("daemon1", "daemon2"):
            port = free_port()
            cmd = _daemon_cmd(port, self.opts) + ["--remote-url", self.cluster.url]
            self._spawn(role, cmd, port, "/healthz", threads)
        store = ["--kvstore-chunk-size", str(fo.chunk_size)]
        engines = {"engine0": [], "engine1": ["--kvstore-url", self.url("daemon1"), *store],
                   "engine2": ["--kvstore-url", self.url("daemon2"), *store]}
        for role, extra in engines.items():
            port = free_port()
            self._spawn(role, _engine_cmd(port, self.opts, ["--no-prefix-caching", *extra]),
                        port, "/health", threads)
        for p in self.procs:
            self._wait_healthy(p)

    def url(self, role: str) -> str:
        """Base URL of the process ``role`` (one of ``ROLES``).

        Raises:
            KeyError: no such process started.
        """
        return self.metric_urls[role]

    def daemon_stats(self, role: str) -> dict:
        """``GET /v1/stats`` of daemon ``role`` (``"daemon1"`` or ``"daemon2"``)."""
        with urllib.request.urlopen(self.url(role) + "/v1/stats", timeout=30) as r:
            return json.loads(r.read())

    def wait_remote_writes(self, role: str, since: dict, num_chunks: int,
                           timeout_s: float = 120.0) -> dict:
        """Wait until daemon ``role`` wrote ``num_chunks`` more chunks to Redis than in the
        stats ``since`` and its write-behind queue is empty; returns its stats then.

        Raises:
            TimeoutError: not within ``timeout_s`` (the message has the counts seen).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.daemon_stats(role)
            written = st["remote"]["writes"] - since["remote"]["writes"]
            if written >= num_chunks and st["remote"]["queue_bytes"] == 0:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role} wrote {written} of {num_chunks} chunks to Redis in "
                                   f"{timeout_s:.0f} s (queue {st['remote']['queue_bytes']} B, "
                                   f"dropped {st['remote']['dropped_writes_by_reason']})")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the engines, then the daemons, then the cluster if the fleet started it; remove
        temp dirs. Idempotent."""
        self.procs.sort(key=lambda p: p.role.startswith("daemon"))  # (a stable sort)
        own_dir, self._own_cluster_dir = self._own_cluster_dir, None
        try:
            super().stop()
        finally:
            if own_dir is not None:
                if self.cluster is not None:
                    self.cluster.stop()
                shutil.rmtree(own_dir, ignore_errors=True)

