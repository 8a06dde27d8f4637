"""The daemon's request buffers, in process: the in-flight byte budget, the staging-buffer pool, and
the direct I/O path that reads puts into and sends gets from the CPU tier's pages.

The byte budget, which a test holds on the server's own loop, is tested in ``async def`` tests
through aiohttp's ``TestClient``; the rest goes through ``http.client`` to a ``ThreadedServer``.
"""
import asyncio
import json
import time

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import STATE_KEY, ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore

from tests.kvstore.daemon.server_helpers import (
    AUTH, KEYS, LAYOUT, NS, TOKEN, chunk, do_get, do_put, make_store, parse_get_body, put_body,
    stored,
)
from tests.kvstore.daemon.server_helpers import _clean, server  # noqa: F401  (fixtures)


@pytest.mark.asyncio
async def test_byte_budget_waits_in_order_admits_oversize_alone_and_times_out_with_503():
    from kvstore.daemon.server import ByteBudget

    b = ByteBudget(100)
    await b.acquire(60, 1)
    waiter = asyncio.create_task(b.acquire(60, 1))
    await asyncio.sleep(0.01)
    assert not waiter.done() and b.held == 60
    b.release(60)
    await waiter
    assert (b.held, b.peak) == (60, 60)
    with pytest.raises(P.ProtocolError, match="server busy") as e:
        await b.acquire(50, 0.05)
    assert e.value.status == 503 and b.held == 60 and not b._waiters
    b.release(60)
    await b.acquire(250, 1)  # larger than the whole budget: admitted when alone
    assert (b.held, b.peak) == (250, 250)
    b.release(250)
    assert b.held == 0


@pytest.mark.asyncio
async def test_requests_beyond_the_inflight_byte_budget_wait_then_get_503_and_store_nothing():
    store = make_store()
    limits = ServerLimits(auth_token=TOKEN, max_inflight_bytes=LAYOUT.chunk_bytes,
                          request_timeout_s=0.5)
    app = create_app(store, limits)
    # the staging path (stores without direct I/O, durable puts); direct puts and gets of
    # CPU-tier chunks take no budget (test_direct_io_...)
    app[STATE_KEY].direct = False
    budget = app[STATE_KEY].budget

    async def put(keys, kvs):
        resp = await cli.post("/v1/put", data=put_body(keys, kvs),
                              headers={**AUTH, "Content-Type": P.BINARY_CONTENT_TYPE})
        return resp.status, await resp.json()

    async def post_keys(route, keys):
        resp = await cli.post(route, data=P.key_request(NS, keys),
                              headers={**AUTH, "Content-Type": "application/json"})
        return resp.status, await resp.read()
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as cli:
            await budget.acquire(LAYOUT.chunk_bytes, 1)  # held: the put below must wait
            t0 = time.monotonic()
            status, ans = await put(KEYS[:1], [chunk(0)])
            assert status == 503 and ans["error"].startswith("server busy")
            assert 0.4 < time.monotonic() - t0 < 2
            status, data = await post_keys("/v1/exists", KEYS[:1])
            assert json.loads(data)["exists"] == [False]
            budget.release(LAYOUT.chunk_bytes)
            assert (await put(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200  # 2x budget: alone
            status, data = await post_keys("/v1/get", KEYS[:2])
            assert status == 200 and torch.equal(parse_get_body(data, NS, KEYS[:2])[1], chunk(1))
            resp = await cli.get("/v1/stats", headers=AUTH)
            server_st = (await resp.json())["server"]
            assert (server_st["inflight_bytes"], server_st["max_inflight_bytes"]) == \
                (0, LAYOUT.chunk_bytes)
            assert server_st["inflight_bytes_peak"] == 2 * LAYOUT.chunk_bytes
    finally:
        store.close()


@pytest.mark.asyncio
async def test_a_get_refused_503_for_budget_gives_back_only_what_it_took(tmp_path):
    """A direct get of disk-tier chunks waits for payload budget; one that gets 503 took
    none and gives none back: ``held`` stays what the other requests hold."""
    store = make_store(disk_path=str(tmp_path / "disk"), cpu_bytes=2 * LAYOUT.chunk_bytes)
    app = create_app(store, ServerLimits(auth_token=TOKEN, max_inflight_bytes=LAYOUT.chunk_bytes,
                                         request_timeout_s=0.3))
    budget = app[STATE_KEY].budget

    async def get(keys):
        resp = await cli.post("/v1/get", data=P.key_request(NS, keys),
                              headers={**AUTH, "Content-Type": "application/json"})
        return resp.status, await resp.read()
    try:
        assert app[STATE_KEY].direct
        store.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)])
        store.put_chunks(NS, NS.chunk_keys(list(range(100, 108))), [chunk(2), chunk(3)])
        assert store.flush(10) and store.lookup_keys(NS, KEYS[:1]).tiers == ("disk",)
        async with TestClient(TestServer(app, host="127.0.0.1")) as cli:
            await budget.acquire(LAYOUT.chunk_bytes, 1)  # another request's bytes in flight
            status, data = await get(KEYS[:1])
            assert status == 503 and b"server busy" in data
            assert budget.held == LAYOUT.chunk_bytes  # (was 0: it gave back what it never took)
            budget.release(LAYOUT.chunk_bytes)
            status, data = await get(KEYS[:1])
            assert status == 200 and torch.equal(parse_get_body(data, NS, KEYS[:1])[0], chunk(0))
            assert budget.held == 0
    finally:
        store.close()


@pytest.fixture
def staging(server):
    """The server's staging-buffer path (used for stores without direct I/O and durable puts)."""
    state = server.app[STATE_KEY]
    assert state.direct
    state.direct = False
    yield server
    state.direct = True


def test_put_and_get_buffers_are_reused_and_data_stays_bit_exact(staging):
    server = staging
    state = server.app[STATE_KEY]
    assert state.reuse_put_buffers and state.get_into_buffers
    kvs = [chunk(10 + i) for i in range(3)]
    assert do_put(server, put_body(KEYS[:3], kvs))[0] == 200
    pooled = state.buffers.pooled
    assert pooled >= 3 * LAYOUT.chunk_bytes  # the store copied; the buffers were pooled
    for _ in range(3):  # each get reuses the pooled buffers; answers never mix up
        status, got = do_get(server, KEYS[:3])
        assert status == 200 and all(torch.equal(g, k) for g, k in zip(got, kvs))
        deadline = time.monotonic() + 2  # buffers go back just after the last byte is sent
        while state.buffers.pooled != pooled and time.monotonic() < deadline:
            time.sleep(0.005)
        assert state.buffers.pooled == pooled  # taken from the pool and given back
    status, got = do_get(server, [KEYS[2], KEYS[0]])
    assert torch.equal(got[0], kvs[2]) and torch.equal(got[1], kvs[0])


def test_direct_io_puts_and_gets_use_no_staging_buffer_and_no_byte_budget(server, monkeypatch):
    state = server.app[STATE_KEY]
    assert state.direct

    def forbidden(*a, **k):
        raise AssertionError("staging path used")
    monkeypatch.setattr(state.buffers, "take", forbidden)
    monkeypatch.setattr(state.budget, "acquire", forbidden)
    kvs = [chunk(20 + i) for i in range(3)]
    status, ans = do_put(server, put_body(KEYS[:3], kvs))
    assert status == 200 and ans["stored"] == 3
    assert server.store.tiers[0].num_chunks == 3
    status, got = do_get(server, [KEYS[2], KEYS[5], KEYS[0]])
    assert status == 200 and got[1] is None
    assert torch.equal(got[0], kvs[2]) and torch.equal(got[2], kvs[0])
    deadline = time.monotonic() + 2  # reader pins go just after the last byte is sent
    while server.store.pin_count(KEYS[0]) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.store.pin_count(KEYS[0]) == 0
    server.store.check_integrity()


def test_direct_put_and_get_of_a_chunk_spread_over_non_adjacent_pages():
    small = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=2)
    ns2 = Namespace("tiny-model", small)
    store = ChunkStore(StoreConfig(cpu_bytes=12 * 64, page_bytes=64))
    cpu = store.tiers[0]
    k2 = ns2.chunk_keys(list(range(8)))  # 4 chunks of 128 bytes = 2 pages each
    g = torch.Generator().manual_seed(3)
    store.put_chunks(ns2, k2, [torch.randn(small.shape(), generator=g).half() for _ in k2])
    store.remove(ns2, [k2[0], k2[2]])  # frees pages 0-1 and 4-5: no 4 adjacent free pages
    with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
        srv.store = store
        kv = chunk(42)  # 256 bytes = 4 pages
        status, ans = do_put(srv, put_body(KEYS[:1], [kv]))
        assert status == 200 and ans["stored"] == 1
        assert len(cpu.entry_runs(KEYS[0])) == 2  # really split over two runs
        status, got = do_get(srv, KEYS[:1])
        assert status == 200 and torch.equal(got[0], kv)
    store.check_integrity()
    store.close()


def test_direct_get_reads_chunks_spilled_to_disk_and_counts_hits(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=2 * 256, page_bytes=256, disk_path=str(tmp_path),
                                   disk_bytes=64 << 20, promote_on_hit=False))
    with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
        srv.store = store
        kvs = [chunk(50 + i) for i in range(4)]
        assert do_put(srv, put_body(KEYS[:4], kvs))[0] == 200
        store.flush(10)
        assert [t.name for t in store.tiers] == ["cpu", "disk"]
        assert not store.tiers[0].contains(KEYS[0]) and store.tiers[1].contains(KEYS[0])
        status, got = do_get(srv, KEYS[:5])
        assert status == 200 and got[4] is None
        assert all(torch.equal(g, k) for g, k in zip(got, kvs))
        st = store.stats()
        assert st["hits_by_tier"] == {"cpu": 2, "disk": 2} and st["misses"] == 1
        deadline = time.monotonic() + 2
        while any(store.pin_count(k) for k in KEYS[:4]) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert all(store.pin_count(k) == 0 for k in KEYS[:4])
    store.close()


def test_put_finding_the_cpu_tier_full_of_pinned_chunks_is_read_and_dropped_not_staged(
        monkeypatch):
    store = make_store(cpu_bytes=2 * LAYOUT.chunk_bytes)  # room for 2 chunks, no lower tier
    with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
        srv.store = store
        state = srv.app[STATE_KEY]
        assert do_put(srv, put_body(KEYS[:2], [chunk(0), chunk(1)]))[1]["stored"] == 2
        assert store.pin(NS, KEYS[:2]) == 2

        def forbidden(*a, **k):
            raise AssertionError("staging path used")
        monkeypatch.setattr(state.buffers, "take", forbidden)
        status, ans = do_put(srv, put_body(KEYS[:3], [chunk(0), chunk(1), chunk(2)]))
        assert status == 200 and (ans["stored"], ans["num_chunks"]) == (0, 3)
        assert store.stats()["rejected_chunks"] == 1 and stored(srv, KEYS[2:3]) == [False]
        status, ans = do_put(srv, put_body(KEYS[2:3], [chunk(2)], corrupt=0))
        assert status == 400 and ans["error"].startswith("checksum mismatch")  # still checked
        store.unpin(NS, KEYS[:2])
        # unpinned, chunk 3 still finds no room: only its own prefix could make it, and
        # evicting that would strand it (kvstore.movement)
        status, ans = do_put(srv, put_body(KEYS[:3], [chunk(0), chunk(1), chunk(2)]))
        assert status == 200 and ans["stored"] == 0
        other = NS.chunk_keys(list(range(500, 500 + 2 * LAYOUT.chunk_size)))  # another prompt
        status, ans = do_put(srv, put_body(other, [chunk(2), chunk(3)]))
        assert status == 200 and ans["stored"] == 2 and stored(srv, KEYS[:2]) == [False, False]
        status, got = do_get(srv, other[1:2])
        assert torch.equal(got[0], chunk(3))
        store.check_integrity()
    store.close()
