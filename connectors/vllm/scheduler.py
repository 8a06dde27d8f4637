"""Scheduler side of the vLLM connector: how many prompt tokens past vLLM's own prefix-cache
hit the store holds (lookup and pin), and each step's metadata (loads of admitted requests,
saves of chunks whose tokens are all computed).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_plan import RequestChunks
from connectors.chunk_records import LookupHit
from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.records import (ChunkTransfer, RequestState, ScheduledRequest,
                                     load_transfers, save_transfer)
from connectors.vllm.shared import Counters, StoreCalls

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads (before the forward pass) and saves (after it); ``finished``: the
    finished requests whose blocks vLLM keeps until these saves are copied out."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)


def scheduled_requests(out: "SchedulerOutput") -> tuple[list[ScheduledRequest], set[str]]:
    """The requests of one ``SchedulerOutput`` (new, then cached) and the ids of those resumed
    after preemption (their ``new_blocks`` are their whole block table)."""
    steps = [ScheduledRequest(nr.req_id, nr.num_computed_tokens, nr.block_ids[0])
             for nr in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        nb = cached.new_block_ids[i]
        steps.append(ScheduledRequest(req_id, cached.num_computed_tokens[i],
                                      nb[0] if nb else None))
    return steps, set(getattr(cached, "resumed_req_ids", ()) or ())


class SchedulerSide:
    """Per-request chunk state of the scheduler-side connector: vLLM's vocabulary translated
    into the connector core (``connectors.chunk_plan.RequestChunks``, the same key chains,
    hit arithmetic, load plans and save ranges as the engine_min connector's).

    Args:
        geometry: vLLM's block size, the chunk size and the tail piece size (0 = off).
        namespaces: the requests' namespaces.
        calls: the store and its deadline.
        counters: the connector's counters.
        pin_lease_s: pin lease of chunks a lookup found (s); 0 = no pins (nor on a store
            whose ``capabilities`` declare none).
        block_table: ``(req_id, fallback) -> block ids``: vLLM's current block table of a
            request, ``fallback`` when vLLM cannot say.
        saves: False: no save is planned (no chunk is copied out or sent): vLLM's
            ``kv_role="kv_consumer"``, or a store that may only be read (a daemon token whose
            role is reader, ``connectors.stores.engine_saves``); lookups and loads as usual.
        loads: False (vLLM's ``kv_role="kv_producer"``): no lookup is made and nothing is
            loaded (every lookup answers 0 tokens); saves as usual.
        pins: whether chunks a lookup found are pinned (None: as ``saves``). False for a
            reader token: the daemon refuses a reader's pin (403), which would turn every hit
            into a prefill.
    """

    def __init__(self, geometry: ChunkGeometry, namespaces: RequestNamespaces,
                 calls: StoreCalls, counters: Counters, pin_lease_s: float,
                 block_table: Callable[[str, list[int]], list[int]],
                 saves: bool = True, loads: bool = True, pins: bool | None = None) -> None:
        self.geometry = geometry
        self.saves, self.loads = saves, loads
        self.namespaces, self.calls, self.counters = namespaces, calls, counters
        self.pin_lease_s = pin_lease_s if (saves if pins is None else pins) else 0.0
        self._block_table = block_table
        self.requests: dict[str, RequestState] = {}
        self.finish_saves: list[ChunkTransfer] = []   # of finished requests, for the next step
        self.finish_ids: set[str] = set()

    def _state(self, request: Any) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            ns = self.namespaces.of(request)
            chunks = RequestChunks(self.geometry, ns, self.namespaces.tail(ns))
            state = RequestState(request, list(request.prompt_token_ids or []), chunks)
            self.requests[request.request_id] = state
        return state

    def lookup(self, request: "Request", num_computed_tokens: int) -> int:
        """Prompt tokens beyond ``num_computed_tokens`` (vLLM's own hit) that the store can
        supply: the leading stored chunks past the hit, then the stored tail pieces after
        them, capped at ``prompt_len - 1``, as the store's ``lookup_keys`` answers (a
        daemon counts it in its ``lookups``, ``requested_tokens`` and ``hit_tokens``). Any
        store error or deadline means 0 (a failed tail lookup: the chunks found still count),
        warned once per cause (``StoreCalls.warn``); 0 without asking the store when
        ``loads`` is off (``kv_role="kv_producer"``)."""
        self.counters.add(local_tokens=num_computed_tokens)
        state = self._state(request)
        state.num_local = num_computed_tokens
        n, nc = len(state.tokens), num_computed_tokens
        q = (state.chunks.lookup_query(state.tokens, n, nc)
             if nc < n - 1 and self.loads else None)
        if q is None:
            return 0
        t0 = time.perf_counter()
        store, ns = self.calls.store, state.chunks.chunks.ns
        tail_ns = state.chunks.pieces.ns if state.chunks.pieces is not None else None
        n_hit = 0
        if q.keys:   # the store's lookup: leading chunks held (a daemon counts it)
            try:
                n_hit = self.calls(store.lookup_keys, ns, list(q.keys)).num_hit_chunks
            except Exception as e:  # store down or late: a miss
                self.counters.add(lookups=1, lookup_errors=1)
                self.calls.warn("lookup", "kvstore lookup failed (%s: %s); prefilling",
                                type(e).__name__, e)
                state.chunks.record(LookupHit.miss(n, nc))
                return 0
        pieces = q.tail_range(n_hit)
        t_hit = 0
        if pieces:
            try:
                t_hit = self.calls(store.lookup_keys, tail_ns,
                                   list(q.tail_keys[pieces.start:pieces.stop])).num_hit_chunks
            except Exception as e:  # the full chunks still count
                self.calls.warn("lookup", "kvstore tail lookup failed (%s: %s)",
                                type(e).__name__, e)
                self.counters.add(lookup_errors=1)
                t_hit = 0
            else:
                self.calls.recovered("lookup")
        elif q.keys:
            self.calls.recovered("lookup")
        ext = state.chunks.record(q.hit(n_hit, num_hit_pieces=t_hit))
        self.counters.add(lookups=1, hit_tokens=ext)
        if ext and self.pin_lease_s > 0 and store.capabilities.pins:
            try:
                for pin_ns, keys in ((ns, list(q.keys[:n_hit])), (tail_ns, list(
                        q.tail_keys[pieces.start:pieces.start + t_hit]) if t_hit else [])):
                    if keys:
                        self.calls(store.pin, pin_ns, keys, self.pin_lease_s)
                        state.pinned.append((pin_ns, keys))
            except Exception as e:
                self.calls.warn("pin", "kvstore pin failed (%s: %s); prefilling",
                                type(e).__name__, e)
                self.counters.add(lookup_errors=1)
                return 0
            self.calls.recovered("pin")
        log.debug("lookup %s: %.2f ms, %d local + %d external tokens", request.request_id,
                  (time.perf_counter() - t0) * 1e3, nc, ext)
        return ext

    def allocated(self, request: "Request", num_external_tokens: int) -> None:
        """vLLM admitted ``request`` with ``num_external_tokens`` tokens to load: the core
        turns the last lookup's hit into a load plan (and counts the chunks it found as
        stored, so they are not saved again)."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        state.load = state.chunks.admit(state.tokens, len(state.tokens), state.num_local,
                                        num_external_tokens)
        if num_external_tokens:
            self.counters.add(external_tokens=num_external_tokens)

    def build_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        """This step's loads (requests admitted with external tokens) and saves (chunks, then
        tail pieces, of prompt and generated tokens, whose tokens are all computed once this
        step's forward pass is done), plus the last saves of requests finished since the
        previous step (``finished``)."""
        meta = KVStoreConnectorMetadata()
        steps, resumed = scheduled_requests(scheduler_output)
        for step in steps:
            state = self.requests.get(step.req_id)
            if state is None:
                continue
            if step.new_blocks is not None:
                if step.req_id in resumed or not state.block_ids:
                    state.block_ids = list(step.new_blocks)   # new or resumed: full table
                else:
                    state.block_ids = state.block_ids + list(step.new_blocks)
            block_ids = self._block_table(step.req_id, state.block_ids)
            if state.load is not None:
                meta.loads += load_transfers(step.req_id, state.load, block_ids)
                state.load = None
            done = step.num_computed + scheduler_output.num_scheduled_tokens.get(step.req_id, 0)
            meta.saves += self._saves(step.req_id, state, done, block_ids)
        meta.saves += self.finish_saves
        meta.finished = self.finish_ids
        self.finish_saves, self.finish_ids = [], set()
        return meta

    def _saves(self, req_id: str, state: RequestState, done: int,
               block_ids: list[int]) -> list[ChunkTransfer]:
        """Save transfers of the full chunks in ``[0, end)`` not saved yet and, once the
        prompt's last full chunk is computed, of the tail pieces in ``[0, end)``; ``end`` =
        ``min(done, tokens known)`` over prompt and generated tokens, so a chunk or piece
        filled by decoding is saved at the step that computes its last token::

            tokens   | prompt ........................ | generated ..... |x   (x: no KV yet)
            saved    | chunks ...  | chunk filled by decoding | pieces | partial block (not stored)

        Empty when ``saves`` is off.
        """
        if not self.saves:
            return []
        tokens, chunks = state.request.all_token_ids, state.chunks
        end = min(done, len(tokens))
        ranges = [chunks.chunks_to_save(tokens, end)]
        if end >= self.geometry.floor_to_chunk(len(state.tokens)):
            ranges.append(chunks.pieces_to_save(tokens, end))
        return [save_transfer(req_id, r, block_ids) for r in ranges if r is not None]

    def finished(self, request: "Request", block_ids: list[int]) -> bool:
        """Forget ``request``; a chunk or piece of it whose KV is computed (prompt and generated
        tokens but the last sampled one) and not saved yet is saved by the next step's
        metadata from ``block_ids`` (its blocks as vLLM passes them to ``request_finished``).

        Returns:
            True when such a save is pending: vLLM must keep the blocks until the worker
            reports the request in ``get_finished`` (after copying them out).
        """
        state = self.requests.pop(request.request_id, None)
        if state is None:
            return False
        self._unpin(state)
        done = min(int(request.num_computed_tokens), len(request.all_token_ids) - 1)
        saves = self._saves(request.request_id, state, done, list(block_ids))
        if not saves:
            return False
        self.finish_saves += saves
        self.finish_ids.add(request.request_id)
        return True

    def _unpin(self, state: RequestState) -> None:
        """Drop the pins ``state``'s lookups took (its loads are done or will not come), so a
        small store can evict those chunks again before their lease (``pin_lease_s``) ends;
        a failed unpin is warned once per cause (the lease still ends them)."""
        pinned, state.pinned = state.pinned, []
        try:
            for ns, keys in pinned:
                self.calls(self.calls.store.unpin, ns, keys)
        except Exception as e:  # noqa: BLE001 - the leases end them anyway
            self.calls.warn("unpin", "kvstore unpin failed (%s: %s)", type(e).__name__, e)
