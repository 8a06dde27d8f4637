"""``bench.page_cache``: a file read through this process's own shared mapping (as lmdb reads
its data file) stays cached after ``posix_fadvise(DONTNEED)`` alone; ``drop`` evicts it, and
``resident_bytes`` (mincore) says so."""
from __future__ import annotations

import mmap
import os

from bench import page_cache


def test_drop_evicts_a_file_this_process_maps(tmp_path):
    path = tmp_path / "data.mdb"
    size = 64 * mmap.PAGESIZE + 100                          # a last page not full
    path.write_bytes(os.urandom(size))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert sum(m[i] for i in range(0, size, mmap.PAGESIZE)) >= 0   # touch every page
        assert page_cache.own_mappings(str(path))
        assert page_cache.resident_bytes(str(path)) == (size, size)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        assert page_cache.resident_bytes(str(path)) == (size, size)     # mapped: kept
        page_cache.drop(str(path))
        assert page_cache.resident_bytes(str(path)) == (0, size)
        assert m[size - 1] == path.read_bytes()[-1]           # the mapping still reads the file
        assert page_cache.resident_bytes(str(path))[0] > 0
    assert page_cache.resident_bytes(str(tmp_path / "data.mdb"))[1] == size
