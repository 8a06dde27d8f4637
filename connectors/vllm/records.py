"""Records the vLLM connector passes between its sides: the transfers of one step (scheduler
side -> worker side), a request's scheduler-side state, a scheduled request of one step.
Importable without vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.keys import ChunkKey, Namespace


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
    """

    request_id: str
    ns: Namespace
    first_chunk: int
    keys: list[ChunkKey]
    start: int
    end: int
    block_ids: list[int]
    parent: ChunkKey | None = None


@dataclass
class RequestState:
    """Scheduler-side bookkeeping of one request.

    Attributes:
        request: vLLM's ``Request``.
        ns, keys, present: the full chunks' namespace, keys, and which are stored (or loaded).
        num_local: tokens computed by vLLM's own prefix cache at admission.
        num_external: tokens to load from the store (granted by vLLM).
        load_pending: the load is not in a step's metadata yet.
        saved_upto: chunks ``[0, saved_upto)`` are stored or queued for saving.
        block_ids: the request's block table as the scheduler last saw it.
        tail_ns, tail_first, tail_keys, tail_present, tail_saved_upto: the same for tail
            pieces (``tail_ns``'s chunk size), pieces ``tail_first, ...`` past the full chunks.
    """

    request: Any
    ns: Namespace
    keys: list[ChunkKey]
    present: list[bool]
    num_local: int = 0
    num_external: int = 0
    load_pending: bool = False
    saved_upto: int = 0
    block_ids: list[int] = field(default_factory=list)
    tail_ns: Namespace | None = None
    tail_first: int = 0
    tail_keys: list[ChunkKey] = field(default_factory=list)
    tail_present: list[bool] = field(default_factory=list)
    tail_saved_upto: int = 0


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


def save_runs(req_id: str, ns: Namespace, keys: list[ChunkKey], key0: int, todo: list[int],
              block_ids: list[int]) -> list[ChunkTransfer]:
    """One save transfer per run of consecutive chunk indices in ``todo`` (``keys[0]`` is
    chunk ``key0`` of ``ns``'s chunk size); a run after chunk ``key0`` names the chunk before
    it as its parent."""
    C = ns.layout.chunk_size
    out: list[ChunkTransfer] = []
    run: list[int] = []
    for j in todo + [None]:
        if run and (j is None or j != run[-1] + 1):
            parent = keys[run[0] - 1 - key0] if run[0] > key0 else None
            out.append(ChunkTransfer(req_id, ns, run[0], [keys[k - key0] for k in run],
                                     run[0] * C, (run[-1] + 1) * C, block_ids, parent))
            run = []
        if j is not None:
            run.append(j)
    return out
