"""Connections to the remote tier's Redis: one standalone server or a Redis Cluster, with one
pipeline per node per call, sent to all nodes at once and bounded by a deadline.

Routing is redis-py's cluster client's (``redis.cluster.RedisCluster``): its slot map names the
master of each key (CRC16 slot, as every cluster client computes it) and hands out its
connection pool per node. A call groups its commands by node and runs each group as one
non-transactional pipeline on that node's connection (one round trip per node), all groups in
parallel. What the cluster client would do across many calls (retry, wait out a failover) is
left out on purpose: the tier is a cache, so a node that fails or answers after the deadline
costs misses for its keys (``None`` results), never a stall or an error to the engine. The
deadline bounds the wait for the nodes' answers only: the work a caller does on the answers
that came in time (``post``: decoding values) is not charged to it. A
``MOVED``/``ASK`` answer (slots resharded) refreshes the slot map for the next call; writes
that get one are retried through the cluster client, which follows the redirection. Each node
has a circuit breaker (``kvstore.tiers.breaker``): a node that keeps failing is skipped at once
until its pause is over.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (AskError, AuthenticationError, MovedError, RedisError,
                              ResponseError, TimeoutError as RedisTimeoutError)

from kvstore.tiers.breaker import CircuitBreaker
from kvstore.tiers.redis_url import RedisEndpoint

log = logging.getLogger("kvstore.tiers.remote")

#: Seconds a first connection may take at startup (later connections use the tier's timeout).
STARTUP_TIMEOUT_S = 5.0
#: Least seconds between two slot-map refreshes.
REFRESH_EVERY_S = 1.0


class RemoteConfigError(ValueError):
    """The remote tier cannot start: Redis unreachable, credentials refused, or the address
    names several nodes that are not a cluster. The message never holds a password."""


class RedisNodes:
    """The nodes of one Redis deployment (standalone or Cluster), with per-node pipelines.

    Args:
        endpoint: where it lives (``kvstore.tiers.redis_url``).
        timeout_s: socket timeout of every call and connection after startup (seconds).
        breaker_threshold, breaker_reset_s: per-node circuit breaker settings.
        on_breaker: ``on_breaker(node_name, state)`` on each breaker state change.
        clock: the breakers' monotonic seconds (tests pass their own; deadlines stay on
            ``time.monotonic``).

    Attributes:
        cluster: whether the deployment is a Redis Cluster.

    Raises:
        RemoteConfigError: see the class. The check runs at construction (PING, INFO cluster).
    """

    def __init__(self, endpoint: RedisEndpoint, timeout_s: float, breaker_threshold: int = 3,
                 breaker_reset_s: float = 5.0,
                 on_breaker: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint, self.timeout_s, self._clock = endpoint, timeout_s, clock
        self._on_breaker = on_breaker or (lambda node, state: None)
        self._breaker_args = (breaker_threshold, breaker_reset_s)
        self._breakers: dict[str, CircuitBreaker] = {}
        self._last_error: dict[str, str] = {}   # node -> why its last failed call failed
        self._lock = threading.Lock()
        self._last_refresh = 0.0
        kw = dict(username=endpoint.username or None, password=endpoint.password,
                  socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                  **endpoint.ssl_kwargs())
        seed = self._check_seed(kw)
        self.cluster = seed is None
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvstore-remote")
        if self.cluster:
            try:
                self._rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in endpoint.nodes],
                                        require_full_coverage=False, **kw)
            except (AuthenticationError, RedisError) as e:
                raise RemoteConfigError(f"cannot open the Redis Cluster at {endpoint}: "
                                        f"{type(e).__name__}: {e}") from None
            self._single = None
        else:
            self._rc = None
            self._single = seed
            self._single_name = "%s:%d" % endpoint.nodes[0]

    def _check_seed(self, kw: dict) -> redis.Redis | None:
        """PING the first reachable startup node; the standalone client, or None for a
        cluster node."""
        errors = []
        for host, port in self.endpoint.nodes:
            # no retries: a call is bounded by the deadline, a failure is a miss (redis-py's
            # default retries with backoff would stall a call on a dead server for seconds)
            r = redis.Redis(host=host, port=port, db=self.endpoint.db,
                            retry=Retry(NoBackoff(), 0),
                            **{**kw, "socket_timeout": STARTUP_TIMEOUT_S,
                               "socket_connect_timeout": STARTUP_TIMEOUT_S})
            try:
                r.ping()
                enabled = int(r.info("cluster").get("cluster_enabled", 0)) == 1
            except AuthenticationError:
                r.close()
                if not self.endpoint.password:
                    raise RemoteConfigError(
                        f"Redis at {host}:{port} needs a password (AUTH failed): give it in "
                        f"--remote-url or $KVSTORE_REMOTE_PASSWORD") from None
                raise RemoteConfigError(
                    f"Redis at {host}:{port} refused the credentials (AUTH failed): check the "
                    f"user/password of --remote-url or $KVSTORE_REMOTE_PASSWORD") from None
            except ResponseError as e:
                r.close()
                raise RemoteConfigError(f"Redis at {host}:{port}: {e}") from None
            except RedisError as e:
                r.close()
                errors.append(f"{host}:{port}: {type(e).__name__}: {e}")
                continue
            if enabled:
                r.close()
                return None
            if len(self.endpoint.nodes) > 1:
                r.close()
                raise RemoteConfigError(f"{len(self.endpoint.nodes)} nodes given but {host}:{port} "
                                        f"is not a cluster node (cluster_enabled:0); give one "
                                        f"address for a standalone Redis")
            r.close()  # (its connections keep the startup timeout)
            return redis.Redis(host=host, port=port, db=self.endpoint.db,
                               retry=Retry(NoBackoff(), 0), **kw)
        raise RemoteConfigError(f"cannot reach Redis at {self.endpoint}: {'; '.join(errors)}")

    # ---- routing ----------------------------------------------------------------------------
    def node_of(self, key: bytes) -> str | None:
        """Name (``host:port``) of the master holding ``key``, None when no node covers its
        slot."""
        if not self.cluster:
            return self._single_name
        try:
            return self._rc.get_node_from_key(key).name
        except RedisError:
            return None

    def client(self, node: str) -> redis.Redis:
        """The connection pool of ``node`` (as named by ``node_of`` or ``primaries``)."""
        if not self.cluster:
            return self._single
        return self._rc.get_redis_connection(self._rc.get_node(node_name=node))

    def primaries(self) -> list[str]:
        """Every master's name."""
        if not self.cluster:
            return [self._single_name]
        return [n.name for n in self._rc.get_primaries()]

    def breaker(self, node: str) -> CircuitBreaker:
        with self._lock:
            b = self._breakers.get(node)
            if b is None:
                b = self._breakers[node] = CircuitBreaker(
                    *self._breaker_args, on_change=lambda s, node=node: self._on_breaker(node, s),
                    clock=self._clock)
            return b

    def last_error(self, node: str) -> str:
        """Why the last failed call to ``node`` failed (``"Class: message"``, or that it
        answered after the deadline); ``""`` before any failure."""
        return self._last_error.get(node, "")

    def breaker_states(self) -> dict[str, str]:
        with self._lock:
            items = list(self._breakers.items())
        return {n: b.state for n, b in items}

    def refresh(self) -> None:
        """Reload the cluster's slot map (at most once per ``REFRESH_EVERY_S``)."""
        if not self.cluster:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last_refresh < REFRESH_EVERY_S:
                return
            self._last_refresh = now
        try:
            self._rc.nodes_manager.initialize()
        except RedisError as e:
            log.warning("remote tier: slot map refresh failed: %s", e)

    def cluster_client(self) -> RedisCluster | redis.Redis:
        """The cluster client (or the standalone client): follows MOVED/ASK on its own."""
        return self._rc if self.cluster else self._single

    # ---- calls ------------------------------------------------------------------------------
    def run(self, groups: dict[str, Sequence[tuple]], deadline: float | None,
            post: Callable[[str, list], list] | None = None,
            late: set[str] | None = None) -> dict[str, list | None]:
        """Run each node's commands as one pipeline, all nodes at once.

        Args:
            groups: node name -> commands (each a tuple of ``execute_command`` arguments).
            deadline: ``time.monotonic()`` by which the nodes' answers must be in (None: the
                socket timeout alone bounds each node). It bounds the network wait only.
            post: ``post(node, results) -> results``, run on the node's worker as soon as its
                answers are in (checking one node's values overlaps with the others still
                sending). Its time does not count against the deadline: a node whose answers
                were in by the deadline gets its ``post`` finished and its results returned;
                a late node's ``post`` never runs, nor its pipeline when it had not started
                by the deadline (the pool busy).
            late: when given, the names of the nodes that had not answered by the deadline,
                or whose socket timeout ran out first, are added to it (their results are
                None).

        Returns:
            node name -> one result per command (a value, or the ``RedisError`` that command
            got), or None for a node that failed, was skipped by its breaker, or answered
            after the deadline.
        """
        out: dict[str, list | None] = {}
        todo = []
        for node, cmds in groups.items():
            if not cmds:
                out[node] = []
            elif node is None or not self.breaker(node).allow():
                out[node] = None
            else:
                todo.append((node, cmds))
        if not todo:
            return out
        if deadline is None and len(todo) == 1:  # (each node's socket timeout bounds it)
            for node, cmds in todo:
                out[node] = self._settle(node, self._call, node, cmds, post, late=late)
            return out
        call = _CallState()
        futures = {self._pool.submit(self._call_by, node, cmds, post, call): node
                   for node, cmds in todo}
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        _, pending = wait(futures, timeout=timeout)
        # the deadline is over: a node whose answers are in keeps its results (its ``post``
        # may still be running, on values that came in time), the others are late
        in_time = call.close({futures[f] for f in pending})
        for f in pending:   # late: one not started yet (a pool busy with other calls) never
            if futures[f] not in in_time:   # starts, even once a worker frees up while
                f.cancel()                  # the in-time nodes' ``post`` runs below
        if in_time:
            wait([f for f in pending if futures[f] in in_time])
        for f, node in futures.items():
            if node in in_time or f not in pending:
                out[node] = self._settle(node, f.result, late=late)
                continue
            log.debug("remote tier: node %s answered after the deadline; its keys miss", node)
            self._last_error[node] = "no answer within the deadline"
            self.breaker(node).failure()
            if late is not None:
                late.add(node)
            out[node] = None
        return out

    def _settle(self, node: str, fn, *args, late: set[str] | None = None) -> list | None:
        try:
            res = fn(*args)
        except RedisError as e:
            log.debug("remote tier: node %s failed: %s: %s", node, type(e).__name__, e)
            self._last_error[node] = f"{type(e).__name__}: {str(e)[:200]}"
            self.breaker(node).failure()
            if late is not None and isinstance(e, RedisTimeoutError):
                late.add(node)  # (its socket timeout, the deadline's length, ran out first)
            return None
        except Exception as e:  # noqa: BLE001 (a fault of ours, e.g. in ``post``): the node's
            # keys miss and its breaker hears of it, so a half-open trial is never left
            # without an outcome (which would skip the node for good) and the other nodes of
            # the call are still settled
            log.warning("remote tier: node %s: unexpected %s: %s; its keys miss", node,
                        type(e).__name__, str(e)[:200], exc_info=log.isEnabledFor(logging.DEBUG))
            self._last_error[node] = f"{type(e).__name__}: {str(e)[:200]}"
            self.breaker(node).failure()
            return None
        self.breaker(node).success()
        if any(isinstance(r, (MovedError, AskError)) for r in res):
            self.refresh()
        return res

    def _call(self, node: str, cmds: Sequence[tuple], post=None) -> list:
        pipe = self.client(node).pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        res = pipe.execute(raise_on_error=False)
        return post(node, res) if post is not None else res

    def _call_by(self, node: str, cmds: Sequence[tuple], post, call: "_CallState") -> list:
        """``_call`` on a worker, ``post`` only when the answers came by ``call``'s deadline."""
        res = self._call(node, cmds)
        if not call.answered(node):
            return res  # (late: its results are dropped, its values never decoded)
        return post(node, res) if post is not None else res

    def close(self) -> None:
        """Close every connection. Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            if self.cluster:
                self._rc.close()
            else:
                self._single.close()
        except RedisError:
            pass


class _CallState:
    """Which nodes of one ``RedisNodes.run`` call answered by its deadline. A node's worker
    calls ``answered`` once its answers are in, the caller ``close`` when the deadline is
    over; the lock makes each node either in time or late, never both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_time: set[str] = set()
        self._closed = False

    def answered(self, node: str) -> bool:
        """``node``'s answers are in; whether that was in time (its results are then used)."""
        with self._lock:
            if self._closed:
                return False
            self._in_time.add(node)
            return True

    def close(self, pending: set[str]) -> set[str]:
        """The deadline is over: of ``pending`` (nodes whose call has not returned), those
        whose answers were in by now (their ``post`` is running)."""
        with self._lock:
            self._closed = True
            return pending & self._in_time
