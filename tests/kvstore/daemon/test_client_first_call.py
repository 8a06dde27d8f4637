"""A client's very first call may already be larger than a real ``kvstore serve``'s
``--max-batch-keys 8 --max-body-bytes 4096``: it is split as later calls are (the limits are
learned before the first request is sent), on every path: the same-host Unix socket
(``ShmKVStoreClient``, and ``KVStoreClient`` on a ``unix://`` URL), HTTP (``KVStoreClient``)
and the async HTTP client. Each test uses a fresh client whose first call is the large one.
Tiny layout (``server_helpers``: 256-byte chunks)."""
from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
import torch

from kvstore.daemon.async_client import AsyncKVStoreClient
from kvstore.daemon.batches import ChunkTooLarge, DaemonLimits
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.daemon.server_helpers import NS, chunk

N = 40
KEYS = NS.chunk_keys(list(range(4 * N)))  # 40 chained chunk keys (5 batches of 8)
KVS = [chunk(i) for i in range(N)]
BODY, BATCH = 4096, 8
LIMITS = DaemonLimits(BODY, BATCH)
#: a namespace whose chunk (2 x 2 x 128 x 1 x 8 fp16 = 8 KiB) alone exceeds BODY
BIG = Namespace("tiny-model", KVLayout(num_layers=2, num_kv_heads=1, head_dim=8,
                                       dtype="float16", chunk_size=128))


@pytest.fixture(scope="module")
def daemon():
    """``(http_url, unix_url)`` of a real ``kvstore serve`` with small limits, its first 30
    of ``KEYS`` stored (chunks ``KVS``)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "kv.sock")
        proc = start(port, sock, ["--max-body-bytes", str(BODY), "--max-batch-keys",
                                  str(BATCH)])
        try:
            with KVStoreClient(f"http://127.0.0.1:{port}", same_host=False, timeout_s=10) as c:
                assert c.put_chunks(NS, KEYS[:30], KVS[:30]) == 30
            yield f"http://127.0.0.1:{port}", "unix://" + sock
        finally:
            stop(proc)


def _sync(daemon, kind: str):
    """A fresh client of ``kind``: ``shm`` (ShmKVStoreClient), ``unix`` (KVStoreClient on the
    socket URL) or ``http`` (KVStoreClient over HTTP only)."""
    if kind == "shm":
        return ShmKVStoreClient(daemon[1], timeout_s=10)
    return KVStoreClient(daemon[1] if kind == "unix" else daemon[0], same_host=False,
                         timeout_s=10)


def _check_parts(parts) -> None:
    assert len(parts) == N
    assert [p is None for p in parts] == [i >= 30 for i in range(N)]
    for p, kv in zip(parts[:30], KVS):
        assert torch.equal(p[0], kv.reshape(-1).view(torch.uint8))


KINDS = ["shm", "unix", "http"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_borrow_past_the_key_limit_reads_every_chunk(daemon, kind):
    c = _sync(daemon, kind)
    try:
        b = c.get_borrowed(NS, KEYS)
        try:
            _check_parts(b.parts)
        finally:
            b.release()
        if kind != "http":
            assert (c._shm if kind == "unix" else c).limits == LIMITS
    finally:
        c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_lookup_past_the_key_limit_answers_as_one_call(daemon, kind):
    c = _sync(daemon, kind)
    try:
        r = c.lookup_keys(NS, KEYS)
        assert (r.num_hit_chunks, r.num_requested_chunks, len(r.tiers)) == (30, N, 30)
    finally:
        c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_get_past_the_key_limit_reads_every_chunk(daemon, kind):
    c = _sync(daemon, kind)
    try:
        got = c.get_chunks(NS, KEYS)
        assert [g is None for g in got] == [i >= 30 for i in range(N)]
        assert all(torch.equal(g, kv) for g, kv in zip(got[:30], KVS))
    finally:
        c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_exists_and_pin_past_the_key_limit(daemon, kind):
    c = _sync(daemon, kind)
    try:
        assert c.exists(NS, KEYS) == [i < 30 for i in range(N)]
    finally:
        c.close()
    c = _sync(daemon, kind)
    try:
        assert c.pin(NS, KEYS[:30], 30.0) == 30
        assert c.unpin(NS, KEYS[:30]) == 30
    finally:
        c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_put_past_both_limits_stores_every_chunk(daemon, kind):
    ns = Namespace("first-put-" + kind, NS.layout)
    keys = ns.chunk_keys(list(range(4 * N)))
    c = _sync(daemon, kind)
    try:
        assert c.put_chunks(ns, keys, KVS) == N
    finally:
        c.close()
    with _sync(daemon, "http") as c:
        assert c.lookup_keys(ns, keys).num_hit_chunks == N
        assert torch.equal(c.get_chunks(ns, keys[-1:])[0], KVS[-1])
        assert c.clear(ns) == N


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_put_of_one_chunk_past_the_body_limit_names_both_sizes(daemon, kind):
    kv = torch.zeros(BIG.layout.shape(), dtype=torch.float16)
    keys = BIG.chunk_keys(list(range(128)))
    c = _sync(daemon, kind)
    try:
        with pytest.raises(ChunkTooLarge) as e:
            c.put_chunks(BIG, keys, [kv])
        assert e.value.max_body_bytes == BODY and e.value.nbytes >= kv.nbytes > BODY
        assert c.exists(BIG, keys) == [False]
    finally:
        c.close()


def test_the_async_clients_first_calls_past_the_limits(daemon):
    ns = Namespace("first-put-async", NS.layout)
    keys = ns.chunk_keys(list(range(4 * N)))

    async def fresh(what):
        c = AsyncKVStoreClient(daemon[0], timeout_s=10)
        try:
            return await what(c)
        finally:
            await c.close()

    async def go():
        got = await fresh(lambda c: c.get_chunks(NS, KEYS))
        assert [g is None for g in got] == [i >= 30 for i in range(N)]
        assert all(torch.equal(g, kv) for g, kv in zip(got[:30], KVS))
        r = await fresh(lambda c: c.lookup_keys(NS, KEYS))
        assert (r.num_hit_chunks, r.num_requested_chunks) == (30, N)
        assert await fresh(lambda c: c.exists(NS, KEYS)) == [i < 30 for i in range(N)]
        assert await fresh(lambda c: c.put_chunks(ns, keys, KVS)) == N
        assert (await fresh(lambda c: c.lookup_keys(ns, keys))).num_hit_chunks == N
        big = torch.zeros(BIG.layout.shape(), dtype=torch.float16)
        with pytest.raises(ChunkTooLarge):
            await fresh(lambda c: c.put_chunks(BIG, BIG.chunk_keys(list(range(128))), [big]))
        assert await fresh(lambda c: c.clear(ns)) == N
    asyncio.run(go())


@pytest.mark.parametrize("kind", ["shm", "unix"])
def test_limits_known_too_high_are_relearned_from_the_413(daemon, kind):
    """Limits learned from an earlier daemon start (here: set too high by hand on a live
    connection, as a restart with a lower ``--max-batch-keys`` leaves them): the 413 names
    the daemon's limit and the call is split and answered, nothing lost or reordered."""
    c = _sync(daemon, kind)
    try:
        shm = c._shm if kind == "unix" else c
        assert c.exists(NS, KEYS[:2]) == [True, True]  # (learns the limits, pools a conn)
        shm.limits = DaemonLimits(BODY, 1000)
        with c.get_borrowed(NS, KEYS) as b:
            _check_parts(b.parts)
        assert shm.limits == LIMITS
        shm.limits = DaemonLimits(BODY, 1000)
        r = c.lookup_keys(NS, KEYS)
        assert (r.num_hit_chunks, r.num_requested_chunks, len(r.tiers)) == (30, N, 30)
        assert shm.limits == LIMITS
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["unix", "http"])
def test_request_limits_asks_a_fresh_client_once(daemon, kind):
    with _sync(daemon, kind) as c:
        assert c.limits is None
        assert c.request_limits(timeout_s=5) == LIMITS
        assert c.limits == LIMITS
    with KVStoreClient(f"http://127.0.0.1:{free_port()}", timeout_s=2) as dead:
        assert dead.request_limits(timeout_s=1) is None  # (nothing listens: never raises)
