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

from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.records import ChunkTransfer, RequestState, ScheduledRequest, save_runs
from connectors.vllm.shared import Counters, StoreCalls

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads (before the forward pass) and saves (after it)."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


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
    """Per-request chunk state of the scheduler-side connector.

    Args:
        chunk_size: tokens per chunk ``C``.
        tail_chunk_size: tokens per tail piece ``F`` (0 = off).
        namespaces: the requests' namespaces.
        calls: the store and its deadline.
        counters: the connector's counters.
        pin_lease_s: pin lease of chunks a lookup found (s); 0 = no pins.
        block_table: ``(req_id, fallback) -> block ids``: vLLM's current block table of a
            request, ``fallback`` when vLLM cannot say.
    """

    def __init__(self, chunk_size: int, tail_chunk_size: int, namespaces: RequestNamespaces,
                 calls: StoreCalls, counters: Counters, pin_lease_s: float,
                 block_table: Callable[[str, list[int]], list[int]]) -> None:
        self.C, self.F = chunk_size, tail_chunk_size
        self.namespaces, self.calls, self.counters = namespaces, calls, counters
        self.pin_lease_s = pin_lease_s
        self._block_table = block_table
        self.requests: dict[str, RequestState] = {}

    def _state(self, request: Any, tokens: list[int]) -> RequestState:
        state = self.requests.get(request.request_id)
        if state is not None:
            return state
        C, F = self.C, self.F
        n_chunks = len(tokens) // C
        ns = self.namespaces.of(request)
        keys = ns.chunk_keys(tokens[:n_chunks * C]) if n_chunks else []
        state = RequestState(request, ns, keys, [False] * len(keys))
        tns = self.namespaces.tail(ns)
        if tns is not None:
            state.tail_ns, state.tail_first = tns, n_chunks * C // F
            n_f = len(tokens) // F
            if n_f > state.tail_first:
                state.tail_keys = tns.chunk_keys(tokens[:n_f * F])[state.tail_first:]
            state.tail_present = [False] * len(state.tail_keys)
        self.requests[request.request_id] = state
        return state

    def lookup(self, request: "Request", num_computed_tokens: int) -> int:
        """Prompt tokens beyond ``num_computed_tokens`` (vLLM's own hit) that the store can
        supply: the leading stored chunks past the hit, then tail pieces when every full chunk
        is stored, capped at ``prompt_len - 1``. Any store error or deadline means 0."""
        tokens = list(request.prompt_token_ids or [])
        C, F = self.C, self.F
        n_chunks = len(tokens) // C
        self.counters.add(local_tokens=num_computed_tokens)
        state = self._state(request, tokens)
        state.num_local = num_computed_tokens
        state.num_external = 0
        max_end = len(tokens) - 1
        nc = num_computed_tokens
        first = nc // C
        has_full = first < n_chunks and first * C < max_end
        if nc >= max_end or not (has_full or state.tail_keys):
            return 0
        t0 = time.perf_counter()
        store = self.calls.store
        n_hit, end = 0, nc
        if has_full:
            try:
                state.present = list(self.calls(store.exists, state.ns, state.keys))
            except Exception as e:  # store down or late: a miss
                self.counters.add(lookups=1, lookup_errors=1)
                log.warning("kvstore lookup failed (%s); prefilling", e)
                state.present = [False] * len(state.keys)
                return 0
            while first + n_hit < n_chunks and state.present[first + n_hit]:
                n_hit += 1
            end = (first + n_hit) * C
        # tail pieces past the last full chunk, when every full chunk past vLLM's hit is here
        r0 = max(0, nc // F - state.tail_first) if F else 0
        t_hit = 0
        if (F and (not has_full or first + n_hit == n_chunks) and r0 < len(state.tail_keys)
                and (state.tail_first + r0) * F < max_end):
            try:
                got = list(self.calls(store.exists, state.tail_ns, state.tail_keys[r0:]))
                state.tail_present[r0:] = got
            except Exception as e:  # the full chunks still count
                log.warning("kvstore tail lookup failed (%s)", e)
                self.counters.add(lookup_errors=1)
                got = []
            while t_hit < len(got) and got[t_hit]:
                t_hit += 1
            if t_hit:
                end = (state.tail_first + r0 + t_hit) * F
        ext = max(0, min(end, max_end) - nc)
        self.counters.add(lookups=1, hit_tokens=ext)
        if ext and self.pin_lease_s > 0:
            try:
                if n_hit:
                    self.calls(store.pin, state.ns, state.keys[first:first + n_hit],
                               self.pin_lease_s)
                if t_hit:
                    self.calls(store.pin, state.tail_ns, state.tail_keys[r0:r0 + t_hit],
                               self.pin_lease_s)
            except Exception as e:
                log.warning("kvstore pin failed (%s); prefilling", e)
                self.counters.add(lookup_errors=1)
                return 0
        log.debug("lookup %s: %.2f ms, %d local + %d external tokens", request.request_id,
                  (time.perf_counter() - t0) * 1e3, nc, ext)
        return ext

    def allocated(self, request: "Request", num_external_tokens: int) -> None:
        """Record that vLLM granted ``num_external_tokens`` tokens to load for ``request``."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        state.num_external = num_external_tokens
        state.load_pending = num_external_tokens > 0
        if num_external_tokens:
            self.counters.add(external_tokens=num_external_tokens)

    def build_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        """This step's loads (requests admitted with external tokens) and saves (chunks whose
        tokens are all computed once this step's forward pass is done)."""
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
            if state.load_pending:
                state.load_pending = False
                meta.loads += self._loads(step.req_id, state, block_ids)
            done = step.num_computed + scheduler_output.num_scheduled_tokens.get(step.req_id, 0)
            meta.saves += self._saves(step.req_id, state, done, block_ids)
        return meta

    def _loads(self, req_id: str, state: RequestState,
               block_ids: list[int]) -> list[ChunkTransfer]:
        """The transfers loading ``state``'s granted tokens: full chunks, then tail pieces."""
        C, out = self.C, []
        start = state.num_local
        end = start + state.num_external
        full_end = len(state.keys) * C
        if start < full_end:
            e = min(end, full_end)
            first, last = start // C, (e - 1) // C
            out.append(ChunkTransfer(req_id, state.ns, first, state.keys[first:last + 1],
                                     start, e, block_ids))
            for j in range(first, last + 1):
                state.present[j] = True
        if end > full_end and state.tail_ns is not None:
            F, tf = self.F, state.tail_first
            s0 = max(start, full_end)
            first, last = s0 // F, (end - 1) // F
            out.append(ChunkTransfer(req_id, state.tail_ns, first,
                                     state.tail_keys[first - tf:last + 1 - tf], s0, end,
                                     block_ids))
            for j in range(first, last + 1):
                state.tail_present[j - tf] = True
        return out

    def _saves(self, req_id: str, state: RequestState, done: int,
               block_ids: list[int]) -> list[ChunkTransfer]:
        """The transfers saving chunks (then tail pieces) whose tokens ``[0, done)`` are
        computed and that are neither stored nor saved yet."""
        n_full = min(done // self.C, len(state.keys))
        todo = [j for j in range(state.saved_upto, n_full) if not state.present[j]]
        state.saved_upto = max(state.saved_upto, n_full)
        out = save_runs(req_id, state.ns, state.keys, 0, todo, block_ids)
        if state.tail_keys:
            F, tf = self.F, state.tail_first
            n_t = min(done // F, tf + len(state.tail_keys))
            todo = [j for j in range(max(state.tail_saved_upto, tf), n_t)
                    if not state.tail_present[j - tf]]
            state.tail_saved_upto = max(state.tail_saved_upto, n_t)
            out += save_runs(req_id, state.tail_ns, state.tail_keys, tf, todo, block_ids)
        return out

    def finished(self, request: "Request") -> None:
        """Forget ``request``."""
        self.requests.pop(request.request_id, None)
