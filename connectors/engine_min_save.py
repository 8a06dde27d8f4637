"""Worker-side saves of ``connectors.engine_min.EngineMinConnector``: the ``Saver`` it owns.

The connector decides *what* to save (``connectors.chunk_plan.RequestChunks``:
``chunks_to_save`` / ``pieces_to_save`` give a ``connectors.chunk_records.SaveRange``, after a
prefill step and at request end); the ``Saver`` gathers the range's chunks or tail pieces out of
the engine's paged KV pool (``kernels.ops.gather_chunk``, one per unit) and hands them to a
bounded background writer (``connectors.save_queue.SaveQueue``, ``save_queue_bytes``). When the
queue is full the save is dropped and counted (``dropped_save_chunks``), never waited for.

When a saved chunk covers tail pieces this request saved before (``SaveRange.supersedes``: its
answer filled the chunk of pieces), the writer thread demotes those pieces right after the put
(``connectors.save_queue.demote_superseded``): they become the first eviction candidates of
every tier, yet still serve a prompt sharing the prefix up to a piece while there is room. A
failed demotion is counted (``demote_errors``) and logged once per cause; it only costs room,
later. The put's answer (``kvstore.daemon.put_result.PutResult``) says which chunks are stored,
so the demotion asks the store (``exists``) only when it does not (an older daemon, or chunks
stored before among refused ones).

Chunks a daemon refused (``PutResult.refused``: their parent is stored nowhere,
``parent_missing``, or no tier could take them, ``no_room``; those after the first refused one
too) are counted in ``refused_chunks``, never in ``saved_chunks`` (chunks newly stored).
``parent_missing`` means the prefix was evicted between the request's lookup and its save: one
INFO line the first time, DEBUG after. ``no_room`` is a WARNING, once per cause until a put is
stored whole again. Chunks an in-process store refused are counted alike: its put answers a
plain count, so the writer asks ``exists`` when a put stored fewer chunks than it sent
(``connectors.put_answer.checked_put``); its first ``no_room`` is one WARNING for the
connector's life, naming the tier sizes, the chunk size and the flag to raise (its tiers'
size caps how many chunks of one prompt are stored, and what reaches a remote tier below
them), the rest DEBUG.

A chunk larger than the daemon's ``--max-body-bytes`` can never be saved to it
(``connectors.chunk_limit``): ``check_chunk_limit`` asks at start, and one WARNING names both
sizes; when the daemon is the only store, the saves of that namespace are then skipped before
any gather, each counted in ``save_errors`` as the put's ``ChunkTooLarge`` was (a put that
meets ``ChunkTooLarge`` later does the same, from then on).

Devices (``connectors.engine_min_device``): chunks are gathered on the pool's device; a store
without a GPU tier on top gets host copies (pinned, made without waiting), and the writer waits
for the event recorded after them before the put. On a CPU pool the gathered tensors go as
they are.
"""
from __future__ import annotations

import logging

import torch

from connectors import chunk_limit
from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_records import SaveRange
from connectors.engine_min_device import StagedChunks, stage_for_store, takes_device_chunks
from connectors.engine_min_stats import ConnectorStats
from connectors.put_answer import LocalPutResult, checked_put, log_local_refusal
from connectors.save_queue import SaveQueue, demote_superseded
from kernels import ops
from kvstore.api import KVStoreBase
from kvstore.daemon.batches import ChunkTooLarge
from kvstore.keys import Namespace

log = logging.getLogger("connectors.engine_min")


class Saver:
    """Saves of one connector's requests out of its engine's paged KV pool.

    Args:
        store: the store written to (``put_chunks``, ``demote``).
        stats: the connector's counters (queued, dropped, saved chunks and bytes, errors).
        save_queue_bytes: bytes of gathered chunks waiting for the writer; a save that would
            exceed it is dropped (counted) unless the queue is empty.
        enabled: False: nothing is gathered or put (a store this engine may only read).
    """

    def __init__(self, store: KVStoreBase, stats: ConnectorStats, save_queue_bytes: int,
                 enabled: bool = True) -> None:
        self.store, self.stats = store, stats
        self.enabled = enabled
        self.save_queue_bytes = save_queue_bytes
        self.kv_cache: torch.Tensor | None = None
        self.geometry: ChunkGeometry | None = None
        self.tail_ns: Namespace | None = None
        self._host_copies = False   # give the store host copies of device chunks (bind)
        self._queue = SaveQueue(self._put, save_queue_bytes, self._saved)
        self._oversize: set[Namespace] = set()   # warned: the daemon cannot take its chunk
        self._skipped: set[Namespace] = set()    # ... and its saves are skipped
        self._refusals_told: set[str] = set()    # refusal reasons logged at INFO (writer)

    def bind(self, kv_cache: torch.Tensor, geometry: ChunkGeometry,
             tail_ns: Namespace | None) -> None:
        """Gather from ``kv_cache`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
        head_dim]`` laid out as ``geometry`` says; puts into ``tail_ns`` count as tail pieces.
        A pool off the CPU hands the store host copies unless the store takes device chunks
        (``takes_device_chunks``)."""
        self.kv_cache, self.geometry, self.tail_ns = kv_cache, geometry, tail_ns
        self._host_copies = kv_cache.device.type != "cpu" and not takes_device_chunks(self.store)

    def check_chunk_limit(self, *namespaces: Namespace | None) -> None:
        """At start: for each namespace whose chunk is larger than the daemon's
        ``max_body_bytes`` (``chunk_limit.oversize``; asks the daemon when no call was
        answered yet), log the one WARNING and skip its saves when the daemon is the only
        store. Nothing for a store without a daemon, or when saves are off."""
        for ns in namespaces:
            if ns is not None and self.enabled:
                over = chunk_limit.oversize(self.store, ns)
                if over is not None:
                    self._too_large(ns, *over)

    def _too_large(self, ns: Namespace, chunk_bytes: int, max_body_bytes: int) -> None:
        """``ns``'s chunk cannot reach the daemon: warn once, skip its saves from now on
        when the daemon is the only store."""
        if ns in self._oversize:
            return
        self._oversize.add(ns)
        skip = chunk_limit.saves_go_to_daemon_only(self.store)
        if skip:
            self._skipped.add(ns)
        chunk_limit.warn(self.store, ns, chunk_bytes, max_body_bytes, skip)

    def queue(self, rng: SaveRange | None, block_ids: list[int]) -> None:
        """Gather the units of ``rng`` out of the pool (``block_ids``: the request's blocks)
        and queue them (or drop them, counted, when the queue is full). None: nothing. A
        namespace the daemon cannot take a chunk of (``check_chunk_limit``) is skipped, one
        ``save_errors`` per save."""
        if rng is None or not self.enabled:
            return
        if rng.ns in self._skipped:
            self.stats.add(save_errors=1)
            return
        if not self._reserve(len(rng.keys), rng.nbytes):
            return
        g = self.geometry
        kvs = [ops.gather_chunk(self.kv_cache, g.unit_blocks(block_ids, s, rng.unit))
               for s in rng.starts]
        kvs = stage_for_store(kvs, self.kv_cache.device, self._host_copies)
        then = None if rng.supersedes is None else (
            lambda stored, rng=rng: self._demote(rng, stored))
        self._queue.submit(rng.ns, list(rng.keys), kvs, rng.nbytes, rng.parents, then)

    def _put(self, ns: Namespace, keys, kvs: StagedChunks, *parents) -> int:
        """Writer thread: once the device finished ``kvs`` (their event), put them; the
        answer says the chunks refused, also for an in-process store (``checked_put``; a
        failed ``exists`` leaves the plain count)."""
        kvs.ready.wait()
        stored = self.store.put_chunks(ns, keys, list(kvs), *parents)
        try:
            return checked_put(self.store, ns, keys, stored, *parents)
        except Exception as exc:  # noqa: BLE001 - the put succeeded; only the split is lost
            log.debug("kv connector: exists after a put failed (%s: %s)",
                      type(exc).__name__, exc)
            return stored

    def _demote(self, rng: SaveRange, stored: int) -> None:
        """Writer thread, after ``rng``'s chunks were put: demote the tail pieces they cover
        (``demote_superseded``); a failure is counted (``demote_errors``) and logged once per
        cause."""
        try:
            n = demote_superseded(self.store, rng.ns, rng.keys, stored, rng.supersedes)
            self.stats.add(demoted_tail_chunks=n)
            self.stats.recovered("demote")
        except Exception as exc:  # noqa: BLE001 - a lost demotion only costs room, later
            self.stats.add(demote_errors=1)
            self.stats.warn("demote", "kv connector: demoting tail pieces failed (%s: %s)",
                                 type(exc).__name__, exc)

    def _reserve(self, n_chunks: int, nbytes: int) -> bool:
        """Room in the save queue for ``nbytes`` (counted as queued), or a counted drop."""
        ok = self._queue.try_reserve(nbytes)
        self.stats.add(**{"queued_chunks" if ok else "dropped_save_chunks": n_chunks})
        if not ok:
            self.stats.warn("save_drop", "kv connector: save queue full (%d bytes); "
                                 "dropping saves", self.save_queue_bytes)
        return ok

    def _saved(self, ns: Namespace, stored: int | None, seconds: float,
               error: Exception | None) -> None:
        """``SaveQueue`` callback (writer thread): count what one put stored (and what the
        daemon refused, ``_refused``), or its error."""
        self.stats.observe("save", seconds)
        kind = "tail save" if ns is self.tail_ns else "save"   # may fail apart (sizes differ)
        if error is None:
            refused = getattr(stored, "refused", None) or 0   # (None: a store that does not say)
            self.stats.add(**{"saved_tail_chunks" if ns is self.tail_ns else "saved_chunks":
                              int(stored), "saved_bytes": int(stored) * ns.layout.chunk_bytes,
                              "refused_chunks": refused})
            self.stats.recovered(kind)
            if refused:
                self._refused(kind, stored, ns)
            else:
                self.stats.recovered("room for saves")
        elif isinstance(error, ChunkTooLarge):   # (nothing was sent)
            self.stats.add(save_errors=1)
            self._too_large(ns, error.nbytes, error.max_body_bytes)
        else:
            self.stats.add(save_errors=1)
            self.stats.warn(kind, f"kv connector: {kind} failed (%s: %s)",
                            type(error).__name__, error)

    def _refused(self, kind: str, stored, ns: Namespace) -> None:
        """Log a put the daemon refused ``stored.refused`` chunks of (``PutResult``), by the
        first refused chunk's reason: ``parent_missing`` at INFO the first time, then DEBUG;
        any other (``no_room``) a WARNING once per cause until a put is stored whole."""
        first = getattr(stored, "first_refused", None) or {}
        reason = first.get("reason", "unknown")
        if isinstance(stored, LocalPutResult):
            log_local_refusal(log, self._refusals_told, self.store, ns, kind, stored)
            return
        if reason == "parent_missing":
            level = logging.DEBUG if reason in self._refusals_told else logging.INFO
            self._refusals_told.add(reason)
            log.log(level, "kv connector: the daemon refused %d of %d chunks of a %s "
                    "(parent_missing: the prefix was evicted between lookup and save; "
                    "such refusals are counted in refused_chunks, logged at DEBUG from now "
                    "on)", stored.refused, stored.num_chunks, kind)
            return
        self.stats.warn("room for saves", f"kv connector: the daemon refused chunks of a "
                        f"{kind} ({reason}: no tier could take them; counted in "
                        f"refused_chunks)")

    @property
    def queued_bytes(self) -> int:
        """Bytes of gathered chunks waiting for (or being written by) the writer."""
        return self._queue.queued_bytes

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save was written (at most ``timeout_s`` seconds; None =
        no limit). False on timeout."""
        return self._queue.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for queued saves, refuse new ones, stop the writer.
        Idempotent."""
        self._queue.close(timeout_s)
