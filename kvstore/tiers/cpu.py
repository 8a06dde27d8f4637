"""CPU tier: one preallocated host arena (page-locked when CUDA is present, so copies to and
from the GPU run at full PCIe speed) managed by ``MemoryTier``'s page allocator.

A *shared* arena (``shared=True``, the daemon's same-host path: ``kvstore.daemon.shm_server``)
is an anonymous memory file (``memfd``) that this process maps read-write and then seals: no
one can grow, shrink or newly map it for writing (``F_SEAL_FUTURE_WRITE``), not even by
reopening ``/proc/<pid>/fd/N``; only this process's own mapping stays writable. Its descriptor
(``shared_fd``) is handed to same-host clients, which map it read-only.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os

import torch

from kvstore.tiers.memory import MemoryTier

log = logging.getLogger("kvstore.tiers.cpu")

#: ``fcntl`` seal refusing every new writable mapping and ``write`` (Linux >= 5.1); missing
#: from Python's ``fcntl`` before 3.12
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: seals of a shared arena once this process has mapped it
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


class CpuTier(MemoryTier):
    """Host-memory tier of ``capacity_bytes`` (rounded down to whole pages).

    Args:
        shared: back the pool with a sealed memfd (see module docstring) instead of private
            memory; ``shared_fd`` is then its descriptor.

    Attributes:
        shared_fd: the memfd of a shared arena (close-on-exec; owned by the tier: ``close``
            closes it), else None.

    Raises:
        ValueError: capacity smaller than one page. OSError: the memfd cannot be created,
            sized or sealed (no ``memfd_create``, a kernel before 5.1, out of memory).
    """

    def __init__(self, capacity_bytes: int, page_bytes: int, policy_name: str = "lru",
                 pin_memory: bool | None = None, shared: bool = False) -> None:
        num_pages = capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"cpu tier capacity {capacity_bytes} is smaller than one page ({page_bytes})")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.shared_fd: int | None = None
        self._mm: mmap.mmap | None = None
        if shared:
            self.shared_fd, self._mm = _sealed_arena(num_pages * page_bytes)
            pool = torch.frombuffer(self._mm, dtype=torch.uint8)  # [num_pages * page_bytes]
            pin_memory = pin_memory and _register_pinned(pool)
        else:
            pool = torch.empty(num_pages * page_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        super().__init__("cpu", pool, page_bytes, policy_name)
        self.pinned = pin_memory

    def check_integrity(self) -> None:
        """``MemoryTier``'s checks; a shared arena must also still be the whole memfd, sealed
        (``ARENA_SEALS``), with the pool over this process's mapping of it."""
        super().check_integrity()
        if self.shared_fd is not None:
            nbytes = self.pool.numel()
            assert os.fstat(self.shared_fd).st_size == nbytes, "shared arena: memfd size drifted"
            assert fcntl.fcntl(self.shared_fd, fcntl.F_GET_SEALS) == ARENA_SEALS, \
                "shared arena: seals changed"
            assert len(self._mm) == nbytes, "shared arena: pool is not the whole mapping"

    def close(self) -> None:
        """Drop every chunk; a shared arena also gives up its mapping and descriptor (the
        memory goes back to the OS once every client has unmapped it too). Idempotent."""
        super().close()
        if self.shared_fd is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.pool.data_ptr())
            self.pinned = False
        self.pool = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:  # views still held somewhere: unmapped when the last one goes
            log.debug("shared cpu arena still referenced at close; unmapped when released")
        self._mm = None
        os.close(self.shared_fd)
        self.shared_fd = None


def _sealed_arena(nbytes: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``nbytes`` mapped read-write here, then sealed (``ARENA_SEALS``)."""
    fd = os.memfd_create("kvstore-cpu-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)  # MAP_SHARED, read-write: made before the seal
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
        except BaseException:
            mm.close()
            raise
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def _register_pinned(pool: torch.Tensor) -> bool:
    """Page-lock an existing host mapping for fast GPU copies (``cudaHostRegister``); False
    (logged) when CUDA refuses."""
    rc = torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
    if int(rc) != 0:
        log.warning("cannot page-lock the shared cpu arena (cudaHostRegister: %s); GPU copies "
                    "from it run at pageable speed", rc)
        return False
    return True
