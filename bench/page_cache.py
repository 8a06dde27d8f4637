"""A file's pages in the OS page cache, for cold-read benchmarks (Linux): ``drop`` evicts a
file (e.g. a disk tier's ``data.mdb``) from the page cache, ``resident_bytes`` counts what of
it is cached (``mincore``, as ``fincore`` does).

``posix_fadvise(POSIX_FADV_DONTNEED)`` drops only clean pages that no process maps: lmdb
reads through a read-only shared mapping of its data file, so pages this process has read
stay mapped and would stay cached. ``drop`` therefore first unmaps them from this process's
page tables (``madvise(MADV_DONTNEED)`` over each mapping of the file listed in
``/proc/self/maps``: for a shared file mapping that only discards the page-table entries; the
next access faults the page in from the file again), then syncs and advises. Pages mapped by
another process, or dirty ones the sync could not write, stay: ``resident_bytes`` after
``drop`` says what is left.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

_MADV_DONTNEED = 4
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def own_mappings(path: str) -> list[tuple[int, int]]:
    """(start, end) addresses of this process's mappings of ``path`` (``/proc/self/maps``)."""
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") == real:
                lo, hi = (int(a, 16) for a in parts[0].split("-"))
                out.append((lo, hi))
    return out


def drop(path: str) -> None:
    """Evict ``path``'s pages from the page cache (module docstring: this process's mappings
    unmapped from its page tables first).

    Raises:
        OSError: the file cannot be opened, or ``madvise`` refused.
    """
    for lo, hi in own_mappings(path):
        _check(_libc.madvise(lo, hi - lo, _MADV_DONTNEED), f"madvise {path}")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, file size), from ``mincore`` over a fresh mapping
    of the file that touches no page.

    Raises:
        OSError: the file cannot be opened or mapped.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            _check(-1, f"mmap {path}")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            _check(_libc.mincore(addr, size, vec), f"mincore {path}")
            resident = int((np.frombuffer(vec, np.uint8) & 1).sum())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * mmap.PAGESIZE, size), size
