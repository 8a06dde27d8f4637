"""Records the vLLM connector passes between its sides: the transfers of one step (scheduler
side -> worker side), a request's scheduler-side state, a scheduled request of one step.
Importable without vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.keys import ChunkKey, Namespace

from connectors.chunk_plan import RequestChunks
from connectors.chunk_records import LoadPlan, SaveRange, Superseded


@dataclass
class ChunkTransfer:
    """Move chunks of one request between the store and vLLM's paged cache.

    Attributes:
        request_id: vLLM request id.
        ns: the chunk-key namespace (carries the cache salt; its layout's chunk size is this
            transfer's chunk size ``C``).
        first_chunk: index of the first chunk in ``keys`` (chunk ``i`` = tokens
            ``[i*C, (i+1)*C)``).
        keys: keys of chunks ``first_chunk, first_chunk+1, ...``.
        start, end: tokens to write (load) or read (save); ``[start, end)`` lies inside the
            chunks of ``keys``.
        block_ids: the request's block table (block ``j`` holds tokens
            ``[j*block_size, (j+1)*block_size)``).
        parent: (saves) key of the chunk before ``keys[0]`` when a save continues chunks
            stored earlier, None when ``keys[0]`` starts its chain (the store keeps prefixes
            reachable only with true parents).
        supersedes: (saves of full chunks) the tail pieces these chunks cover, demoted by
            the writer once the chunks are stored (``connectors.chunk_records.Superseded``),
            or None.
    """

    request_id: str
    ns: Namespace
    first_chunk: int
    keys: list[ChunkKey]
    start: int
    end: int
    block_ids: list[int]
    parent: ChunkKey | None = None
    supersedes: Superseded | None = None


@dataclass
class RequestState:
    """Scheduler-side bookkeeping of one request.

    Attributes:
        request: vLLM's ``Request``.
        tokens: its prompt token ids (what is looked up; saves read ``request.all_token_ids``,
            prompt and generated tokens).
        chunks: its chunk state in the connector core (key chains, the last lookup's hit,
            how far chunks and tail pieces are saved or known stored).
        num_local: tokens computed by vLLM's own prefix cache at admission.
        load: what to load (granted by vLLM) until a step's metadata carries it, else None.
        block_ids: the request's block table as the scheduler last saw it.
        pinned: ``(namespace, keys)`` of every pin its lookups took, dropped when it ends.
    """

    request: Any
    tokens: list[int]
    chunks: RequestChunks
    num_local: int = 0
    load: LoadPlan | None = None
    block_ids: list[int] = field(default_factory=list)
    pinned: list[tuple[Namespace, list[ChunkKey]]] = field(default_factory=list)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a step's ``SchedulerOutput``, new or cached alike.

    Attributes:
        req_id: vLLM request id.
        num_computed: tokens computed before this step.
        new_blocks: blocks added to its table this step (a new or resumed request: its whole
            table), or None.
    """

    req_id: str
    num_computed: int
    new_blocks: list[int] | None


def load_transfers(req_id: str, plan: LoadPlan, block_ids: list[int]) -> list[ChunkTransfer]:
    """The transfers of one load plan: its full chunks, then its tail pieces (one transfer
    per namespace), writing tokens ``[plan.start, plan.end)``."""
    out = []
    for tail in (False, True):
        ps = [p for p in plan.pieces if p.tail == tail]
        if ps:
            out.append(ChunkTransfer(req_id, ps[0].ns, ps[0].start // ps[0].size,
                                     [p.key for p in ps], max(plan.start, ps[0].start),
                                     min(plan.end, ps[-1].end), block_ids))
    return out


def save_transfer(req_id: str, rng: SaveRange, block_ids: list[int]) -> ChunkTransfer:
    """The transfer saving ``rng`` (chunks or tail pieces of one chain); it names the unit
    before its first as the parent when the save continues units saved earlier, and the tail
    pieces its chunks supersede."""
    u = rng.unit
    return ChunkTransfer(req_id, rng.ns, rng.first, list(rng.keys), rng.first * u,
                         (rng.first + len(rng.keys)) * u, block_ids, rng.parent,
                         rng.supersedes)
