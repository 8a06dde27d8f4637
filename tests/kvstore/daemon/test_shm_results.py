"""Recycled get destinations (``kvstore.daemon.shm_results.ResultBuffers``): a buffer goes back
to the free list only once no tensor or view of it is left, is handed out again whole, and
the free list stays within its cap; the same-host client's gets without ``out`` land in them,
bit-exact. Tiny layout: 256-byte chunks (``server_helpers``)."""
import gc

import torch

from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_results import ResultBuffers
from tests.kvstore.daemon.server_helpers import LAYOUT
from tests.kvstore.daemon.shm_helpers import KEYS, NS, chunk, shm_daemon

CB = LAYOUT.chunk_bytes  # 256


def test_a_buffer_comes_back_only_when_no_view_of_it_is_left():
    rb = ResultBuffers(max_free_bytes=2 * CB)
    a = rb.take(LAYOUT)
    assert (tuple(a.shape), a.dtype, a.is_contiguous()) == (LAYOUT.shape(), torch.float16, True)
    ptr = a.data_ptr()
    part = a[:, :, 1:3]           # a slice of the chunk, kept
    flat = a.view(torch.uint8)    # and a dtype view, dropped below
    del a, flat
    gc.collect()
    assert rb.free_bytes == 0     # the slice still reaches the buffer
    b = rb.take(LAYOUT)
    assert b.data_ptr() != ptr    # so it was not handed out again
    part.fill_(7.0)
    del part
    gc.collect()
    assert rb.free_bytes == CB
    rb.check_integrity()
    c = rb.take(LAYOUT)
    assert c.data_ptr() == ptr and rb.free_bytes == 0
    assert torch.all(c[:, :, 1:3] == 7.0)  # reused as is: a get overwrites every byte
    del b, c
    gc.collect()
    assert rb.free_bytes == 2 * CB
    rb.check_integrity()


def test_the_free_list_keeps_at_most_its_cap():
    rb = ResultBuffers(max_free_bytes=2 * CB)
    held = [rb.take(LAYOUT) for _ in range(3)]
    del held
    gc.collect()
    assert rb.free_bytes == 2 * CB  # the third buffer went back to the system
    rb.check_integrity()


def test_gets_without_out_land_in_recycled_buffers_bit_exact(tmp_path):
    kvs = [chunk(i) for i in range(3)]
    with shm_daemon(tmp_path) as srv:
        with ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:3], kvs) == 3
            first = c.get_chunks(NS, KEYS[:3])
            assert all(torch.equal(g, kv) for g, kv in zip(first, kvs))
            ptrs = {g.data_ptr() for g in first}
            del first
            gc.collect()
            assert c.results.free_bytes == 3 * CB
            second = c.get_chunks(NS, KEYS[2::-1])  # reversed order
            assert {g.data_ptr() for g in second} == ptrs
            assert all(torch.equal(g, kv) for g, kv in zip(second, kvs[::-1]))
            assert c.results.free_bytes == 0
            c.results.check_integrity()
