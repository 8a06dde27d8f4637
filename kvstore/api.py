"""The store contract shared by the in-process tiered store and the daemon client.

Two levels:

* ``KVStoreBase`` works on chunk keys (``ChunkKey``) inside a ``Namespace``. The in-process
  ``kvstore.store.ChunkStore`` and the remote ``kvstore.daemon.client.KVStoreClient`` both implement
  it, so a connector can take either.
* ``PrefixStore`` wraps any ``KVStoreBase`` with one namespace and speaks token ids: it turns a
  prompt into chained chunk keys and (de)concatenates chunk tensors.

Shapes: one chunk's KV is ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` in the
namespace's dtype (see ``kvstore.layout``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from kvstore.keys import ChunkKey, Namespace

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client import CollectorRegistry


def chain_parents(keys: Sequence[ChunkKey], first_parent: ChunkKey | None = None
                  ) -> list[ChunkKey | None]:
    """Parents of consecutive chunks of one prompt: ``first_parent`` for ``keys[0]`` (the key
    of the chunk before it, None when ``keys[0]`` is the prompt's first chunk), then key i-1
    for key i. The form ``put_chunks`` takes (``parents=``)."""
    return [first_parent if i == 0 else keys[i - 1] for i in range(len(keys))]


@dataclass(frozen=True)
class LookupResult:
    """Result of a lookup: how many *leading* chunks of a prefix are stored, and where.

    Attributes:
        num_hit_chunks: leading chunks present (a lookup stops at the first missing chunk).
        chunk_size: tokens per chunk.
        tiers: tier name (``"gpu"``, ``"cpu"``, ``"disk"``, or ``"remote"``) of each hit chunk,
            ``len(tiers) == num_hit_chunks``.
        num_requested_chunks: chunks asked about.
    """

    num_hit_chunks: int
    chunk_size: int
    tiers: tuple[str, ...] = ()
    num_requested_chunks: int = 0

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_chunks * self.chunk_size

    @property
    def hits_by_tier(self) -> dict[str, int]:
        """Hit chunks per tier name."""
        return dict(Counter(self.tiers))


@dataclass(frozen=True)
class StoreCapabilities:
    """What a ``KVStoreBase`` offers beyond the abstract methods, and what may block.

    Callers read ``store.capabilities`` instead of probing for methods: an optional operation
    is called only where its flag is True (it may be absent or raise otherwise).

    Attributes:
        remote: calls cross a process or network boundary (the daemon client): any call may
            block up to the client's deadline and raise ``kvstore.errors.StoreUnavailable``.
            False: calls take only the store's own locks (disk I/O for a disk tier aside).
        borrowed_reads: ``borrow_chunks(ns, keys)`` hands out zero-copy views of the pages of
            host-memory chunks (``kvstore.direct.BorrowedChunks``; ``read_lower`` blocks on
            disk I/O; ``release`` must follow). It reads what ``get_chunks`` reads.
        reservations: ``reserve_chunks`` / ``commit_chunks`` / ``release_reservations``: a
            put's bytes land in reserved pages of a host-memory top tier (``kvstore.direct``).
        pins: ``pin`` / ``unpin`` hold chunks against eviction (False: they are accepted and
            do nothing).
        durable_puts: ``persist(ns, keys, kvs, timeout=, parents=)`` writes chunks through to
            a disk tier and blocks until they are committed (the store has a disk tier).
        nonblocking_lookup: ``try_lookup_keys(ns, keys)`` answers as ``lookup_keys`` or returns
            None at once when the store lock is busy (never waits: an event loop may call it).
        get_takes_parents: ``get_chunks`` accepts ``parents=`` (each key's parent, as
            ``put_chunks`` takes them) because it stores copies of what it fetched (a layered
            store), which must keep their true parents.
        get_into_buffers: ``get_chunks`` accepts ``out=`` (one tensor per key to read into).
        copies_on_put: ``put_chunks`` (and ``persist``) copy the tensors they are given, so the
            caller may reuse its buffers as soon as the call returns.
        tiers: tier names, top (fastest) first; ``"remote"`` stands for every tier behind a
            daemon (whose lookups name the daemon's own tiers). ``tiers[0] == "remote"``: the
            store is the daemon alone, with no local tier in front.
    """

    remote: bool = False
    borrowed_reads: bool = False
    reservations: bool = False
    pins: bool = False
    durable_puts: bool = False
    nonblocking_lookup: bool = False
    get_takes_parents: bool = False
    get_into_buffers: bool = False
    copies_on_put: bool = False
    tiers: tuple[str, ...] = ()

    @property
    def has_lower_tiers(self) -> bool:
        """Whether a chunk the top tier cannot take may still go to a tier below it."""
        return len(self.tiers) > 1


class KVStoreBase(ABC):
    """Key-level store surface. Implementations are thread-safe.

    Every method takes the ``Namespace`` the keys belong to; chunks of one namespace are never
    visible through another (the namespace id is the first 16 bytes of every storage key).
    Optional operations are declared in ``capabilities`` (``StoreCapabilities``).
    """

    @property
    def capabilities(self) -> StoreCapabilities:
        """The optional operations this store offers and what may block (none by default)."""
        return StoreCapabilities()

    def register(self, ns: Namespace) -> None:
        """Check that a chunk of ``ns`` fits the store (done on first use otherwise). Does
        nothing by default.

        Raises:
            ValueError: a tier smaller than one chunk of ``ns`` (stores that check).
        """

    @abstractmethod
    def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult:
        """Count the leading keys present. No side effects: no recency update, no pin.

        The result is a hint: a chunk may be evicted before a later ``get_chunks``.
        """

    @abstractmethod
    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        """Read chunks. Each entry is a CPU (or store-device) tensor
        ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` owned by the caller, or ``None``
        for a miss (absent, evicted since lookup, or corrupt). Counts as an access (recency,
        frequency) and may promote a chunk to a faster tier.
        """

    @abstractmethod
    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   kvs: Sequence[torch.Tensor],
                   parents: Sequence[ChunkKey | None] | None = None) -> int:
        """Store chunks; keys already present are skipped. Returns the number newly stored.

        ``parents[i]`` is the key of the chunk before ``keys[i]`` in its prompt (None for a
        prompt's first chunk); None means ``chain_parents(keys)``: the keys are a prompt's
        chunks from its first one. A chunk saved in a later call than its parent must be given
        the parent (``chain_parents(keys, key_before)``): the store keeps stored prefixes
        reachable (never evicts a parent and keeps its child) only with true parents. A chunk
        whose parent is stored nowhere may be refused.

        Raises:
            ValueError: a tensor's shape or dtype does not match ``ns.layout`` (message names
                expected and got), ``len(keys) != len(kvs)``, or a bad ``parents`` (count,
                type, another namespace). Nothing is stored then.
        """

    @abstractmethod
    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key (no side effects)."""

    @abstractmethod
    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Delete chunks from every tier. Returns the number removed. Pinned chunks are removed
        once their last reader is done."""

    def demote(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Mark stored chunks as first eviction candidates: in every tier holding one, it is
        evicted before any chunk not demoted, once no child of it is stored there (oldest
        demotion first, whatever the tier's policy). A demoted chunk still serves lookups and
        reads, and a read lifts its demotion. Used for tail pieces whose full chunk is now
        stored. Mutates eviction order only; never blocks on I/O in-process.

        Returns the number of ``keys`` stored somewhere (now demoted). This default, for a
        store without eviction order of its own, demotes nothing and returns 0.

        Raises:
            ValueError: a key of another namespace (stores that check keys).
        """
        return 0

    @abstractmethod
    def clear(self, ns: Namespace | None = None) -> int:
        """Delete every chunk of ``ns`` (all namespaces if None). Returns the number removed."""

    @abstractmethod
    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        """Pin chunks so no eviction policy evicts them (a ref count: two pins need two unpins).
        With ``lease_s`` the pin expires by itself after that many seconds. Returns the number
        of keys pinned (present ones)."""

    @abstractmethod
    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Drop one pin per key. Returns the number of keys unpinned."""

    @abstractmethod
    def stats(self) -> dict:
        """JSON-able figures: per tier bytes used/capacity, chunk counts, hits, evictions..."""

    def stored_keys(self) -> set[ChunkKey]:
        """Every key this process's tiers hold (a snapshot; a chunk in two tiers counted once).
        Empty for a store that holds no chunks itself (a daemon client)."""
        return set()

    def metrics_registry(self) -> "CollectorRegistry | None":
        """The ``prometheus_client.CollectorRegistry`` of this store's metrics, or None."""
        return None

    def close(self) -> None:
        """Release resources (flush disk writes). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PrefixStore:
    """Token-level view of a ``KVStoreBase`` for one namespace.

    ``put(tokens, kv)`` stores the full chunks of ``kv`` (``kv.shape[2]`` tokens, the KV of
    ``tokens[:kv.shape[2]]``); ``lookup(tokens)`` says how many leading tokens are stored;
    ``get(tokens, n)`` returns their KV ``[num_layers, 2, n, num_kv_heads, head_dim]``.
    """

    def __init__(self, backend: KVStoreBase, ns: Namespace):
        self.backend = backend
        self.ns = ns
        self.chunk_size = ns.layout.chunk_size

    def keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> list[ChunkKey]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.cpu().numpy()
        return self.ns.chunk_keys(tokens)

    def lookup(self, tokens) -> LookupResult:
        """Leading tokens available (a multiple of chunk_size). No side effects."""
        return self.backend.lookup_keys(self.ns, self.keys(tokens))

    def get(self, tokens, num_tokens: int) -> torch.Tensor | None:
        """KV of ``tokens[:num_tokens]`` (``num_tokens`` a multiple of chunk_size), or None if any
        chunk is missing.

        Raises:
            TypeError: num_tokens not an integer. ValueError: num_tokens negative, not a
                multiple of chunk_size or beyond the full chunks.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"num_tokens must be an integer, got {type(num_tokens).__name__}")
        if num_tokens < 0 or num_tokens % self.chunk_size or num_tokens > len(tokens):
            raise ValueError(f"num_tokens={num_tokens} must be a multiple of chunk_size="
                             f"{self.chunk_size} in [0, len(tokens)={len(tokens)}]")
        keys = self.keys(tokens[:num_tokens])
        if not keys:
            return torch.empty(self.ns.layout.shape(0), dtype=self.ns.layout.torch_dtype)
        chunks = self.backend.get_chunks(self.ns, keys)
        if any(c is None for c in chunks):
            return None
        return torch.cat(chunks, dim=2)

    def put(self, tokens, kv: torch.Tensor) -> int:
        """Store the full chunks of ``kv`` ``[num_layers, 2, T, num_kv_heads, head_dim]``,
        ``T <= len(tokens)``. Returns the number of chunks newly stored.

        Raises:
            ValueError: wrong shape/dtype or T > len(tokens).
        """
        lay = self.ns.layout
        if kv.dim() != 5 or kv.shape[2] > len(tokens):
            raise ValueError(f"KV shape mismatch: expected {list(lay.shape(len(tokens)))}-like "
                             f"with at most {len(tokens)} tokens, got {list(kv.shape)}")
        lay.validate(kv, kv.shape[2])  # shape and dtype only: names the real token count
        n = kv.shape[2] // self.chunk_size
        keys = self.keys(tokens[:n * self.chunk_size])
        kvs = [kv[:, :, i * self.chunk_size:(i + 1) * self.chunk_size] for i in range(n)]
        return self.backend.put_chunks(self.ns, keys, kvs) if keys else 0

    def remove(self, tokens) -> int:
        return self.backend.remove(self.ns, self.keys(tokens))

    def pin(self, tokens, lease_s: float | None = None) -> int:
        return self.backend.pin(self.ns, self.keys(tokens), lease_s)

    def unpin(self, tokens) -> int:
        return self.backend.unpin(self.ns, self.keys(tokens))
