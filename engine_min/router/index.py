"""What one engine holds in its prefix cache, as the router knows it from the engine's KV events.

An ``EngineIndex`` is the set of block hashes an engine has cached, rebuilt from
``GET /v1/kv_events/snapshot`` and kept current by the batches of ``GET /v1/kv_events``
(the contract: ``engine_min.kv_events``). Batches must arrive in order: the index holds the
``(epoch, seq)`` of the last batch applied, and a batch of another epoch, or one whose ``seq``
is not the next, raises ``ResyncNeeded`` and leaves the index unchanged: the subscriber then
reloads the snapshot. Event types other than the three of the contract are skipped.

The router asks ``hit_blocks(prompt_hashes)``: how many of a prompt's leading blocks the engine
holds (the engine's own prefix lookup also stops at the first miss)::

    prompt blocks   h0 h1 h2 h3 h4            (block_hashes(hash_seed, prompt ids, block_size))
    index           h0 h1    h3               -> hit_blocks = 2, hit tokens = 2 * block_size

Not thread-safe: one event loop owns it.
"""
from __future__ import annotations

from collections.abc import Sequence


class ResyncNeeded(Exception):
    """The events cannot be applied on top of the index (another epoch, a gap, a malformed
    batch): reload the snapshot."""


def _hashes(values, what: str) -> list[bytes]:
    if not isinstance(values, list):
        raise ValueError(f"{what}: expected a list of hex strings, got {type(values).__name__}")
    try:
        return [bytes.fromhex(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: not a hex block hash ({exc})") from None


class EngineIndex:
    """The cached block hashes of one engine.

    Attributes:
        epoch: the engine process's event-log id (None until a snapshot is loaded).
        seq: sequence number of the last batch applied (the snapshot's, right after loading).
        block_size: tokens per block (from the snapshot; None until loaded).
        hash_seed: the engine's hash chain seed (bytes; None until loaded).
        blocks: the cached block hashes (16 bytes each).
    """

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.block_size: int | None = None
        self.hash_seed: bytes | None = None
        self.blocks: set[bytes] = set()

    @property
    def ready(self) -> bool:
        """A snapshot has been loaded (and not dropped since): the index can be queried."""
        return self.epoch is not None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def hash_key(self) -> tuple[bytes, int] | None:
        """``(hash_seed, block_size)``: engines with equal keys hash a prompt alike."""
        return (self.hash_seed, self.block_size) if self.ready else None

    def drop(self) -> None:
        """Forget everything (the engine is down or must be resynced); ``ready`` becomes False."""
        self.epoch, self.seq, self.block_size, self.hash_seed = None, 0, None, None
        self.blocks = set()

    def load_snapshot(self, snap: dict) -> None:
        """Replace the index with a ``/v1/kv_events/snapshot`` answer
        (``{"epoch", "seq", "block_size", "hash_seed", "block_hashes"}``).

        Raises:
            ValueError: a missing or mistyped field (the index is left unchanged).
        """
        try:
            epoch, seq, block_size = snap["epoch"], snap["seq"], snap["block_size"]
            seed = bytes.fromhex(snap["hash_seed"])
            blocks = set(_hashes(snap["block_hashes"], "snapshot block_hashes"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV events snapshot: {exc!r}") from None
        if not (isinstance(epoch, str) and isinstance(seq, int) and seq >= 0
                and isinstance(block_size, int) and block_size > 0):
            raise ValueError(f"malformed KV events snapshot: epoch {epoch!r}, seq {seq!r}, "
                             f"block_size {block_size!r}")
        self.epoch, self.seq, self.block_size, self.hash_seed = epoch, seq, block_size, seed
        self.blocks = blocks

    def apply(self, answer: dict) -> int:
        """Apply a ``/v1/kv_events`` answer (``{"epoch", "latest_seq", "batches": [{"seq",
        "ts", "events"}]}``) in order. Returns the number of batches applied (batches at or
        below ``seq``, already applied, are skipped).

        Raises:
            ResyncNeeded: the index is not ready, the epoch is not the index's, a batch's seq
                is not the next one, or a batch is malformed. The index is unchanged.
        """
        if not self.ready:
            raise ResyncNeeded("the index has no snapshot")
        if answer.get("epoch") != self.epoch:
            raise ResyncNeeded(f"epoch {answer.get('epoch')!r} is not {self.epoch!r}")
        blocks, seq, n = set(self.blocks), self.seq, 0
        try:
            for batch in answer["batches"]:
                if batch["seq"] <= seq:
                    continue
                if batch["seq"] != seq + 1:
                    raise ResyncNeeded(f"gap: batch {batch['seq']} after {seq}")
                for event in batch["events"]:
                    _apply_event(blocks, event)
                seq, n = batch["seq"], n + 1
        except (KeyError, TypeError, ValueError) as exc:
            raise ResyncNeeded(f"malformed KV events batch: {exc!r}") from None
        self.blocks, self.seq = blocks, seq
        return n

    def hit_blocks(self, prompt_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained hashes, under this index's
        ``hash_key``) the engine holds: the longest prefix found (0 when not ready)."""
        n = 0
        for h in prompt_hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def check_integrity(self) -> None:
        """Raise AssertionError unless the state is consistent: not ready means empty, every
        hash is 16 bytes."""
        if not self.ready:
            assert not self.blocks and self.seq == 0 and self.block_size is None, "dropped index"
            return
        assert self.seq >= 0 and self.block_size > 0, (self.seq, self.block_size)
        assert all(isinstance(h, bytes) and len(h) == 16 for h in self.blocks), "bad hash"


def _apply_event(blocks: set[bytes], event: dict) -> None:
    kind = event["type"]
    if kind == "BlockStored":
        blocks.update(_hashes(event["block_hashes"], "BlockStored block_hashes"))
    elif kind == "BlockRemoved":
        blocks.difference_update(_hashes(event["block_hashes"], "BlockRemoved block_hashes"))
    elif kind == "AllBlocksCleared":
        blocks.clear()
    # other event types (a newer engine's) say nothing about cached blocks: skipped
