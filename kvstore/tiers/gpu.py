"""GPU tier: one preallocated device pool managed by ``MemoryTier``'s page allocator. On a
CPU-only machine ``device="cpu"`` runs the same code on host memory, so it is tested there.

Spills to the CPU tier and promotes from it are copied pool to pool on the tier's
``copy_stream`` (``make_copy_stream(device)``: a CUDA side stream ordered after the kernels that
wrote the KV, or inline copies on CPU); see ``MemoryTier.put_from``."""
from __future__ import annotations

import torch

from kvstore.tiers.copy_stream import make_copy_stream
from kvstore.tiers.memory import MemoryTier


class GpuTier(MemoryTier):
    """Device-memory tier of ``capacity_bytes`` (rounded down to whole pages) on ``device``.

    Raises:
        ValueError: capacity smaller than one page. RuntimeError: the device is unavailable.
    """

    def __init__(self, capacity_bytes: int, page_bytes: int, device: str | torch.device = "cuda",
                 policy_name: str = "lru") -> None:
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"gpu tier capacity {capacity_bytes} is smaller than one page ({page_bytes})")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"gpu tier on {device!r}: CUDA is not available in this torch "
                               f"build or machine (use gpu_bytes=0, or device='cpu')")
        pool = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=device)
        super().__init__("gpu", pool, page_bytes, policy_name)
        self.copy_stream = make_copy_stream(device)
