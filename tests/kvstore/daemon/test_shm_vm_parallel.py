"""A large put's read from the client's memory cut across threads (``shm_vm.vm_read_parallel``):
the same bytes as one read, whatever the cut points of the local and remote range lists; a
short or refused part refuses the whole read, and only after every part has finished."""
import ctypes
import errno
import mmap
import os
import threading
import time

import numpy as np
import pytest

from kvstore.daemon import shm_vm
from kvstore.daemon.shm_client import ShmKVStoreClient
from tests.kvstore.daemon.shm_helpers import KEYS, NS, as_bytes, chunk, make_store, shm_daemon

PAGE = os.sysconf("SC_PAGE_SIZE")


def ranges_of(arr: np.ndarray, sizes: list[int]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` ranges of ``arr``, back to back, of the given sizes."""
    out, pos = [], 0
    for n in sizes:
        out.append((arr.ctypes.data + pos, n))
        pos += n
    return out


def record_reads(monkeypatch) -> list[int]:
    """Bytes of each ``vm_read`` call made (from any thread)."""
    sizes: list[int] = []
    real = shm_vm.vm_read
    monkeypatch.setattr(shm_vm, "vm_read", lambda pid, l, r: sizes.append(
        sum(n for _, n in l)) or real(pid, l, r))
    return sizes


@pytest.mark.parametrize("ways", [2, 3])
def test_a_cut_read_copies_the_same_bytes_as_one_read(monkeypatch, ways):
    monkeypatch.setattr(shm_vm, "PARALLEL_MIN_PART_BYTES", 1000)
    sizes = record_reads(monkeypatch)
    rng = np.random.default_rng(ways)
    src = rng.integers(0, 256, 10_000, dtype=np.uint8)
    dst = np.zeros(10_000, dtype=np.uint8)
    # cut points that differ between the two sides, so a part starts inside a range
    remote = ranges_of(src, [1, 4095, 17, 3000, 2887])
    local = ranges_of(dst, [5000, 3, 4997])
    got = shm_vm.vm_read_parallel(os.getpid(), local, remote, ways)
    assert got == 10_000
    assert np.array_equal(dst, src)
    assert len(sizes) == ways and sum(sizes) == 10_000
    assert max(sizes) - min(sizes) <= ways  # about equal parts


def test_a_small_read_is_not_cut(monkeypatch):
    sizes = record_reads(monkeypatch)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert shm_vm.vm_read_parallel(os.getpid(), ranges_of(dst, [4096]),
                                   ranges_of(src, [4096]), 4) == 4096
    assert sizes == [4096] and np.array_equal(dst, src)


@pytest.fixture
def guarded():
    """Two pages whose second is unreadable (``PROT_NONE``); yields (mmap, base address)."""
    mm = mmap.mmap(-1, 2 * PAGE)
    mm.write(b"\7" * (2 * PAGE))
    base = shm_vm.address_of(mm)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + PAGE), ctypes.c_size_t(PAGE), 0) == 0
    yield mm, base
    libc.mprotect(ctypes.c_void_p(base + PAGE), ctypes.c_size_t(PAGE), 3)
    mm.close()


@pytest.mark.parametrize("short_part", [0, 1])
def test_a_part_running_into_unreadable_memory_makes_the_read_short(monkeypatch, guarded,
                                                                     short_part):
    monkeypatch.setattr(shm_vm, "PARALLEL_MIN_PART_BYTES", 512)
    _, base = guarded
    src = np.ones(2048, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    bad = (base + PAGE - 1024, 2048)  # 1024 readable bytes, then the guard page
    remote = [bad, (src.ctypes.data, 2048)] if short_part == 0 else \
        [(src.ctypes.data, 2048), bad]
    got = shm_vm.vm_read_parallel(os.getpid(), [(dst.ctypes.data, 4096)], remote, 2)
    assert got < 4096


def test_a_refused_part_raises_only_after_the_other_part_finished(monkeypatch, guarded):
    """Part 2 starts in unreadable memory (EFAULT); part 1 is slow. The error comes out, but
    not before part 1 stopped writing into the destination (which the caller frees)."""
    monkeypatch.setattr(shm_vm, "PARALLEL_MIN_PART_BYTES", 512)
    _, base = guarded
    real = shm_vm.vm_read
    finished: list[str] = []

    def slow_first(pid, local, remote):
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.2)
            n = real(pid, local, remote)
            finished.append("first")
            return n
        return real(pid, local, remote)
    monkeypatch.setattr(shm_vm, "vm_read", slow_first)
    src = np.ones(2048, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(OSError) as e:
        shm_vm.vm_read_parallel(os.getpid(), [(dst.ctypes.data, 4096)],
                                [(src.ctypes.data, 2048), (base + PAGE, 2048)], 2)
    assert e.value.errno == errno.EFAULT
    assert finished == ["first"]


def test_a_daemon_put_read_in_parts_is_bit_exact(tmp_path, monkeypatch):
    """Through the real daemon: 6 chunks of 256 bytes read in 3 parts of 512 bytes."""
    monkeypatch.setattr(shm_vm, "PARALLEL_MIN_PART_BYTES", 256)
    monkeypatch.setattr(shm_vm, "READ_WAYS", 3)
    sizes = record_reads(monkeypatch)
    store = make_store()
    with shm_daemon(tmp_path, store=store) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        kvs = [chunk(10 + i) for i in range(6)]
        sizes.clear()
        assert c.put_chunks(NS, KEYS[2:8], kvs) == 6
        assert sizes == [512, 512, 512]
        assert [as_bytes(g) for g in d.store.get_chunks(NS, KEYS[2:8])] == \
            [as_bytes(kv) for kv in kvs]
        d.store.check_integrity()


def test_any_error_of_a_part_waits_for_the_other_parts(monkeypatch):
    """Not only an ``OSError``: the caller releases the destination pages when this raises."""
    monkeypatch.setattr(shm_vm, "PARALLEL_MIN_PART_BYTES", 512)
    real = shm_vm.vm_read
    finished: list[str] = []

    def part(pid, local, remote):
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("first part failed")
        time.sleep(0.2)
        n = real(pid, local, remote)
        finished.append("second")
        return n
    monkeypatch.setattr(shm_vm, "vm_read", part)
    src = np.ones(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="first part failed"):
        shm_vm.vm_read_parallel(os.getpid(), [(dst.ctypes.data, 4096)],
                                [(src.ctypes.data, 4096)], 2)
    assert finished == ["second"]
