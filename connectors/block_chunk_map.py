"""Token / block / chunk index arithmetic between an engine's paged pool and store chunks.

A *block* is the engine's allocation unit (``block_size`` tokens, one row of the pool
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``); a *chunk* is the store's
unit (``chunk_size`` tokens, a multiple of ``block_size``). Token ``t`` is in block
``t // block_size`` of the sequence's block table and in chunk ``t // chunk_size``::

    tokens  0 .... 4 .... 8 .... 12 ... 16 ... 20 ... 24        (block_size 4, chunk_size 8)
    blocks  |  0   |  1   |  2   |  3   |  4   |  5   |
    chunks  |      0      |      1      |      2      |

Pure functions of integers: no tensors, no store.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPlan:
    """What to load for one request at admission.

    Attributes:
        start: first token to write (= tokens already computed by the engine; block aligned).
        end: one past the last token counted as loaded (``start <= end < num_tokens``).
        first_chunk, last_chunk: store chunks to fetch, ``[first_chunk, last_chunk)``.
        first_block, last_block: indices into the block table written, ``[first_block, last_block)``
            (``last_block = ceil(end / block_size)``; a trailing partial block is written whole,
            its slots past ``end`` are recomputed by the forward pass before being read).
    """

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    first_block: int
    last_block: int

    @property
    def num_tokens(self) -> int:
        """Tokens counted as loaded (``end - start``)."""
        return self.end - self.start

    @property
    def num_chunks(self) -> int:
        return self.last_chunk - self.first_chunk


@dataclass(frozen=True)
class BlockChunkMap:
    """Index arithmetic for one (block_size, chunk_size) pair.

    Raises:
        ValueError: a non-positive size, or ``chunk_size`` not a multiple of ``block_size``.
    """

    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        for name in ("block_size", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
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

    def num_external_tokens(self, num_tokens: int, num_local: int, num_hit: int) -> int:
        """Tokens loadable from the store beyond the engine's own ``num_local`` computed tokens.

        Args:
            num_tokens: the request's tokens (prompt, plus output after a preemption).
            num_local: tokens the engine already has (prefix-cache hit; never overwritten).
            num_hit: leading tokens the store holds (a multiple of chunk_size).

        Returns:
            ``min(num_hit, num_tokens - 1) - num_local`` clamped at 0 (the last token is always
            computed, so the engine has logits to sample from); 0 when ``num_local`` is not
            block aligned (then the first written block would hold computed slots).
        """
        if num_local % self.block_size:
            return 0
        return max(0, min(num_hit, num_tokens - 1) - num_local)

    def load_plan(self, num_local: int, num_external: int) -> LoadPlan | None:
        """Chunks to fetch and blocks to write to load tokens ``[num_local, num_local + num_external)``.

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
        a = chunk * self.blocks_per_chunk
        b = a + self.blocks_per_chunk
        if b > len(block_table):
            raise ValueError(f"chunk {chunk} needs blocks [{a}, {b}) but the block table has "
                             f"{len(block_table)}")
        return list(block_table[a:b])
