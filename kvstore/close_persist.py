"""Writing the memory tiers' chunks to the disk tier before a store closes.

The disk tier survives a restart; the GPU and CPU tiers do not. ``persist_memory_tiers``
copies the chunks that only a memory tier holds to the disk tier through the spill path
(``TierMover.insert``: the disk tier's codec, its checksummed values, its index), so a
gracefully closed store (``ChunkStore.close(persist_s=...)``, ``kvstore serve`` on
SIGTERM/SIGINT) keeps its cache. A crash (SIGKILL, power loss) writes nothing: only what was
on disk already survives it.

Order: first the memory chunks that a disk chunk names as its parent (so the chunks spilled to
disk before the close stay reachable after the restart: without their parent they would be
unreachable), then the others; each group hottest first, i.e. each memory tier's eviction
order reversed (the top tier's chunks before the next tier's; demoted chunks last), so that
what is most likely reused is written when the time or the room runs out. A chunk's ancestors
that the disk tier lacks are written just before it (parents before children), so every chunk
written is reachable after a restart; a chunk whose ancestor is stored nowhere (unreachable
already) is left out.

Bounds: a time budget (seconds, wall clock, including the wait for the disk writer's
commits: chunks still queued when it runs out are withdrawn, so the close that follows only
finishes the batch being committed, at most ``BATCH_OPS`` chunks), and the disk tier's free
room (never evicting a disk chunk for this: a chunk that does not fit is left out with its
descendants, which would be unreachable without it, and the pass goes on with the chunks that
do fit, e.g. another namespace's smaller ones). An error ends the pass (a chunk that cannot be
read out of its tier) or leaves a chunk out (a write the disk writer drops: its children are
withdrawn); the close goes on.

Before that pass (``prepare_close``), the chunks removed while pinned leave the disk tier: a
close forestalls their last unpin, and a restart must not bring them back.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kvstore.keys import ChunkKey
from kvstore.tiers.disk import BATCH_OPS, QUEUE_BYTES, DiskTier
from kvstore.tiers.memory import MemoryTier

log = logging.getLogger("kvstore.store")

class PersistProgress:
    """Where the running ``persist_memory_tiers`` pass is (read by a signal handler that exits
    during it: ``kvstore serve``'s second SIGTERM/SIGINT). ``todo``: chunks the pass set out
    to write; ``running``: whether a pass runs now; ``committed``: chunks the pass queued to
    the disk writer that are no longer queued (committed; a write the writer dropped on an
    I/O error counts too). Written by the pass's thread only; reading takes no lock."""

    def __init__(self) -> None:
        self.todo = 0
        self.running = False
        self._queued: list[ChunkKey] = []
        self._disk: DiskTier | None = None

    def start(self, todo: int, queued: list[ChunkKey], disk: DiskTier) -> None:
        """A pass begins: ``todo`` chunks to write; it appends what it queues to ``queued``."""
        self.todo, self._queued, self._disk, self.running = todo, queued, disk, True

    def finish(self) -> None:
        self.running, self._disk = False, None

    @property
    def committed(self) -> int:
        disk = self._disk
        if disk is None:
            return 0
        return sum(1 for k in list(self._queued) if not disk.is_pending(k))

    @property
    def left(self) -> int:
        """Chunks of ``todo`` not committed (yet)."""
        return max(0, self.todo - self.committed)


#: the pass of this process (one store persists at a time: the daemon's, at its close)
PROGRESS = PersistProgress()

#: chunks, and bytes, queued to the disk writer before the older half of them is waited for
#: (so a put never blocks on the writer's queue limit, which has no timeout)
WINDOW = 2 * BATCH_OPS
WINDOW_BYTES = QUEUE_BYTES // 2


@dataclass
class PersistReport:
    """What ``persist_memory_tiers`` did.

    Attributes:
        written_chunks, written_bytes: chunks committed to the disk tier, and their bytes
            there (encoded values).
        left_time: chunks not written because the time budget ran out.
        left_room: chunks not written because the disk tier had no free room for them or
            for one of their ancestors (left out: without it they would be unreachable).
        left_orphan: chunks not written because an ancestor is stored in no tier (a lookup
            cannot reach them now, nor after a restart).
        left_error: chunks not written because of an error: the disk writer dropped them (a
            full or read-only disk: its log line says which), or the pass ended when reading
            one out of its memory tier raised (logged).
        seconds: wall-clock seconds the pass took.
        reattached: chunks on the disk tier before the pass that it made reachable (after a
            restart) by writing an ancestor that only a memory tier held.
    """

    written_chunks: int = 0
    written_bytes: int = 0
    left_time: int = 0
    left_room: int = 0
    left_orphan: int = 0
    left_error: int = 0
    seconds: float = 0.0
    reattached: int = 0

    @property
    def left_chunks(self) -> int:
        """Chunks of the memory tiers not written, all reasons."""
        return self.left_time + self.left_room + self.left_orphan + self.left_error


def hot_order(tiers) -> list[ChunkKey]:
    """Keys of the memory tiers in ``tiers`` (fastest first), hottest first: each tier's
    eviction order (``Tier.eviction_order``) reversed, the faster tier's keys first, each key
    once, demoted keys after all others."""
    seen: set[ChunkKey] = set()
    hot, cold = [], []
    for t in tiers:
        if not isinstance(t, MemoryTier):
            continue
        for k in reversed(t.eviction_order()):
            if k not in seen:
                seen.add(k)
                (cold if t.is_demoted(k) else hot).append(k)
    return hot + cold


def persist_memory_tiers(st, budget_s: float) -> PersistReport | None:
    """Write the memory tiers' chunks that the disk tier lacks to it (module docstring).

    Args:
        st: the store's ``StoreState``; its lock is held for the whole pass.
        budget_s: seconds allowed, commits included (> 0).

    Returns:
        A ``PersistReport`` (also logged in one line), or None when the store has no disk
        tier or no memory tier.

    Raises:
        ValueError: ``budget_s`` not a positive finite number.
    """
    if not 0 < budget_s < float("inf"):
        raise ValueError(f"persist budget must be a positive number of seconds, got {budget_s!r}")
    disk = next((t for t in st.tiers if isinstance(t, DiskTier)), None)
    if disk is None or not any(isinstance(t, MemoryTier) for t in st.tiers):
        return None
    t0 = time.monotonic()
    deadline = t0 + budget_s
    di = st.tiers.index(disk)
    rep = PersistReport()
    ours: list[ChunkKey] = []
    with st.lock:
        st.expire_leases()
        todo = anchors_first(st, disk, [k for k in hot_order(st.tiers)
                                        if not disk.contains(k) and k not in st.doomed])
        PROGRESS.start(len(todo), ours, disk)
        orphans: set[ChunkKey] = set()
        no_room: set[ChunkKey] = set()  # left out for room, with their descendants
        window: deque[tuple[ChunkKey, int]] = deque()
        window_bytes = 0
        stop = None
        try:
            for key in todo:
                if disk.contains(key) or key in orphans or key in no_room:
                    continue
                chain = _missing_chain(st, disk, key, orphans, no_room)
                if chain is None:
                    continue
                for j, (k, src, parent) in enumerate(chain):
                    if time.monotonic() >= deadline:
                        stop = "time"
                        break
                    nbytes = src.data_nbytes(k)
                    kv = src.read(k, "cpu") if disk.can_fit(nbytes) else None  # (owned)
                    if kv is None or not st.mover.insert(di, k, kv, parent, owned=True,
                                                         admit=False):
                        # (the disk tier took nothing: it could not fit) its descendants
                        # would be unreachable: left out too; smaller chunks may still fit
                        no_room.update(c for c, _, _ in chain[j:])
                        break
                    ours.append(k)
                    window.append((k, nbytes))
                    window_bytes += nbytes
                    if len(window) >= WINDOW or window_bytes >= WINDOW_BYTES:
                        batch = [window.popleft() for _ in range((len(window) + 1) // 2)]
                        window_bytes -= sum(n for _, n in batch)
                        if not disk.wait_committed([b for b, _ in batch],
                                                   max(0.0, deadline - time.monotonic())):
                            stop = "time"
                            break
                if stop is not None:
                    break
        except Exception:  # (e.g. a device error reading a chunk out): end the pass cleanly
            log.exception("persist on close: the pass failed; keeping what it wrote")
            stop = "error"
        withdrawn = 0
        if not disk.wait_committed(ours, max(0.0, deadline - time.monotonic())):
            for k in reversed(ours):  # withdraw what is still queued (children first)
                if disk.is_pending(k):
                    withdrawn += disk.delete(k)
            stop = stop or "time"
        for k in ours:  # (parents first) a write the disk writer dropped strands its children
            p = st.mover.parent_of(k)
            if disk.contains(k) and p is not None and not disk.contains(p):
                disk.delete(k)
        written = {k for k in ours if disk.contains(k)}  # (a dropped write may be retried)
        PROGRESS.finish()
        rep.written_chunks = len(written)
        rep.written_bytes = sum(disk.nbytes_of(k) for k in written)
        rep.left_orphan = len(orphans)
        rep.reattached = _disk_below(st, disk, written, set(ours))
        left = [k for k in todo if not disk.contains(k) and k not in orphans]
        rep.left_room = sum(1 for k in left if k in no_room)  # (never queued by the pass)
        rest = len(left) - rep.left_room
        # written, then dropped by the writer (or stranded by such a drop): an I/O error
        failed = len({k for k in ours if not disk.contains(k)}) - withdrawn
        if stop == "error":
            rep.left_time, rep.left_error = withdrawn, rest - withdrawn
        else:
            rep.left_error, rep.left_time = failed, rest - failed
    rep.seconds = time.monotonic() - t0
    log.info("persist on close: wrote %d chunks (%d bytes) of the memory tiers to the disk tier "
             "in %.2f s; left out %d: %d when the %g s budget ran out, %d with the disk tier "
             "full, %d with an ancestor stored nowhere, %d on an error; %d chunks already on "
             "disk made reachable", rep.written_chunks, rep.written_bytes, rep.seconds,
             rep.left_chunks, rep.left_time, budget_s, rep.left_room, rep.left_orphan,
             rep.left_error, rep.reattached)
    return rep


def anchors_first(st, disk: DiskTier, keys: list[ChunkKey]) -> list[ChunkKey]:
    """``keys`` (memory chunks the disk tier lacks), those that a disk chunk names as its
    parent first (a disk chunk is unreachable after a restart without them), each group in
    its order in ``keys``. O(len(keys)), under the store lock."""
    first = [k for k in keys if any(c not in st.doomed for c in disk.children_of(k))]
    if not first:
        return keys
    lead = set(first)
    return first + [k for k in keys if k not in lead]


def _disk_below(st, disk: DiskTier, written: set[ChunkKey], ours: set[ChunkKey]) -> int:
    """How many chunks of the disk tier not queued by the pass (``ours``) lie below the chunks
    it wrote (``written``) through disk chunks only: those it made reachable."""
    n, frontier = 0, list(written)
    while frontier:
        frontier = [c for k in frontier for c in disk.children_of(k)
                    if c not in ours and c not in st.doomed and disk.contains(c)]
        n += len(frontier)
    return n


def _missing_chain(st, disk: DiskTier, key: ChunkKey, orphans: set[ChunkKey],
                   no_room: set[ChunkKey]):
    """``[(key, memory tier, parent), ...]`` of ``key`` and its ancestors that the disk tier
    lacks, root-most first; None when one of them is stored in no memory tier (its chain
    is broken: unreachable) or the recorded parents make a cycle, or is in ``orphans``
    (the keys walked then join ``orphans``), or is in ``no_room`` (left out for room: the
    keys walked, its descendants, join it)."""
    chain, seen = [], set()
    k = key
    while k is not None and not disk.contains(k):
        if k in no_room:
            no_room.update(c for c, _, _ in chain)
            return None
        src = st.locate(k)
        if k in seen or k in orphans or not isinstance(src, MemoryTier):
            orphans.update(c for c, _, _ in chain)
            return None
        seen.add(k)
        parent = st.mover.parent_of(k)
        chain.append((k, src, parent))
        k = parent
    chain.reverse()
    return chain


def prepare_close(st, budget_s: float) -> None:
    """What ``ChunkStore.close`` does before it closes the tiers, under the store lock: the
    chunks removed while pinned (``st.doomed``, freed at their last unpin, which a close
    forestalls) leave the disk tier, so a restart does not bring them back, and nothing is
    persisted under them; then, when ``budget_s`` > 0, ``persist_memory_tiers``."""
    disk = next((t for t in st.tiers if isinstance(t, DiskTier)), None)
    for k in st.doomed if disk is not None else ():
        disk.delete(k)
    if budget_s > 0:
        persist_memory_tiers(st, budget_s)
