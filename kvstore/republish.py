"""Writing to Redis again what a store holds locally, after a Redis node restarted without it.

A chunk reaches the remote tier once, when a store newly stores it (write-behind). When a
Redis node restarts without its data (no persistence, a new machine), the chunks it held are
gone, and the stores that still hold them locally never write them again: they serve them
from their own tiers. So the hottest chunks of a fleet (a shared system prompt, a popular
document) would miss on every other host until each recomputed them.

When the remote tier notices a restart (``kvstore.tiers.remote_restart``: a node's
``run_id`` changed), ``Republisher`` runs one pass on a thread of its own: every chunk of
the local tiers that the restarted masters hold (by slot; a value another master lost, to
its TTL or its ``maxmemory``, is that master's business), hottest first (``hot_keys``: each
after its ancestors), is asked of Redis (``RemoteTier.exists``, a
batch of ``BATCH`` per call; keys whose node failed or was late are asked again up to
``RETRIES`` times), and each one Redis lacks is read out of its tier (reader-pinned, outside
the store lock, as ``get_chunks`` reads) and queued for the remote tier's writer, waiting for
room in its queue rather than dropping it. A master with a ``maxmemory`` gets at most what
fits under it at the pass's start (``INFO memory``): past that, a colder chunk written would
only make Redis evict a hotter one. A node that comes back with its data (RDB, AOF, a
replica promoted) lacks nothing: the pass only asks. A chunk is queued under the store lock
and only if it is still stored, so a ``remove``, a ``clear`` or a close during the pass keeps
it out of Redis. A restart noticed during a pass runs one more pass after it. Each pass
waits a random pause of up to one check interval first, so that the hosts of a fleet, which
all notice the restart, do not all write the same hot chunks. One line is logged per pass;
``kvstore_remote_republished_total`` counts the chunks written. Keys not asked after the
retries (their node still failing) are not asked again until the next restart.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from kvstore.codec import HEADER_BYTES_MAX
from kvstore.keys import ChunkKey

log = logging.getLogger("kvstore.store")

#: keys asked of Redis per ``EXISTS`` pipeline
BATCH = 64
#: more tries for keys whose node failed or was late (a node just restarted may not serve
#: yet: a cluster master rejoins in seconds), ``RETRY_PAUSE_S`` x 2**try apart (7.75 s in all)
RETRIES, RETRY_PAUSE_S = 5, 0.25


@dataclass
class RepublishReport:
    """What one pass did: chunks held locally, found in Redis, written to it (and their
    bytes), not asked (their node failed or was late), left out for room (their master's
    ``maxmemory`` reached), and the pass's wall seconds."""

    held: int = 0
    present: int = 0
    written: int = 0
    written_bytes: int = 0
    unknown: int = 0
    no_room: int = 0
    seconds: float = 0.0


def redis_room(remote, nodes) -> dict[str, int | None]:
    """Bytes each master of ``nodes`` (names) takes before its ``maxmemory``
    (``maxmemory - used_memory`` from ``INFO memory``, >= 0); None for a master without a
    ``maxmemory`` or that did not answer (no limit then)."""
    out: dict[str, int | None] = {}
    for node in nodes:
        try:
            info = remote.nodes.client(node).info("memory")
            cap = int(info.get("maxmemory", 0))
            out[node] = max(0, cap - int(info["used_memory"])) if cap else None
        except (RedisError, OSError, KeyError, ValueError, TypeError):
            out[node] = None
    return out


def hot_keys(st) -> list[ChunkKey]:
    """Every key of the local tiers ``st.tiers``, hottest first (each tier's eviction order
    reversed, the faster tier's keys first), each one right after its ancestors held
    locally, root first (a request touches its chunks head first, so the hottest key is a
    prompt's tail: written first without its parents it would be unreachable in Redis until
    they are, and never if a master's room ran out before them); each key once; removed keys
    left out. Empty once the store is closed. Under the store lock."""
    if st.closed:
        return []
    hot: dict[ChunkKey, None] = {}
    for t in st.tiers:
        for k in reversed(t.eviction_order()):
            if k not in st.doomed:
                hot.setdefault(k, None)
    out: list[ChunkKey] = []
    done: set[ChunkKey] = set()
    parent_of = st.mover.parent_of
    for k in hot:
        chain = []
        while k is not None and k in hot and k not in done:
            done.add(k)
            chain.append(k)
            k = parent_of(k)
        out.extend(reversed(chain))
    return out


def on_nodes(remote, keys: list[ChunkKey], nodes: set[str]) -> list[ChunkKey]:
    """The ``keys`` whose slot Redis masters ``nodes`` serve (and those no master covers
    now), in order. Outside the store lock: a slot per key."""
    wanted = nodes | {None}
    return [k for k in keys if remote.nodes.node_of(remote.redis_key(k)) in wanted]


def _read(st, key: ChunkKey):
    """``(kv, parent)`` of ``key`` read out of its fastest local tier (a new CPU tensor), or
    None (removed, gone, the store closed). The read runs outside the store lock, the chunk
    reader-pinned, as ``get_chunks`` does: a disk read never holds the lock."""
    with st.lock:
        src = None if st.closed else st.locate(key)
        if src is None:
            return None
        st.pins.add_reader(key)
        parent = st.mover.parent_of(key)
    kv = None
    try:
        kv = src.read(key, "cpu")
    finally:
        with st.lock:
            st.pins.drop_reader(key)
            st.maybe_free(key)
    return None if kv is None else (kv, parent)


def _pass(st, keys: list[ChunkKey], rep: RepublishReport, room: dict[str, int | None],
          stopped=lambda: False) -> list[ChunkKey]:
    """Ask Redis for ``keys`` and queue those it lacks (counted in ``rep``) while their
    master has ``room`` (bytes left per master, taken from as chunks are queued; a master
    not in it or None: no limit); returns the keys not asked (their node failed or was
    late). Stops early when the store or the remote tier closes or ``stopped()``."""
    remote = st.remote
    unknown: list[ChunkKey] = []
    for i in range(0, len(keys), BATCH):
        if remote.closed or st.closed or stopped():
            break
        batch = keys[i:i + BATCH]
        for key, there in zip(batch, remote.exists(batch)):
            if there is None:
                unknown.append(key)
                continue
            if there:
                rep.present += 1
                continue
            node = remote.nodes.node_of(remote.redis_key(key))
            left = room.get(node)
            if left is not None and left <= 0:
                rep.no_room += 1  # (not read: its master is full)
                continue
            got = _read(st, key)
            if got is None:
                continue
            kv, parent = got
            nbytes = kv.numel() * kv.element_size()
            if left is not None:
                if nbytes + HEADER_BYTES_MAX > left:
                    room[node] = 0  # (a colder chunk written now would evict a hotter one)
                    rep.no_room += 1
                    continue
                room[node] = left - nbytes - HEADER_BYTES_MAX
            while (remote.queued_bytes + nbytes > remote.queue_capacity
                   and nbytes <= remote.queue_capacity and not remote.closed and not stopped()):
                time.sleep(0.005)  # (the writer drains it; waiting beats a dropped write)
            # queued under the store lock, still stored: a ``remove`` or ``clear`` since the
            # read (its Redis deletion forgets queued writes, and runs after its local part)
            # or a close (the queue would count it dropped) keeps it out of Redis
            with st.lock:
                ok = not st.closed and st.locate(key) is not None and remote.put_behind(
                    key, kv, parent)
            if ok:
                rep.written += 1
                rep.written_bytes += nbytes
    return unknown


def republish(st, reason: str = "", nodes: set[str] | None = None,
              stop: threading.Event | None = None) -> RepublishReport:
    """One pass (module docstring) over store state ``st`` (its ``remote`` set), for the
    chunks that Redis masters ``nodes`` hold (None: every master). ``stop``: set to end the
    pass early (the store closing).

    Returns:
        The ``RepublishReport`` (also logged in one line, with ``reason``, unless the store
        closed before the pass began).
    """
    remote = st.remote
    stop = stop if stop is not None else threading.Event()
    rep = RepublishReport()
    t0 = time.monotonic()
    with st.lock:
        keys = hot_keys(st)
    if nodes is not None:
        keys = on_nodes(remote, keys, nodes)
    rep.held = len(keys)
    try:
        room = redis_room(remote, nodes if nodes is not None else remote.nodes.primaries())
    except RedisError:
        room = {}
    unknown: list[ChunkKey] = []
    for attempt in range(1 + RETRIES):
        unknown = _pass(st, keys, rep, room, stop.is_set)
        if not unknown or remote.closed or st.closed or attempt == RETRIES:
            break
        keys = unknown
        if stop.wait(RETRY_PAUSE_S * 2 ** attempt):
            break
    rep.unknown = len(unknown)
    remote.metrics.inc("republished", rep.written)
    rep.seconds = time.monotonic() - t0
    if rep.held or not st.closed:
        log.info("remote tier%s: queued %d chunks (%d bytes) of the %d held locally that "
                 "Redis lacked, in %.2f s (%d were there, %d not asked: their node failed or "
                 "was late, %d left out: their master's maxmemory reached)",
                 f" ({reason})" if reason else "", rep.written, rep.written_bytes, rep.held,
                 rep.seconds, rep.present, rep.unknown, rep.no_room)
    return rep


class Republisher:
    """Runs ``republish`` on a thread of its own when ``schedule`` is called (the remote
    tier's ``on_node_restart``), one pass at a time, one more if asked during a pass (over
    the nodes named since). Each pass starts after a random pause of up to ``jitter_s``
    seconds: every host of a fleet notices a restart within one check interval, and spread
    over it the later ones find in Redis what the earlier ones wrote (a chunk every host holds
    is written about once, not once per host). ``close`` (the remote tier's, at the store's
    close) ends the pause or the pass and waits for the thread.

    Args:
        st: the store's state (with a remote tier).
        jitter_s: longest pause before a pass (seconds, >= 0).
    """

    #: passes kept in ``reports`` (the latest)
    MAX_REPORTS = 16

    def __init__(self, st, jitter_s: float = 0.0) -> None:
        self.st, self.jitter_s = st, float(jitter_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = False  # (a thread runs passes; under ``_lock``)
        self._again: set[str] = set()
        self.reports: list[RepublishReport] = []  # (the latest passes, oldest first)

    def schedule(self, node: str) -> None:
        """Start a pass for the restart of ``node`` (or queue one after the running pass);
        nothing once closed."""
        with self._lock:
            if self._stop.is_set():
                return
            if self._busy:  # (its loop takes ``_again`` under this lock before it ends)
                self._again.add(node)
                return
            self._busy = True
            self._thread = threading.Thread(target=self._run, args=({node},),
                                            name="kvstore-republish", daemon=True)
            self._thread.start()

    def _run(self, nodes: set[str]) -> None:
        try:
            while not self._stop.wait(random.uniform(0.0, self.jitter_s)):
                names = ", ".join(sorted(nodes))
                try:
                    rep = republish(self.st, f"node {names} restarted", nodes, self._stop)
                    self.reports = (self.reports + [rep])[-self.MAX_REPORTS:]
                except Exception:
                    if self._stop.is_set() or self.st.closed:
                        return  # (the store closed under the pass: nothing to report)
                    log.exception("remote tier: writing local chunks again after node %s "
                                  "restarted failed", names)
                with self._lock:
                    if not self._again or self.st.closed or self._stop.is_set():
                        self._again.clear()
                        self._busy = False  # (a schedule from now on starts a thread)
                        return
                    nodes, self._again = self._again, set()
        finally:
            with self._lock:
                self._busy = False

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running pass, if any (tests, close)."""
        t = self._thread
        if t is not None:
            t.join(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """End the pause or the pass under way and wait up to ``timeout`` seconds for the
        thread; no pass starts after. Idempotent."""
        with self._lock:
            self._stop.set()
        if threading.current_thread() is not self._thread:
            self.join(timeout)


def open_remote(st, config, registry):
    """The remote tier of ``config`` (a ``StoreConfig`` with ``remote_url``) for store state
    ``st``, wired to it: the lossy-codec rule its writes follow, and a ``Republisher``
    (``st.republisher``) called when a node restarted. ``registry``: the store's metrics
    registry.

    Raises:
        ValueError: as ``RemoteTier`` (bad settings, Redis unreachable).
    """
    from kvstore.tiers.remote import RemoteTier

    remote = RemoteTier(
        config.remote_url, config.remote_key_prefix, config.remote_ttl_s,
        config.remote_timeout_s, config.remote_queue_bytes, config.remote_password,
        config.remote_codec, registry=registry,
        breaker_threshold=config.remote_breaker_failures,
        breaker_reset_s=config.remote_breaker_reset_s,
        restart_check_s=config.remote_restart_check_s)
    remote.lossy_codec_of = st.lossy_codec_of
    st.republisher = Republisher(st, jitter_s=config.remote_restart_check_s)
    remote.on_node_restart = st.republisher.schedule
    remote.on_close = st.republisher.close
    return remote
