"""CPU tier: one preallocated host arena (page-locked when CUDA is present, so copies to and
from the GPU run at full PCIe speed) managed by ``MemoryTier``'s page allocator."""
from __future__ import annotations

import torch

from kvstore.tiers.memory import MemoryTier


class CpuTier(MemoryTier):
    """Host-memory tier of ``capacity_bytes`` (rounded down to whole pages).

    Raises:
        ValueError: capacity smaller than one page.
    """

    def __init__(self, capacity_bytes: int, page_bytes: int, policy_name: str = "lru",
                 pin_memory: bool | None = None) -> None:
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"cpu tier capacity {capacity_bytes} is smaller than one page ({page_bytes})")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        pool = torch.empty(num_pages * page_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        super().__init__("cpu", pool, page_bytes, policy_name)
        self.pinned = pin_memory
