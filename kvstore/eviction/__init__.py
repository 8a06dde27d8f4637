"""Eviction policies by name: ``create_policy("lru")``; admission filters by name:
``create_admission("tinylfu")`` (``admission``).

Policies only listen to key events and name victims; tiers own the data (see ``base``).
"""
from __future__ import annotations

from kvstore.eviction.admission import ADMISSIONS, TinyLFU, create_admission
from kvstore.eviction.arc import ARCPolicy
from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.fifo import FIFOPolicy
from kvstore.eviction.lfu import LFUPolicy
from kvstore.eviction.lru import LRUPolicy
from kvstore.eviction.s3fifo import S3FIFOPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}


def create_policy(name: str) -> EvictionPolicy:
    """A new policy instance for ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


__all__ = ["EvictionPolicy", "POLICIES", "create_policy", "LRUPolicy", "LFUPolicy", "FIFOPolicy",
           "S3FIFOPolicy", "ARCPolicy", "ADMISSIONS", "TinyLFU", "create_admission"]
