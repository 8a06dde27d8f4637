"""Tier contract: one storage medium with a byte capacity, an index and an eviction policy.

A tier owns its data and keeps its policy informed (insert/access/remove). It knows nothing
about other tiers: ``kvstore.store.ChunkStore`` moves chunks between tiers (spill, promote) and
decides what is evictable (pins). Keys are ``ChunkKey``; a chunk's ``parent`` is the key of the
previous chunk of the same prompt (None for a first chunk), passed on to the policy so it
evicts tails before heads.

Thread-safety: a tier is called under the store's lock, except ``read`` of a key the store has
pinned (memory tiers) and the disk tier's internal writer thread, which take the tier's own lock.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Callable, Iterable

import torch

from kvstore.eviction import EvictionPolicy, create_policy
from kvstore.keys import ChunkKey

log = logging.getLogger("kvstore.tiers")

#: ``listener(event, tier_name, count)``; events: "eviction", "corruption", "dropped_write",
#: "error". Called from whichever thread saw the event.
Listener = Callable[[str, str, int], None]


class TierFullError(RuntimeError):
    """``put`` into a tier without room (the caller must make room first)."""


class Tier(ABC):
    """Base of the GPU, CPU and disk tiers.

    Attributes:
        name: ``"gpu"``, ``"cpu"`` or ``"disk"``.
        capacity_bytes: usable bytes.
        policy: the eviction policy (replaced by a fresh one, rebuilt from the index, if it
            ever raises: an exception inside eviction never takes the tier down).
        listener: receives event counts (see ``Listener``).
    """

    def __init__(self, name: str, capacity_bytes: int, policy_name: str = "lru") -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.policy_name = policy_name
        self.policy: EvictionPolicy = create_policy(policy_name)
        self.listener: Listener = lambda event, tier, n: None
        #: Set by the store: may this key be evicted now (not pinned)? Used by tiers that evict
        #: on their own (the disk tier when lmdb's map is full).
        self.evictable: Callable[[ChunkKey], bool] = lambda key: True
        #: Set by the store: this tier evicted ``key`` on its own (the disk tier when lmdb's
        #: map is full; counted in ``evictions`` through ``listener`` too), so the store counts
        #: it in ``dropped_chunks`` when no tier holds it now, as its own evictions are. Any
        #: thread; must not block.
        self.evicted: Callable[[ChunkKey], None] = lambda key: None
        #: Set by the store: does a prefix lookup reach ``key`` (every recorded ancestor
        #: stored, in any tier)? Asked by a tier evicting on its own of a victim demoted as
        #: unreachable (``DiskTier.revive``). Any thread.
        self.reachable: Callable[[ChunkKey], bool] = lambda key: True
        #: Set by the store: this tier dropped ``key`` on its own (a disk write that failed, a
        #: corrupt chunk deleted); the store then removes its stored descendants. Any thread;
        #: must not block.
        self.lost: Callable[[ChunkKey], None] = lambda key: None
        #: Set by the store: is this key demoted in another tier (``demote``)? A chunk spilled
        #: here from a tier where it was demoted stays demoted here.
        self.demoted_elsewhere: Callable[[ChunkKey], bool] = lambda key: False
        self._lock = threading.RLock()

    # ---- contract -------------------------------------------------------------------------
    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes taken by stored chunks (memory tiers: whole pages)."""

    @abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Bytes a chunk of ``nbytes`` raw bytes would take here. No side effects."""

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Presence (no side effects)."""

    @abstractmethod
    def put(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
            owned: bool = False) -> None:
        """Store a copy of ``kv`` (any device, any strides). The caller made room first.
        ``owned=True`` says the caller hands ``kv`` over (no defensive copy needed).

        Raises:
            TierFullError: not enough free space. KeyError: key already present.
        """

    @abstractmethod
    def read(self, key: ChunkKey, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """A new tensor with the chunk's KV on ``device``, or None if absent or corrupt."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Drop a chunk; returns whether it was present. Frees its space at once."""

    @abstractmethod
    def keys(self) -> list[ChunkKey]:
        """Snapshot of the stored keys."""

    @abstractmethod
    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        """Parent key recorded at put (None for a first chunk or an absent key)."""

    @abstractmethod
    def nbytes_of(self, key: ChunkKey) -> int:
        """Bytes the chunk takes here (0 if absent)."""

    @abstractmethod
    def _index_items(self) -> Iterable[tuple[ChunkKey, int, ChunkKey | None]]:
        """(key, footprint bytes, parent) for every stored chunk, to rebuild the policy."""

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the index, the space accounting or the policy disagree."""
        with self._lock:
            self.policy.check_integrity()
            keys = set(self.keys())
            assert keys == self.policy.keys(), (
                f"{self.name}: policy tracks {len(self.policy)} keys, tier holds {len(keys)}")
            assert 0 <= self.used_bytes <= self.capacity_bytes, (
                f"{self.name}: used {self.used_bytes} outside [0, {self.capacity_bytes}]")

    def close(self) -> None:
        """Release resources. Idempotent."""

    @property
    def num_chunks(self) -> int:
        return len(self.keys())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def can_fit(self, nbytes: int) -> bool:
        return self.footprint(nbytes) <= self.free_bytes

    def children_of(self, key: ChunkKey) -> set[ChunkKey]:
        """Keys stored here whose recorded parent is ``key`` (a new set)."""
        with self._lock:
            return self.policy.children(key)

    # ---- policy calls that cannot take the tier down ------------------------------------------
    def touch(self, key: ChunkKey) -> None:
        """Tell the policy ``key`` was read (this lifts a demotion)."""
        self._policy_call("on_access", key)

    def demote(self, key: ChunkKey) -> bool:
        """Make stored ``key`` this tier's first victim once no child of it is stored here
        (``EvictionPolicy.demote``). Returns whether the tier holds ``key``. A policy that
        raises is rebuilt (demotions are lost then) and False is returned."""
        with self._lock:
            try:
                return self.policy.demote(key)
            except Exception:
                self._policy_failed("demote")
                return False

    def eviction_order(self) -> list[ChunkKey]:
        """Stored keys, the policy's next victim first: demoted keys first, then the
        policy's order (``EvictionPolicy._order``; a leaf of a prompt goes before its
        parent only as the policy ranks them). A policy that raises is rebuilt and the
        index's order is returned."""
        with self._lock:
            try:
                order = list(self.policy._order())
            except Exception:
                self._policy_failed("order")
                return self.keys()
            demoted = [k for k in order if self.policy.is_demoted(k)]
            if not demoted:
                return order
            return demoted + [k for k in order if not self.policy.is_demoted(k)]

    def is_demoted(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored here and demoted (no side effects)."""
        return self.policy.is_demoted(key)

    def _track(self, key: ChunkKey, nbytes: int, parent: ChunkKey | None) -> None:
        """Tell the policy ``key`` was stored (``nbytes`` of tier space), demoted at once when
        another tier holds it demoted (a spill). Called under the tier's lock."""
        self._policy_call("on_insert", key, nbytes, parent)
        if self.demoted_elsewhere(key):
            self._policy_call("demote", key)

    def next_victim(self, can_evict: Callable[[ChunkKey], bool],
                    leaves_only: bool = False) -> ChunkKey | None:
        """The policy's next victim among keys passing ``can_evict`` (``leaves_only``: among
        keys with no child stored in this tier), or None. If the policy raises, the error is
        logged and counted, the policy is rebuilt, and the first evictable key of the index
        is returned instead."""
        with self._lock:
            try:
                return self.policy.next_victim(can_evict, leaves_only)
            except Exception:
                self._policy_failed("next_victim")
                return next((k for k in self.keys() if can_evict(k)), None)

    def _policy_call(self, method: str, *args) -> None:
        with self._lock:
            try:
                getattr(self.policy, method)(*args)
            except Exception:
                self._policy_failed(method)

    def _policy_failed(self, method: str) -> None:
        log.exception("%s tier: eviction policy %s.%s raised; rebuilding the policy",
                      self.name, self.policy_name, method)
        self.listener("error", self.name, 1)
        policy = create_policy(self.policy_name)
        for key, nbytes, parent in self._index_items():
            policy.on_insert(key, nbytes, parent)
        self.policy = policy
