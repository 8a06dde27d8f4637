"""One request's chunk state, engine-agnostic: key chains, hit arithmetic, load plans, save
ranges and tail pieces. Plain ints, token lists and keys in; frozen records out
(``connectors.chunk_records``). No tensors, no store I/O, no engine objects: an adapter
(``connectors.engine_min``) asks this module *what* to look up, load and save, does the I/O,
and reports back what the store answered.

Per request of ``N`` tokens whose engine already computed ``L`` (its prefix-cache hit, block
aligned), with chunk size ``C`` and tail size ``F`` (0 = off)::

    lookup    full-chunk keys from chunk L // C (``LookupQuery.keys``), then the tail pieces
              from where the stored chunks end to the end of that chunk (``tail_range``)
    hit       H = the end of the leading stored chunks, or of the stored pieces after them;
              E = min(H, N - 1) - L  (never reaching N: the last token is computed)
    admit     LoadPlan: tokens [L, L + E), the chunks then pieces covering them, with keys,
              parents and the tiers the lookup found them in
    land      the leading pieces that arrived whole: where the load really ended (the engine
              recomputes the rest) and what the saved marks move back to
    save      full chunks computed and not saved yet (``chunks_to_save``), and at a prompt's
              end the tail pieces past its last full chunk (``pieces_to_save``), each with its
              true parent when it continues units saved earlier
    supersede a chunk save covering tokens whose pieces this request saved names those
              pieces (``SaveRange.supersedes``): the adapter demotes them once the chunk is
              stored (first eviction candidates; they still serve other prompts that share
              the prefix up to a piece, while there is room). Pieces the request only loaded
              are left alone: the hit proved them useful to more than one prompt

Keys: ``Namespace.chunk_keys`` of the request's tokens for full chunks; tail pieces are keyed
in the tail namespace (the same layout with chunk size ``F``), chained from token 0, so a
piece only matches the identical prefix::

    tokens  |      chunk 0 (C)      |      chunk 1 (C)      | F | F | F |..
    keys    ns (chunk C)            ns                     tail ns (chunk F), chained from 0

When the answer later fills chunk 2, its save supersedes those pieces::

    tokens  |      chunk 0 (C)      |      chunk 1 (C)      |      chunk 2 (C)      |
    saved   (earlier)                (earlier)               | chunks_to_save now    |
    pieces                                                   | F | F | F | superseded (demoted)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_records import LoadPlan, LookupHit, Piece, SaveRange, Superseded
from kvstore.keys import ChunkKey, Namespace, chain_hashes


class KeyChain:
    """Chained prefix-hash keys of one request's tokens in units of ``ns.layout.chunk_size``
    tokens, computed once and extended as the request grows (a request's tokens only append).

    Key ``i`` is ``ChunkKey(ns.ns_id, h_i)`` with ``h_i = H(h_{i-1} || tokens[i*u:(i+1)*u])``
    and ``h_{-1} = ns.digest``: the same keys as ``ns.chunk_keys(tokens)``.
    """

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.unit = ns.layout.chunk_size
        self._keys: list[ChunkKey] = []

    def keys(self, tokens: Sequence[int], n: int) -> list[ChunkKey]:
        """Keys of the first ``n`` units of ``tokens`` (fewer when ``tokens`` holds fewer
        whole units).

        Raises:
            ValueError: a token id outside ``[0, 2**32)``.
        """
        have = len(self._keys)
        if have < n:
            seed = self._keys[-1].prefix_hash if have else self.ns.digest
            hashes = chain_hashes(seed, tokens[have * self.unit:n * self.unit], self.unit,
                                  self.ns.hash_algo)
            self._keys.extend(ChunkKey(self.ns.ns_id, h) for h in hashes)
        return self._keys[:n]


@dataclass(frozen=True)
class LookupQuery:
    """What to ask the store for one request (``RequestChunks.lookup_query``).

    Attributes:
        geometry: the request's block / chunk / tail sizes.
        num_tokens, num_local: ``N`` and the engine's own hit ``L``.
        keys: full-chunk keys from chunk ``L // chunk_size`` to the last full chunk (may be
            empty); look them up in the request's namespace first.
        tail_keys: every whole tail piece's key (tail namespace); look up only
            ``tail_range(hits)`` of them, after the full chunks.
    """

    geometry: ChunkGeometry
    num_tokens: int
    num_local: int
    keys: tuple[ChunkKey, ...]
    tail_keys: tuple[ChunkKey, ...]

    @property
    def first_chunk(self) -> int:
        return self.num_local // self.geometry.chunk_size

    def full_end(self, num_hit_chunks: int) -> int:
        """End token of the leading stored full chunks (a chunk boundary)."""
        return (self.first_chunk + num_hit_chunks) * self.geometry.chunk_size

    def tail_range(self, num_hit_chunks: int) -> range:
        """Indices of the tail pieces to look up once ``num_hit_chunks`` leading chunks of
        ``keys`` are stored (empty: do not ask)."""
        start = max(self.full_end(num_hit_chunks), self.num_local)
        return self.geometry.tail_range(self.num_tokens, start)

    def hit(self, num_hit_chunks: int, tiers: Sequence[str] = (), num_hit_pieces: int = 0,
            piece_tiers: Sequence[str] = ()) -> LookupHit:
        """The hit, from what the store answered: ``num_hit_chunks`` leading chunks of
        ``keys`` (their ``tiers``), then ``num_hit_pieces`` leading pieces of
        ``tail_range(num_hit_chunks)`` (their ``piece_tiers``)."""
        C, F = self.geometry.chunk_size, self.geometry.tail_size
        full_end = self.full_end(num_hit_chunks)
        by_start = {(self.first_chunk + i) * C: t for i, t in enumerate(tiers)}
        hit = full_end
        if num_hit_pieces:
            j0 = self.tail_range(num_hit_chunks).start
            hit = (j0 + num_hit_pieces) * F
            by_start.update({(j0 + i) * F: t for i, t in enumerate(piece_tiers)})
        return LookupHit(self.num_tokens, self.num_local, hit, full_end, by_start)


class RequestChunks:
    """Chunk state of one request, kept across preemptions: its key chains, the last lookup's
    hit, and how far its chunks and tail pieces are saved (or known stored).

    Args:
        geometry: block / chunk / tail sizes (``tail_size`` 0: no tail pieces).
        ns: the request's namespace (chunk size = ``geometry.chunk_size``).
        tail_ns: the tail namespace (chunk size = ``geometry.tail_size``); None when off.
    """

    def __init__(self, geometry: ChunkGeometry, ns: Namespace,
                 tail_ns: Namespace | None = None) -> None:
        self.geometry = geometry
        self.chunks = KeyChain(ns)
        self.pieces = KeyChain(tail_ns) if tail_ns is not None else None
        self.saved = 0          # tokens whose full chunks are saved or known stored
        self.tail_saved = 0     # tokens whose tail pieces are saved or known stored
        self.pieces_put: set[int] = set()   # indices of the tail pieces this request saved
        self.lookup: LookupHit | None = None

    # ---- lookup -------------------------------------------------------------------------------
    def lookup_query(self, tokens: Sequence[int], num_tokens: int,
                     num_local: int) -> LookupQuery | None:
        """What to look up for ``tokens[:num_tokens]`` past the engine's ``num_local`` tokens;
        None when there is nothing to ask (``num_local`` not block aligned, or no full chunk
        past it and no tail piece that would add a token)."""
        g = self.geometry
        first, n_chunks = num_local // g.chunk_size, g.num_full_chunks(num_tokens)
        if num_local % g.block_size or (
                first >= n_chunks and not g.tail_range(num_tokens, num_local)):
            return None
        keys = self.chunks.keys(tokens, n_chunks)[first:]
        tail = self.pieces.keys(tokens, num_tokens // g.tail_size) if self.pieces else []
        return LookupQuery(g, num_tokens, num_local, tuple(keys), tuple(tail))

    def cached_hit(self, num_tokens: int, num_local: int) -> LookupHit | None:
        """The last recorded hit when it was for the same ``(num_tokens, num_local)``."""
        h = self.lookup
        return h if h is not None and (h.num_tokens, h.num_local) == (num_tokens, num_local) \
            else None

    def record(self, hit: LookupHit) -> int:
        """Keep ``hit`` for admission; returns the external tokens ``E`` it allows."""
        self.lookup = hit
        return self.geometry.num_external_tokens(hit.num_tokens, hit.num_local, hit.hit_end)

    # ---- admission and landing ----------------------------------------------------------------
    def admit(self, tokens: Sequence[int], num_tokens: int, num_local: int,
              num_external: int) -> LoadPlan | None:
        """The request was admitted with ``num_external`` tokens to load past ``num_local``:
        consumes the recorded hit (chunks it found count as stored: not saved again) and
        returns the load plan, None when nothing is loaded.

        Raises:
            ValueError: ``num_local`` not block aligned (``ChunkGeometry.load_plan``).
        """
        g = self.geometry
        C, F = g.chunk_size, g.tail_size
        hit, self.lookup = self.lookup, None
        if hit is not None and hit.num_tokens == num_tokens:
            self.saved = max(self.saved, hit.hit_end)
            if F:
                self.tail_saved = max(self.tail_saved, g.floor_to_piece(hit.hit_end))
        if num_external <= 0:
            return None
        plan = g.load_plan(num_local, num_external)
        tiers = hit.tiers if hit is not None else {}
        full_end = hit.full_end if hit is not None else g.floor_to_chunk(num_tokens)
        keys = self.chunks.keys(tokens, min(plan.last_chunk, full_end // C))
        pieces = [Piece(c * C, C, self.chunks.ns, keys[c], tiers.get(c * C, "unknown"),
                        keys[c - 1] if c else None)
                  for c in range(plan.first_chunk, len(keys))]
        if plan.end > full_end:    # the rest comes from tail pieces (found by the lookup)
            j0, j1 = max(full_end, num_local) // F, -(-plan.end // F)
            tail = self.pieces.keys(tokens, j1)
            pieces += [Piece(j * F, F, self.pieces.ns, tail[j], tiers.get(j * F, "unknown"),
                             tail[j - 1] if j * F > full_end else None, tail=True)
                       for j in range(j0, j1)]
        return LoadPlan(plan.start, plan.end, plan.first_chunk, plan.last_chunk,
                        plan.first_block, plan.last_block, tuple(pieces))

    def rewind(self, end: int) -> None:
        """A load ended at token ``end`` short of its plan: units past ``end`` were not loaded,
        so they are not known stored (saved again once computed)."""
        self.saved = min(self.saved, self.geometry.floor_to_chunk(end))
        if self.geometry.tail_size:
            self.tail_saved = min(self.tail_saved, self.geometry.floor_to_piece(end))

    # ---- saves --------------------------------------------------------------------------------
    def chunks_to_save(self, tokens: Sequence[int], end: int) -> SaveRange | None:
        """The full chunks with KV in ``[0, end)`` not saved yet, marked saved (a dropped
        save is not retried); None when there are none. The range names the tail pieces it
        covers that this request saved itself (``supersedes``; ``pieces_put``)."""
        rng = self.geometry.chunks_to_save(self.saved, end)
        if not rng:
            return None
        self.saved = rng.stop * self.geometry.chunk_size
        keys = self.chunks.keys(tokens, rng.stop)
        # a save continuing chunks saved earlier names its first chunk's parent (the store
        # keeps prefixes reachable only with true parents)
        parent = keys[rng.start - 1] if rng.start else None
        return SaveRange(self.chunks.ns, rng.start, tuple(keys[rng.start:]), parent,
                         supersedes=self._superseded(tokens, rng))

    def _superseded(self, tokens: Sequence[int], rng: range) -> Superseded | None:
        """The tail pieces the chunks ``rng`` cover among those this request saved."""
        C, F = self.geometry.chunk_size, self.geometry.tail_size
        if not self.pieces_put:
            return None
        js = [j for j in range(rng.start * C // F, rng.stop * C // F) if j in self.pieces_put]
        if not js:
            return None
        tail = self.pieces.keys(tokens, js[-1] + 1)
        return Superseded(self.pieces.ns, tuple(tail[j] for j in js),
                          tuple(j * F // C - rng.start for j in js))

    def pieces_to_save(self, tokens: Sequence[int], end: int) -> SaveRange | None:
        """The tail pieces past the last full chunk of ``[0, end)`` not saved yet
        (``[max(tail_saved, floor_C(end)), floor_F(end))``), marked saved; None when there
        are none or tail pieces are off."""
        if self.pieces is None:
            return None
        g = self.geometry
        F, floor_c = g.tail_size, g.floor_to_chunk(end)
        lo, hi = max(self.tail_saved, floor_c) // F, end // F
        if hi <= lo:
            return None
        self.tail_saved = hi * F
        self.pieces_put.update(range(lo, hi))
        keys = self.pieces.keys(tokens, hi)
        # pieces are looked up from the last full chunk on: the piece there starts a chain
        # (no parent); one continuing pieces saved earlier names the piece before it
        parent = keys[lo - 1] if lo * F > floor_c else None
        return SaveRange(self.pieces.ns, lo, tuple(keys[lo:hi]), parent, tail=True)
