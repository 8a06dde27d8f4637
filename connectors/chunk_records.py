"""Typed results of the connector core (``connectors.chunk_plan``): small frozen records
of plain ints, keys and namespaces that adapters read by name (no tensors, no store handles).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.api import chain_parents
from kvstore.keys import ChunkKey, Namespace


@dataclass(frozen=True)
class LookupHit:
    """What the store holds of one request's prefix past the engine's own hit.

    Attributes:
        num_tokens, num_local: the request's tokens ``N`` and the engine's hit ``L`` it was
            looked up for.
        hit_end: end token of the leading stored prefix (chunks, then tail pieces); 0 after a
            failed lookup.
        full_end: end token of the leading stored full chunks (a chunk boundary; 0 after a
            failed lookup).
        tiers: tier of each stored unit found, by its start token.
    """

    num_tokens: int
    num_local: int
    hit_end: int
    full_end: int
    tiers: dict[int, str] = field(default_factory=dict)

    @classmethod
    def miss(cls, num_tokens: int, num_local: int) -> "LookupHit":
        """A lookup that failed or timed out: nothing loadable."""
        return cls(num_tokens, num_local, 0, 0, {})


@dataclass(frozen=True)
class Superseded:
    """Tail pieces that a save's full chunks cover: once those chunks are stored the pieces
    are redundant for this prefix (they still serve a prompt that diverges inside the chunk),
    so the adapter demotes them (``KVStoreBase.demote``) after the chunks' put.

    Attributes:
        ns: the tail namespace (the pieces' keys are of it).
        keys: the pieces' keys, in token order.
        chunk_index: per piece, the index into the save's ``keys`` of the chunk covering it.
    """

    ns: Namespace
    keys: tuple[ChunkKey, ...]
    chunk_index: tuple[int, ...]


@dataclass(frozen=True)
class SaveRange:
    """Consecutive units of one chain to save: chunks (or tail pieces, ``tail``) ``first,
    first + 1, ...`` of ``ns``'s chunk size.

    Attributes:
        ns: the namespace to put them in.
        first: index of the first unit (unit ``i`` = tokens ``[i*u, (i+1)*u)``, ``u`` =
            ``ns.layout.chunk_size``).
        keys: their keys.
        parent: key of the unit before ``keys[0]`` when the save continues units saved
            earlier; None when ``keys[0]`` starts its chain (or its parent was not saved by
            this request).
        tail: tail pieces (the tail namespace).
        supersedes: (full chunks) the tail pieces this request saved that these chunks cover,
            to demote once the chunks are stored; None when there are none.
    """

    ns: Namespace
    first: int
    keys: tuple[ChunkKey, ...]
    parent: ChunkKey | None = None
    tail: bool = False
    supersedes: Superseded | None = None

    @property
    def unit(self) -> int:
        """Tokens per unit."""
        return self.ns.layout.chunk_size

    @property
    def starts(self) -> range:
        """First token of each unit."""
        return range(self.first * self.unit, (self.first + len(self.keys)) * self.unit,
                     self.unit)

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered units."""
        return len(self.keys) * self.ns.layout.chunk_bytes

    @property
    def parents(self) -> list[ChunkKey | None] | None:
        """``put_chunks``' ``parents=`` when the save continues a chain, else None (the
        store's default: ``keys[0]`` starts it)."""
        return chain_parents(self.keys, self.parent) if self.parent is not None else None


@dataclass(frozen=True)
class Piece:
    """One stored unit to load: a full chunk (``size`` = chunk size, the request's namespace)
    or a tail piece (``size`` = tail size, the tail namespace) covering tokens
    ``[start, start + size)``.

    Attributes:
        start, size: first token and tokens covered.
        ns: the namespace the key belongs to (its layout's chunk size is ``size``).
        key: the unit's chained prefix-hash key.
        tier: tier the lookup found it in (``"cpu"``, ``"disk"``, ``"remote:cpu"``...;
            ``"unknown"`` when the lookup did not say).
        parent: key of the unit before it in its chain (None: it starts one).
        tail: True for a tail piece.
    """

    start: int
    size: int
    ns: Namespace
    key: ChunkKey
    tier: str
    parent: ChunkKey | None = None
    tail: bool = False

    @property
    def end(self) -> int:
        """One past the last token covered."""
        return self.start + self.size


@dataclass(frozen=True)
class Landed:
    """What one load really wrote, given how many leading pieces landed.

    Attributes:
        end: one past the last token loaded (``plan.start`` when none of the needed did).
        short: tokens of the plan not loaded (``plan.end - end``): the engine recomputes them.
        full_chunks, tail_pieces: landed units of each kind.
        nbytes: bytes of the landed units (whole units, as read from the store).
        tokens_by_tier: tokens counted as loaded, per tier they came from.
    """

    end: int
    short: int
    full_chunks: int
    tail_pieces: int
    nbytes: int
    tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadPlan:
    """What to load for one request at admission.

    Attributes:
        start: first token to write (= tokens already computed by the engine; block aligned).
        end: one past the last token counted as loaded (``start <= end < num_tokens``).
        first_chunk, last_chunk: store chunks spanned, ``[first_chunk, last_chunk)``.
        first_block, last_block: indices into the block table written, ``[first_block, last_block)``
            (``last_block = ceil(end / block_size)``; a trailing partial block is written whole,
            its slots past ``end`` are recomputed by the forward pass before being read).
        pieces: the stored units to read, in token order (full chunks, then tail pieces);
            empty from ``ChunkGeometry.load_plan`` (``RequestChunks.admit`` fills them).
    """

    start: int
    end: int
    first_chunk: int
    last_chunk: int
    first_block: int
    last_block: int
    pieces: tuple[Piece, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens counted as loaded (``end - start``)."""
        return self.end - self.start

    @property
    def num_chunks(self) -> int:
        return self.last_chunk - self.first_chunk

    def landed(self, num_ok: int) -> Landed:
        """Accounting when only the first ``num_ok`` of ``pieces`` landed whole (later ones
        are never written: a load stops at its first missing piece)."""
        end = self.start
        if num_ok:
            end = max(self.start, min(self.end, self.pieces[num_ok - 1].end))
        by_tier: dict[str, int] = {}
        full = tail = nbytes = 0
        for p in self.pieces[:num_ok]:
            lo, hi = max(self.start, p.start), min(end, p.end)
            tail += p.tail
            full += not p.tail
            nbytes += p.ns.layout.chunk_bytes
            if hi > lo:
                by_tier[p.tier] = by_tier.get(p.tier, 0) + hi - lo
        return Landed(end, self.end - end, full, tail, nbytes, by_tier)
