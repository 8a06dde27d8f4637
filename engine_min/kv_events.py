"""KV cache events of the engine's prefix cache, and the numbered log a router reads them from.

Names and fields follow vLLM's KV events (``vllm.distributed.kv_events``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared`` in a ``KVEventBatch``), so a router written for vLLM's
events reads ours. Block hashes are the engine's own chained prefix-cache hashes
(``engine_min.block_hash``), 16 bytes each, written as hex strings on the wire: a subscriber
computes the same hashes for a prompt with ``block_hashes(hash_seed, token_ids, block_size)``.

Order of production (one thread, the engine's)::

    BlockManager.cache_blocks  -> BlockStored   (full blocks whose KV is now computed)
    BlockManager._pop_free     -> BlockRemoved  (a cached block evicted for new data)
    BlockManager.reset_prefix_cache -> AllBlocksCleared

A preempted or finished request's blocks stay cached (no event) until evicted. The engine's
loop drains the block manager's events after each step into a ``KVEventLog`` as one numbered
batch; subscribers read batches after a sequence number and resync from ``snapshot()`` when
they fall behind the retained window or the log's epoch (one per process) changes.
"""
from __future__ import annotations

import itertools
from array import array
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

#: where the engine's blocks live (vLLM's ``medium``)
MEDIUM = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """A run of consecutive full blocks newly cached.

    Attributes:
        block_hashes: chained hashes of the blocks, in sequence order (16 bytes each).
        parent_block_hash: hash of the block before the first; None for a sequence's first block.
        token_ids: the blocks' tokens (``len(block_hashes) * block_size`` ids; an
            ``array("I")``, 4 bytes a token, as a log may retain many).
        block_size: tokens per block.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: array
    block_size: int

    def to_json(self) -> dict:
        return {"type": "BlockStored", "block_hashes": [h.hex() for h in self.block_hashes],
                "parent_block_hash": (self.parent_block_hash.hex()
                                      if self.parent_block_hash is not None else None),
                "token_ids": self.token_ids.tolist(), "block_size": self.block_size,
                "lora_id": None, "medium": MEDIUM}


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks evicted (their hashes no longer name KV in the pool)."""

    block_hashes: tuple[bytes, ...]

    def to_json(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in self.block_hashes],
                "medium": MEDIUM}


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    def to_json(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def apply_event(cached: set[bytes], event: KVEvent) -> None:
    """Apply one event to a set of cached block hashes (in place).

    Raises:
        TypeError: not an event.
    """
    if isinstance(event, BlockStored):
        cached.update(event.block_hashes)
    elif isinstance(event, BlockRemoved):
        cached.difference_update(event.block_hashes)
    elif isinstance(event, AllBlocksCleared):
        cached.clear()
    else:
        raise TypeError(f"not a KV event: {event!r}")


@dataclass(frozen=True)
class EventBatch:
    """Events of one engine step (vLLM's ``KVEventBatch`` plus its sequence number).

    Attributes:
        seq: 1, 2, 3, ... per log.
        ts: wall-clock time of publication (Unix seconds).
        events: in production order.
    """

    seq: int
    ts: float
    events: tuple[KVEvent, ...]

    def to_json(self) -> dict:
        return {"seq": self.seq, "ts": self.ts, "events": [e.to_json() for e in self.events]}


@dataclass
class Snapshot:
    """The cached block hashes exactly after batch ``seq`` of log ``epoch``."""

    epoch: str
    seq: int
    block_hashes: list[bytes] = field(default_factory=list)


class EventGap(Exception):
    """A reader asked for batches the log no longer holds (or of another epoch): resync."""


class KVEventLog:
    """Numbered, bounded log of event batches plus the set of cached hashes they produce.

    Thread-safe: the engine thread publishes, server threads read. The set (``snapshot``) is
    updated under the same lock as the batches, so a snapshot at ``seq`` plus the batches after
    it equals the engine's set of cached hashes.

    Args:
        max_batches: batches retained (older ones are dropped; a reader behind them gets
            ``EventGap``). >= 1.
        on_publish: called (on the publishing thread, lock released) after each batch, e.g.
            to wake waiting readers on an event loop.

    Raises:
        ValueError: max_batches < 1.
    """

    def __init__(self, max_batches: int = 4096, on_publish=None):
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self.epoch = secrets.token_hex(8)
        self._batches: deque[EventBatch] = deque(maxlen=max_batches)
        self._cached: set[bytes] = set()
        self._seq = 0
        self._lock = threading.Lock()
        self.on_publish = on_publish

    @property
    def latest_seq(self) -> int:
        """Sequence number of the last published batch (0 before any)."""
        return self._seq

    def publish(self, events: list[KVEvent]) -> EventBatch | None:
        """Append the events as one batch (nothing when empty). Returns the batch or None."""
        if not events:
            return None
        with self._lock:
            self._seq += 1
            batch = EventBatch(self._seq, time.time(), tuple(events))
            for e in batch.events:
                apply_event(self._cached, e)
            self._batches.append(batch)
        if self.on_publish is not None:
            self.on_publish()
        return batch

    def since(self, after: int, epoch: str | None = None) -> list[EventBatch]:
        """Retained batches with ``seq > after`` (empty when the reader is up to date).

        Raises:
            EventGap: ``epoch`` is given and is not this log's; or batches after ``after`` were
                dropped (``after`` older than the window), or ``after`` is ahead of the log.
        """
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                raise EventGap(f"epoch {epoch!r} is not the log's ({self.epoch})")
            if after > self._seq or after < 0:
                raise EventGap(f"seq {after} is outside 0..{self._seq}")
            first = self._batches[0].seq if self._batches else self._seq + 1
            if after < first - 1:
                raise EventGap(f"batches {after + 1}..{first - 1} are no longer retained")
            return list(itertools.islice(self._batches, after - first + 1, None))

    def snapshot(self) -> Snapshot:
        """The set of cached block hashes after the latest batch (sorted, for stable output)."""
        with self._lock:
            return Snapshot(self.epoch, self._seq, sorted(self._cached))
