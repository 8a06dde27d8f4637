"""KV block pool with engine prefix caching (ref-counted blocks, chained block hashes, LRU).

Block 0 is the null block (padding); blocks ``1..num_blocks-1`` are allocatable. A block is
in exactly one of two states::

    used: ref_count >= 1, in some sequences' block tables
    free: ref_count == 0, in ``free`` (an LRU queue; front = evicted first)

A full block whose KV is computed gets its chained hash ``H(prev_hash || its tokens)``
(``engine_min.block_hash.block_hashes``) and enters ``hash_to_block``. A freed
hashed block keeps its hash and can be revived by a later prefix hit until it is evicted
(popped from the front of ``free`` for new data). Unhashed freed blocks go to the front.

Queries (``lookup``, ``can_allocate``) change nothing; ``allocate`` commits.

With ``enable_kv_events`` the manager records what enters and leaves ``hash_to_block`` as KV
events (``engine_min.kv_events``), drained by ``take_events``: replaying them rebuilds the set
of cached hashes exactly.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

from engine_min.block_hash import block_hashes
from engine_min.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine_min.sequence import Sequence


class BlockManager:
    """Owner of the block ids of the KV pool (the tensor itself lives in the engine).

    Args:
        num_blocks: blocks in the pool including the null block 0 (>= 2).
        block_size: tokens per block.
        enable_prefix_caching: hash full blocks and reuse them across sequences.
        hash_seed: seed of the hash chain (identifies model + dtype; bytes).
        enable_kv_events: record BlockStored / BlockRemoved / AllBlocksCleared events for
            ``take_events`` (off: nothing is recorded).

    Attributes:
        num_query_tokens: tokens looked up at first admissions (prefix-cache queries; each
            request once, with its prompt).
        num_hit_tokens: of those, tokens taken from the cache instead of computed.
        num_preempted_query_tokens / num_preempted_hit_tokens: the same at re-admissions after
            a preemption (prompt + generated tokens; hits there are mostly the request's own
            freed blocks), kept apart as vLLM's ``PrefixCacheStats.preempted_*``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: bytes = b"engine_min", enable_kv_events: bool = False):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (null + 1), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.hash_seed = enable_prefix_caching, hash_seed
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_preempted_query_tokens = 0
        self.num_preempted_hit_tokens = 0
        self.enable_kv_events = enable_kv_events
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some sequence (the null block not counted)."""
        return self.num_blocks - 1 - len(self.free)

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of seq's full blocks (extends ``seq.block_hashes`` incrementally)."""
        n_full = seq.num_tokens // self.block_size
        have = len(seq.block_hashes)
        if have < n_full:
            seed = seq.block_hashes[-1] if have else self.hash_seed
            toks = seq.token_ids[have * self.block_size:n_full * self.block_size]
            seq.block_hashes.extend(block_hashes(seed, toks, self.block_size))
        return seq.block_hashes[:n_full]

    def lookup(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq's full blocks (changes nothing)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in self._hashes(seq):
            b = self.hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _plan(self, seq: Sequence, hits: list[int], num_tokens: int) -> tuple[list[int], int]:
        """(shared hit blocks, fresh blocks needed) to cover ``num_tokens`` of seq.

        A hit covering the whole sequence is not shared in its last block: that block is
        copied into a fresh one (copy-on-write) so that its last token can be recomputed.
        """
        shared = hits[:-1] if hits and len(hits) * self.block_size >= seq.num_tokens else hits
        need = -(-num_tokens // self.block_size)
        have = len(seq.block_table) if seq.block_table else len(shared)
        return shared, max(0, need - have)

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Whether seq's table can grow to cover ``num_tokens`` tokens (``hits`` only at admission)."""
        shared, fresh = self._plan(seq, list(hits), num_tokens)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)  # hits waiting in ``free``
        return fresh + revived <= len(self.free)

    # ------------------------------------------------------------------ commits
    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> list[tuple[int, int]]:
        """Grow seq's block table to cover ``num_tokens`` tokens (call ``can_allocate`` first).

        At admission (empty table) the ``hits`` from ``lookup`` are shared (ref_count + 1) and
        ``seq.num_computed_tokens`` is set to the hit length (the last token is left to compute
        when every token hit).

        Returns:
            ``[(src_block, dst_block)]`` KV copies to run before the next forward (copy-on-write
            of a fully hit last block); usually empty.

        Raises:
            RuntimeError: not enough free blocks (``can_allocate`` was not checked).
        """
        hits = list(hits)
        copies: list[tuple[int, int]] = []
        if not seq.block_table and hits:
            shared, _ = self._plan(seq, hits, num_tokens)
            for b in hits:
                self._take(b)  # hold every hit (the COW source too) while popping fresh blocks
            seq.block_table = list(shared)
            if len(shared) < len(hits):
                dst = self._pop_free()
                copies.append((hits[-1], dst))
                seq.block_table.append(dst)
                self._release(hits[-1])
            seq.num_computed_tokens = min(len(hits) * self.block_size, seq.num_tokens - 1)
        need = -(-num_tokens // self.block_size)
        while len(seq.block_table) < need:
            seq.block_table.append(self._pop_free())
        return copies

    def record_query(self, num_tokens: int, num_hit_tokens: int, preempted: bool) -> None:
        """Count one admission's lookup: ``num_tokens`` queried, ``num_hit_tokens`` of them
        taken from the cache; into the ``num_preempted_*`` counters when ``preempted`` (a
        re-admission). Nothing is counted with prefix caching off."""
        if not self.enable_prefix_caching:
            return
        if preempted:
            self.num_preempted_query_tokens += num_tokens
            self.num_preempted_hit_tokens += num_hit_tokens
        else:
            self.num_query_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of seq's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        n = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        hashes = self._hashes(seq)
        run: list[int] = []  # indices of newly cached blocks, one event per consecutive run
        for i in range(n):
            b = seq.block_table[i]
            if self.block_hash[b] is None and hashes[i] not in self.hash_to_block:
                self.block_hash[b] = hashes[i]
                self.hash_to_block[hashes[i]] = b
                if self.enable_kv_events:
                    if run and run[-1] != i - 1:
                        self._stored(seq, hashes, run)
                        run = []
                    run.append(i)
        if run:
            self._stored(seq, hashes, run)

    def _stored(self, seq: Sequence, hashes: list[bytes], run: list[int]) -> None:
        bs, first, last = self.block_size, run[0], run[-1]
        self._events.append(BlockStored(
            tuple(hashes[first:last + 1]), hashes[first - 1] if first else None,
            array("I", seq.token_ids[first * bs:(last + 1) * bs]), bs))

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order (empty with events off)."""
        events, self._events = self._events, []
        return events

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references (tail first, so a prefix outlives its suffix) and clear its table."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (as vLLM's ``reset_prefix_cache``), so the next
        lookups miss. Only when no sequence holds a block.

        Returns:
            True when the cache was cleared; False (nothing changed) while blocks are in use.
        """
        if self.num_used_blocks:
            return False
        for b in self.hash_to_block.values():
            self.block_hash[b] = None
        self.hash_to_block.clear()
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def _take(self, b: int) -> None:
        if self.ref_count[b] == 0:
            del self.free[b]
        self.ref_count[b] += 1

    def _release(self, b: int) -> None:
        self.ref_count[b] -= 1
        if self.ref_count[b] == 0:
            self.free[b] = None
            if self.block_hash[b] is None:
                self.free.move_to_end(b, last=False)  # no cached content: reuse first

    def _pop_free(self) -> int:
        if not self.free:
            raise RuntimeError("KV pool exhausted: allocate() called without can_allocate()")
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict its cached content
            del self.hash_to_block[h]
            self.block_hash[b] = None
            if self.enable_kv_events:
                last = self._events[-1] if self._events else None
                if isinstance(last, BlockRemoved):  # evictions of one allocation: one event
                    self._events[-1] = BlockRemoved(last.block_hashes + (h,))
                else:
                    self._events.append(BlockRemoved((h,)))
        self.ref_count[b] = 1
        return b

    def check_integrity(self) -> None:
        """Assert the pool's invariants (free + used == total, refs >= 0, hash index 1:1).

        Raises:
            AssertionError: an invariant is broken.
        """
        assert self.ref_count[0] == 0 and 0 not in self.free, "null block must never be used"
        for b in range(1, self.num_blocks):
            assert self.ref_count[b] >= 0, f"block {b} has ref_count {self.ref_count[b]}"
            assert (self.ref_count[b] == 0) == (b in self.free), f"block {b} free-state mismatch"
        assert len(self.free) + self.num_used_blocks == self.num_blocks - 1
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash index points at block {b} with another hash"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
