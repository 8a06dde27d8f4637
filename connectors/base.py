"""KV connector contract between an engine's paged KV pool and a KV store, in two halves (as
vLLM's KV connector V1), shaped to engine_min's seams (``engine_min/scheduler.py``,
``engine_min/model_runner.py``).

The **scheduler side** decides, before blocks are allocated, how many tokens beyond the
engine's own prefix cache can be loaded from the store, and records what to load once the
blocks exist. The **worker side** moves KV between the engine's paged pool and the store.

Token ranges of one request at admission (``C`` = computed by the engine's prefix cache,
``E`` = external tokens loadable from the store, ``N`` = the request's tokens)::

    0 ........ C ............ C+E ............ N
    | engine   | loaded from  | prefilled now  |
    | cache    | the store    | (>= 1 token)   |

``C+E`` never reaches ``N``: the last token is always computed, so the engine has logits to
sample from. Loads never write slots below ``C`` (already-computed slots are never
overwritten). A load that fails or misses its deadline moves ``seq.num_computed_tokens`` back
to the end of what really landed; the engine then prefills the rest (recompute).

Per engine step the engine calls, in this order::

    get_num_new_matched_tokens(seq, C)      0..n times per waiting request; side-effect free
    update_state_after_alloc(seq, blocks, E) once per admission, after blocks are allocated
    start_load_kv(sched_out, kv_cache)      before the forward pass (also before the step's
    wait_for_load()                         inputs are built, so a failed load can shrink C+E)
    save(sched_out, kv_cache)               after the forward pass; never waits on the store
    request_finished(seq, blocks)           when a request ends, before its blocks are freed

A connector whose ``layerwise_load`` is true loads layer by layer beside the forward pass; the
engine then calls, in place of the ``wait_for_load()`` before it::

    start_load_kv(sched_out, kv_cache)      before the forward pass (inputs built as if every
                                            scheduled load lands)
    wait_for_layer_load(i)                  in layer i, before it writes or reads its KV
    wait_for_load()                         after the forward pass, also when it raised: the
                                            loads land as above; the engine runs again the
                                            tokens of every request whose load fell short
                                            (their forward read KV that never landed)

Calling ``wait_for_load()`` before the forward pass is always allowed (a whole load).

Method names follow vLLM's (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``request_finished``, ``register_kv_caches``, ``start_load_kv``, ``wait_for_save``) where they
mean the same thing; ``wait_for_load`` and ``save`` are engine_min's (vLLM splits them per
layer: ``wait_for_layer_load``, ``save_kv_layer``).

Objects the engine passes (duck-typed; engine_min's ``Sequence`` and ``SchedulerOutput``):

* ``seq``: ``request_id``, ``token_ids`` (prompt + output), ``num_tokens``,
  ``num_prompt_tokens``, ``num_computed_tokens``, ``num_cached_tokens``, ``block_table``.
* ``sched_out``: ``scheduled`` (items with ``seq`` and ``num_new_tokens``: tokens
  ``[seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens)`` run this step).
* ``kv_cache``: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LoadResult:
    """Outcome of one request's load in a step.

    Attributes:
        request_id: engine request id.
        num_requested_tokens: tokens scheduled to load (``E``).
        num_loaded_tokens: tokens that landed, counted from ``C`` (``<= E``).
        ok: False when the store failed, missed chunks or missed its deadline (the engine
            recomputes ``E - num_loaded_tokens`` tokens).
    """

    request_id: str
    num_requested_tokens: int
    num_loaded_tokens: int
    ok: bool


class KVConnectorBase(ABC):
    """A connector between one engine's paged KV pool and a KV store.

    Scheduler-side methods run on the engine's scheduling thread, worker-side methods where
    the KV pool lives; in engine_min both are the engine thread. Implementations must not
    block the engine on the store beyond a deadline: lookups and loads give up (and the engine
    recomputes), saves are queued for a background writer.
    """

    #: loads run layer by layer beside the forward pass (module docstring: the engine calls
    #: ``wait_for_layer_load`` per layer and ``wait_for_load`` after the forward pass)
    layerwise_load: bool = False

    # ---- scheduler side -------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (the engine's prefix-cache hit) loadable now.

        Side-effect free on counters (may be called on every step while ``seq`` waits).
        Bounded by a deadline: on timeout or error returns 0 (counted once as a fallback).

        Returns:
            ``(num_external_tokens, load_async)``: ``num_computed_tokens + num_external_tokens
            < seq.num_tokens``; ``load_async`` is always False here (the load finishes within
            the step that admits ``seq``).
        """

    @abstractmethod
    def update_state_after_alloc(self, seq: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """``seq`` was admitted: its block table ``block_ids`` covers
        ``seq.num_computed_tokens`` (= local hit + ``num_external_tokens``) and the tokens it
        prefills this step. Schedules the load of the external tokens for this step and counts
        the request's queried and hit tokens (once per request, not per admission)."""

    @abstractmethod
    def request_finished(self, seq: Any, block_ids: list[int]) -> None:
        """``seq`` ended (finished or aborted); its KV of ``seq.token_ids[:seq.num_computed_tokens]``
        is still in ``block_ids``. Queues the saves of its full chunks not saved yet (generated
        tokens included, when so configured) and drops its state."""

    # ---- worker side ----------------------------------------------------------------------
    def register_model(self, identity: dict[str, str]) -> None:
        """What the engine loaded that changes the KV of the same token ids (its
        ``kv_identity``: ``model_id``, ``revision``, ``weights_fingerprint``, ``compute_dtype``,
        ``rope``, ...; strings), for the store namespace. Called by the engine before
        ``register_kv_caches``; the default ignores it (a connector whose keys do not name
        the model)."""

    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """Bind to the engine's pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
        head_dim]`` (fixes the store namespace's KV layout).

        Raises:
            ValueError: the chunk size is not a multiple of ``block_size``.
        """

    @abstractmethod
    def start_load_kv(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        """Begin the loads scheduled for the sequences in ``sched_out``."""

    @abstractmethod
    def wait_for_load(self) -> list[LoadResult]:
        """Wait (up to the deadline) for the loads started; scatter what arrived into the pool;
        move back ``num_computed_tokens`` (and extend the step's ``num_new_tokens``) of
        sequences whose load fell short."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer-wise loads: block (up to the step's deadline) until this step's loads have
        written layer ``layer`` of the pool; on CUDA the engine's current stream is ordered
        after those copies. Called by the forward pass before layer ``layer`` writes or reads
        its KV. Never raises for a store fault (a stopped load lands nothing; ``wait_for_load``
        reports it). The default returns at once (nothing loads layer by layer)."""

    @abstractmethod
    def save(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        """After the forward pass: gather the full chunks now computed and not saved yet, and
        queue them for the store. Never waits for the store; a full queue drops saves (counted)."""

    @abstractmethod
    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        """Block until queued saves reached the store (tests, shutdown). False on timeout."""

    @abstractmethod
    def get_stats(self) -> dict:
        """Cumulative, JSON-able counters merged into the engine's ``stats()``; at least
        ``external_prefix_cache_queries`` and ``external_prefix_cache_hits`` (tokens)."""

    def close(self) -> None:
        """Flush saves and release the store (idempotent)."""
