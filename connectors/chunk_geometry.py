"""Token / block / chunk / tail-piece index arithmetic between an engine's paged pool and store
chunks. Pure functions of integers: no tensors, no store, no engine objects.

A *block* is the engine's allocation unit (``block_size`` tokens, one row of the pool
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``); a *chunk* is the store's
unit (``chunk_size`` tokens, a multiple of ``block_size``); a *tail piece* (``tail_size``
tokens, 0 = off) stores the tokens past a prompt's last full chunk at a finer grain. Token
``t`` is in block ``t // block_size`` of the sequence's block table, in chunk
``t // chunk_size`` and in piece ``t // tail_size``::

    tokens  0 .... 4 .... 8 .... 12 ... 16 ... 20 ... 24   (block 4, chunk 8, tail piece 4)
    blocks  |  0   |  1   |  2   |  3   |  4   |  5   |
    chunks  |      0      |      1      |      2      |
    pieces  |  0   |  1   |  2   |  3   |  4   |  5   |
"""
from __future__ import annotations

from dataclasses import dataclass

from connectors.chunk_records import LoadPlan


@dataclass(frozen=True)
class ChunkGeometry:
    """Index arithmetic for one (block_size, chunk_size, tail_size) triple.

    Raises:
        ValueError: a non-positive block or chunk size, a tail size that is negative, not
            smaller than ``chunk_size``, does not divide it or is not a multiple of
            ``block_size``, or ``chunk_size`` not a multiple of ``block_size``.
    """

    block_size: int
    chunk_size: int
    tail_size: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        F = self.tail_size
        if not isinstance(F, int) or isinstance(F, bool) or F < 0 or (F and (
                F >= self.chunk_size or self.chunk_size % F)):
            raise ValueError(f"tail_chunk_size must be 0 (off) or divide chunk_size="
                             f"{self.chunk_size} and be smaller, got {F!r}")
        if F % self.block_size:
            raise ValueError(f"tail_chunk_size={F} must be a multiple of the "
                             f"engine's block_size={self.block_size}")
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size={self.chunk_size} must be a multiple of the engine's "
                             f"block_size={self.block_size}")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def num_full_chunks(self, num_tokens: int) -> int:
        """Full chunks in ``num_tokens`` tokens (partial trailing chunks do not count)."""
        return max(0, num_tokens) // self.chunk_size

    def floor_to_chunk(self, num_tokens: int) -> int:
        """``num_tokens`` rounded down to a chunk boundary."""
        return self.num_full_chunks(num_tokens) * self.chunk_size

    def floor_to_piece(self, num_tokens: int) -> int:
        """``num_tokens`` rounded down to a tail-piece boundary (0 when tail pieces are off)."""
        return num_tokens // self.tail_size * self.tail_size if self.tail_size else 0

    def num_external_tokens(self, num_tokens: int, num_local: int, num_hit: int) -> int:
        """Tokens loadable from the store beyond the engine's own ``num_local`` computed tokens.

        Args:
            num_tokens: the request's tokens (prompt, plus output after a preemption).
            num_local: tokens the engine already has (prefix-cache hit; never overwritten).
            num_hit: leading tokens the store holds (a chunk or tail-piece boundary).

        Returns:
            ``min(num_hit, num_tokens - 1) - num_local`` clamped at 0 (the last token is always
            computed, so the engine has logits to sample from); 0 when ``num_local`` is not
            block aligned (then the first written block would hold computed slots).
        """
        if num_local % self.block_size:
            return 0
        return max(0, min(num_hit, num_tokens - 1) - num_local)

    def tail_range(self, num_tokens: int, start: int) -> range:
        """Tail pieces worth looking up once the leading stored prefix ends at token ``start``
        (the end of the full-chunk hit, or the engine's own hit): the pieces from the one
        holding ``start`` to the end of its chunk or the last whole piece of the request.
        Pieces are stored only past a prompt's last full chunk, so none past the first
        missing chunk can exist. Empty when tail pieces are off or no piece would add a
        loadable token."""
        F = self.tail_size
        if not F:
            return range(0)
        lo = start // F
        hi = min(self.floor_to_chunk(start) + self.chunk_size, num_tokens) // F
        return range(lo, hi) if lo < hi and start < num_tokens - 1 else range(0)

    def load_plan(self, num_local: int, num_external: int) -> LoadPlan | None:
        """Chunks spanned and blocks written to load tokens ``[num_local, num_local + num_external)``.

        Returns:
            None when ``num_external == 0``.

        Raises:
            ValueError: ``num_local`` not block aligned or a negative count.
        """
        if num_external < 0 or num_local < 0:
            raise ValueError(f"negative token counts: num_local={num_local}, "
                             f"num_external={num_external}")
        if num_external == 0:
            return None
        if num_local % self.block_size:
            raise ValueError(f"num_local={num_local} is not a multiple of block_size="
                             f"{self.block_size}: the load would overwrite computed slots")
        end = num_local + num_external
        return LoadPlan(num_local, end, num_local // self.chunk_size,
                        -(-end // self.chunk_size), num_local // self.block_size,
                        -(-end // self.block_size))

    def landed_end(self, plan: LoadPlan, num_ok_chunks: int) -> int:
        """One past the last token really loaded when only the first ``num_ok_chunks`` of
        ``plan``'s chunks arrived (``plan.start`` when none of the needed tokens did)."""
        got = (plan.first_chunk + num_ok_chunks) * self.chunk_size
        return max(plan.start, min(plan.end, got))

    def chunks_to_save(self, num_saved: int, num_kv_tokens: int) -> range:
        """Indices of the full chunks with KV in ``[0, num_kv_tokens)`` not saved yet (chunks
        below ``num_saved // chunk_size`` are done)."""
        return range(self.num_full_chunks(num_saved), self.num_full_chunks(num_kv_tokens))

    def chunk_blocks(self, block_table: list[int], chunk: int) -> list[int]:
        """Block ids holding chunk ``chunk`` of a sequence (``blocks_per_chunk`` of them).

        Raises:
            ValueError: the block table does not cover the chunk.
        """
        return self.unit_blocks(block_table, chunk * self.chunk_size, self.chunk_size)

    def unit_blocks(self, block_table: list[int], start: int, size: int) -> list[int]:
        """Block ids holding tokens ``[start, start + size)`` (a chunk or a tail piece; both
        block aligned).

        Raises:
            ValueError: the block table does not cover the tokens.
        """
        a, b = start // self.block_size, (start + size) // self.block_size
        if b > len(block_table):
            what = "chunk" if size == self.chunk_size else "tail piece"
            raise ValueError(f"{what} {start // size} needs blocks [{a}, {b}) but the block "
                             f"table has {len(block_table)}")
        return list(block_table[a:b])
