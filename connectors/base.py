"""Engine-agnostic KV connector contract, in two halves (as vLLM's KV connector V1).

The **scheduler side** decides, before blocks are allocated, how many prompt tokens beyond
the engine's own prefix cache can be loaded from the store, and records what to load once the
blocks exist. The **worker side** moves KV between the engine's paged pool and the store.

Token ranges of one request at admission (``C`` = computed by the engine's prefix cache,
``E`` = external tokens loadable from the store, ``P`` = prompt length)::

    0 ........ C ............ C+E ............ P
    | engine   | loaded from  | prefilled now  |
    | cache    | the store    | (>= 1 token)   |

``C+E`` never reaches ``P``: the last prompt token is always computed, so the engine has
logits to sample from. Loads never write slots below ``C`` (already-computed slots are never
overwritten).

Method names follow vLLM's (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished``, ``register_kv_caches``, ``start_load_kv``,
``wait_for_save``) where they mean the same thing.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class LoadSpec:
    """Load store KV for ``token_ids[start:end]`` into the request's blocks.

    Attributes:
        request_id: engine request id.
        token_ids: the request's prompt token ids (the prefix the keys are computed from).
        block_ids: the request's block table (block ``i`` holds tokens
            ``[i*block_size, (i+1)*block_size)``).
        start: first token to load (= tokens already computed by the engine).
        end: one past the last token to load.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SaveSpec:
    """Save the KV of full chunks covering ``token_ids[start:end]`` from the given blocks.

    ``start`` and ``end`` are multiples of the chunk size; ``token_ids[:end]`` all have KV in
    the pool when the save runs.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    start: int
    end: int


@dataclass
class ConnectorMetadata:
    """What the worker side must do in one engine step (built by the scheduler side)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(frozen=True)
class LoadResult:
    """Outcome of one load: ``num_loaded_tokens`` counted from ``LoadSpec.start``; ``ok``
    False when the store failed or missed its deadline (the engine then recomputes)."""

    request_id: str
    num_loaded_tokens: int
    ok: bool


class KVConnectorBase(ABC):
    """A connector between one engine's paged KV pool and a KV store.

    Scheduler-side methods run on the engine's scheduling thread; worker-side methods run
    where the KV pool lives. In engine_min both are one thread, but implementations must not
    rely on it beyond the order below. Per step the engine calls::

        get_num_new_matched_tokens (0..n times per waiting request; side-effect free)
        update_state_after_alloc   (once, after the request's blocks are allocated)
        build_connector_meta       (once per step)
        start_load_kv / wait_for_load   (before the forward pass)
        start_save_kv              (after the forward pass; never blocks on the store)
        request_finished           (when a request ends, before its blocks are freed)
    """

    # ---- scheduler side -------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request_id: str, token_ids: Sequence[int],
                                   num_computed_tokens: int) -> int:
        """Number of prompt tokens beyond ``num_computed_tokens`` loadable from the store.

        Side-effect free (no counters, no pins, no recency); may be called repeatedly while a
        request waits. Bounded by a deadline: on timeout or error returns 0. Never makes
        ``num_computed_tokens + result`` reach ``len(token_ids)``.
        """

    @abstractmethod
    def update_state_after_alloc(self, request_id: str, token_ids: Sequence[int],
                                 block_ids: Sequence[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """Record that blocks now exist for ``num_computed_tokens + num_external_tokens``
        tokens; the load of the external ones is scheduled for this step. Counts the
        request's queried and hit tokens once (not per ``get_num_new_matched_tokens``)."""

    @abstractmethod
    def request_prefilled(self, request_id: str, token_ids: Sequence[int],
                          block_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The request's KV now covers ``token_ids[:num_computed_tokens]``: schedule saves of
        the full chunks not saved yet."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """Take the loads and saves scheduled since the last call."""

    @abstractmethod
    def request_finished(self, request_id: str, token_ids: Sequence[int],
                         block_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The request ended (finished, aborted or preempted). ``token_ids`` is prompt +
        output; the KV of ``token_ids[:num_computed_tokens]`` is in ``block_ids``. Saves of
        generated full chunks are gathered here, before the engine frees the blocks."""

    # ---- worker side ----------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, block_size: int) -> None:
        """The engine's pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Begin the loads in ``metadata``."""

    @abstractmethod
    def wait_for_load(self) -> list[LoadResult]:
        """Wait (up to the deadline) for the loads started; scatter what arrived into the
        pool. A failed or late load reports ``ok=False`` and how many tokens did land."""

    @abstractmethod
    def start_save_kv(self, metadata: ConnectorMetadata) -> None:
        """Gather the chunks to save from the pool and queue them for the store. Returns
        without waiting for the store; a full queue drops saves and counts them."""

    @abstractmethod
    def wait_for_save(self, timeout_s: float | None = None) -> None:
        """Block until queued saves reach the store (for tests and shutdown)."""

    @abstractmethod
    def get_stats(self) -> dict:
        """Counters: requested and hit tokens (by tier), loaded/saved bytes, load/save
        latency, fallbacks, dropped saves."""

    def close(self) -> None:
        """Flush saves and release the store (idempotent)."""
