"""The daemon's HTTP surface, in process: every operation, every bad input, the server stays up.

The server runs on a private loop thread (``ThreadedServer``) over a real ``ChunkStore``; raw
requests go through ``http.client`` / sockets so malformed input reaches the server unaltered.
The in-flight byte budget, which a test holds on the server's own loop, is tested in ``async def``
tests through aiohttp's ``TestClient``.
"""
import asyncio
import http.client
import json
import socket
import threading
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

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("tiny-model", LAYOUT)
OTHER = Namespace("tiny-model", LAYOUT, cache_salt="tenant-b")
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_store(disk_path=None, cpu_bytes=1 << 20, disk_bytes=64 << 20) -> ChunkStore:
    """A real ChunkStore: a CPU tier, plus a disk tier when ``disk_path`` is given."""
    return ChunkStore(StoreConfig(cpu_bytes=cpu_bytes, page_bytes=256, disk_path=disk_path,
                                  disk_bytes=disk_bytes if disk_path else 0))


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


KEYS = NS.chunk_keys(list(range(4 * 6)))  # 6 chained chunk keys


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = make_store(str(tmp_path_factory.mktemp("disk")))
    limits = ServerLimits(auth_token=TOKEN, max_body_bytes=4096, max_batch_keys=8,
                          max_lease_s=1.0)
    srv = ThreadedServer(create_app(store, limits))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


@pytest.fixture(autouse=True)
def _clean(server):
    server.store.clear()
    yield
    assert request(server, "GET", "/healthz")[0] == 200  # the server stays up after every test


def request(srv, method, path, body=None, headers=None, auth=True):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    hdrs = dict(AUTH if auth else {})
    hdrs.update(headers or {})
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, resp


def post_json(srv, path, obj, **kw):
    status, data, _ = request(srv, "POST", path, json.dumps(obj).encode(),
                              {"Content-Type": "application/json"}, **kw)
    return status, json.loads(data) if data.startswith(b"{") else data


def put_body(keys, kvs, ns=NS, durable=False, corrupt=None):
    parts = [P.entry_for(k, kv) for k, kv in zip(keys, kvs)]
    entries = [e for e, _ in parts]
    if corrupt is not None:  # header claims a checksum the payload does not have
        e = entries[corrupt]
        entries[corrupt] = P.ChunkEntry(e.key, e.nbytes, e.dtype, e.shape, "0" * 16)
    return P.put_header(ns, entries, durable) + b"".join(bytes(v) for _, v in parts)


def do_put(srv, body, **kw):
    status, data, _ = request(srv, "POST", "/v1/put", body,
                              {"Content-Type": P.BINARY_CONTENT_TYPE}, **kw)
    return status, json.loads(data)


def do_get(srv, keys, ns=NS):
    status, data, _ = request(srv, "POST", "/v1/get", P.key_request(ns, keys),
                              {"Content-Type": "application/json"})
    if status != 200:
        return status, json.loads(data)
    return status, parse_get_body(data, ns, keys)


def parse_get_body(data: bytes, ns, keys) -> list:
    """Chunks (``ns.layout.shape()``, fp16) or None per key of a whole get response body;
    asserts every checksum and that the body ends after the last payload."""
    hdr_len = P.decode_preamble(data[:8])
    entries = P.parse_get_response_header(json.loads(data[8:8 + hdr_len]), ns, keys)
    out, pos = [], 8 + hdr_len
    for e in entries:
        if not e.found:
            out.append(None)
            continue
        raw = bytearray(data[pos:pos + e.nbytes])
        pos += e.nbytes
        assert P.checksum(raw) == e.xxh3
        out.append(torch.frombuffer(raw, dtype=torch.float16).reshape(ns.layout.shape()))
    assert pos == len(data)
    return out


def stored(srv, keys, ns=NS):
    return post_json(srv, "/v1/exists", {"namespace": ns.to_dict(),
                                         "keys": [k.hex() for k in keys]})[1]["exists"]


def test_put_then_get_is_bit_exact_and_lookup_counts_leading_chunks(server):
    kvs = [chunk(i) for i in range(3)]
    status, ans = do_put(server, put_body(KEYS[:3], kvs))
    assert (status, ans) == (200, {"stored": 3, "num_chunks": 3, "durable": False})
    assert do_put(server, put_body(KEYS[:3], kvs))[1]["stored"] == 0  # present keys skipped
    status, got = do_get(server, [KEYS[0], KEYS[4], KEYS[2]])
    assert status == 200
    assert torch.equal(got[0], kvs[0]) and got[1] is None and torch.equal(got[2], kvs[2])
    status, res = post_json(server, "/v1/lookup", {"namespace": NS.to_dict(),
                                                   "keys": [k.hex() for k in KEYS]})
    assert status == 200
    assert res == {"num_hit_chunks": 3, "chunk_size": 4, "tiers": ["cpu"] * 3,
                   "num_requested_chunks": 6}
    assert stored(server, KEYS[2:5]) == [True, False, False]


def test_missing_keys_get_404_never_an_empty_200(server):
    status, ans = do_get(server, KEYS[:2])
    assert status == 404
    assert ans == {"error": "none of the 2 keys is stored", "status": 404}


def test_get_of_no_keys_is_400_and_other_routes_answer_empty_batches_trivially(server):
    status, ans = do_get(server, [])
    assert (status, ans) == (400, {"error": "'keys' must be a non-empty list", "status": 400})
    body = {"namespace": NS.to_dict(), "keys": []}
    assert post_json(server, "/v1/lookup", body) == (200, {
        "num_hit_chunks": 0, "chunk_size": 4, "tiers": [], "num_requested_chunks": 0})
    assert post_json(server, "/v1/exists", body) == (200, {"exists": []})
    assert post_json(server, "/v1/remove", body) == (200, {"removed": 0})
    status, ans = do_put(server, P.put_header(NS, []))
    assert (status, ans["error"]) == (400, "'chunks' must be a non-empty list")


def test_remove_and_clear_per_namespace(server):
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    other_keys = OTHER.chunk_keys(list(range(8)))
    assert do_put(server, put_body(other_keys, [chunk(2), chunk(3)], ns=OTHER))[0] == 200
    assert post_json(server, "/v1/remove", {"namespace": NS.to_dict(),
                                            "keys": [KEYS[0].hex(), KEYS[5].hex()]}) \
        == (200, {"removed": 1})
    assert post_json(server, "/v1/clear", {"namespace": OTHER.to_dict()}) == (200, {"removed": 2})
    assert stored(server, KEYS[:2]) == [False, True]
    assert stored(server, other_keys, ns=OTHER) == [False, False]
    assert post_json(server, "/v1/clear", {"all": True}) == (200, {"removed": 1})


def test_tenants_cannot_name_each_others_keys(server):
    assert do_put(server, put_body(KEYS[:1], [chunk(0)]))[0] == 200
    status, ans = post_json(server, "/v1/exists", {"namespace": OTHER.to_dict(),
                                                   "keys": [KEYS[0].hex()]})
    assert status == 400 and "does not belong" in ans["error"]
    status, ans = do_put(server, put_body(KEYS[1:2], [chunk(1)], ns=OTHER))
    assert status == 400 and "does not belong" in ans["error"]


def test_malformed_json_and_framing_get_400_json_errors(server):
    status, data, _ = request(server, "POST", "/v1/lookup", b"{nope",
                              {"Content-Type": "application/json"})
    assert status == 400 and json.loads(data)["error"].startswith("malformed JSON in request")
    status, ans = do_put(server, b"GARBAGE!" + b"x" * 40)
    assert status == 400 and ans["error"].startswith("bad magic")
    status, ans = do_put(server, put_body(KEYS[:1], [chunk(0)])[:-10])  # short payload
    assert status == 400 and ans["error"] == "body is 657 bytes but its header declares 667"
    status, ans = post_json(server, "/v1/lookup", {"namespace": {"model_id": "x"}, "keys": []})
    assert status == 400 and ans["error"].startswith("bad namespace")
    status, data, _ = request(server, "POST", "/v1/exists", P.key_request(NS, KEYS[:1]),
                              {P.VERSION_HEADER: "9"})
    assert status == 400 and "unsupported protocol version 9" in json.loads(data)["error"]


def test_empty_wrongly_sized_and_oversized_bodies(server):
    status, ans = do_put(server, b"")
    assert (status, ans["error"]) == (400, "empty put body")
    status, ans = do_put(server, put_body(KEYS[:1], [chunk(0)]) + b"extra")
    assert status == 400 and "declares" in ans["error"]
    big = torch.zeros(LAYOUT.shape(), dtype=torch.float32)  # 2x the bytes the layout allows
    entry, view = P.entry_for(KEYS[0], big)
    status, ans = do_put(server, P.put_header(NS, [entry]) + bytes(view))
    assert status == 400 and ans["error"].startswith("dtype mismatch")
    status, ans = do_put(server, put_body(KEYS[:6], [chunk(i) for i in range(6)]) + b"x" * 4096)
    assert status == 413 and "exceeds 4096" in ans["error"]
    status, ans = post_json(server, "/v1/exists", {"namespace": NS.to_dict(),
                                                   "keys": [KEYS[0].hex()] * 9})
    assert status == 413 and "limit of 8" in ans["error"]
    assert stored(server, KEYS) == [False] * 6


def test_wrong_or_missing_token_gets_401_but_health_is_open(server):
    status, data, _ = request(server, "GET", "/v1/stats", auth=False)
    assert status == 401 and json.loads(data)["error"] == "missing or wrong bearer token"
    status, data, _ = request(server, "GET", "/v1/stats", headers={"Authorization": "Bearer x"},
                              auth=False)
    assert status == 401
    status, ans = do_put(server, put_body(KEYS[:1], [chunk(0)]),
                         auth=False)
    assert status == 401 and stored(server, KEYS[:1]) == [False]
    assert request(server, "GET", "/healthz", auth=False)[0] == 200
    assert request(server, "GET", "/readyz", auth=False)[0] == 200
    status, data, _ = request(server, "GET", "/metrics", auth=False)  # metrics need it too
    assert status == 401 and json.loads(data)["error"] == "missing or wrong bearer token"
    status, data, _ = request(server, "GET", "/metrics")
    assert status == 200 and b"kvstore_server_requests_total" in data


def test_checksum_mismatch_is_400_and_nothing_of_the_batch_is_stored(server):
    status, ans = do_put(server, put_body(KEYS[:3], [chunk(i) for i in range(3)], corrupt=2))
    assert status == 400 and ans["error"].startswith("checksum mismatch for key")
    assert stored(server, KEYS[:3]) == [False, False, False]
    assert server.store.tiers[0].used_bytes == 0  # the reserved pages went back
    server.store.check_integrity()


def test_client_disconnecting_mid_upload_leaves_nothing_visible(server):
    body = put_body(KEYS[:4], [chunk(i) for i in range(4)])
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(f"POST /v1/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) - 300])
        time.sleep(0.2)
    time.sleep(0.2)
    assert stored(server, KEYS[:4]) == [False] * 4
    assert server.store.tiers[0].used_bytes == 0  # the reserved pages went back
    server.store.check_integrity()


def test_two_concurrent_puts_of_one_key_leave_exactly_one_complete_value(server):
    a, b = chunk(10), chunk(11)
    results = []
    threads = [threading.Thread(target=lambda kv=kv: results.append(
        do_put(server, put_body(KEYS[:1], [kv])))) for kv in (a, b) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 for s, _ in results)
    assert sum(ans["stored"] for _, ans in results) == 1
    status, got = do_get(server, KEYS[:1])
    assert torch.equal(got[0], a) or torch.equal(got[0], b)


def test_pins_hold_leases_capped_by_the_server_and_expire_when_the_client_vanishes(server):
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                "keys": [KEYS[0].hex(), KEYS[3].hex()]})
    assert (status, ans) == (200, {"pinned": 1, "lease_s": 1.0})  # capped at max_lease_s
    status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                "keys": [KEYS[1].hex()], "lease_s": 0.2})
    assert (status, ans) == (200, {"pinned": 1, "lease_s": 0.2})
    assert [server.store.pin_count(k) for k in KEYS[:2]] == [1, 1]
    assert post_json(server, "/v1/unpin", {"namespace": NS.to_dict(),
                                           "keys": [KEYS[0].hex()]}) == (200, {"unpinned": 1})
    time.sleep(0.3)  # the pinning client is gone; its lease runs out
    assert [server.store.pin_count(k) for k in KEYS[:2]] == [0, 0]
    status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                "keys": [KEYS[1].hex()], "lease_s": -1})
    assert status == 400 and "lease_s must be a positive number" in ans["error"]


def test_nan_or_boolean_lease_is_400_and_pins_nothing(server):
    assert do_put(server, put_body(KEYS[:1], [chunk(0)]))[0] == 200
    for lease in (float("nan"), True):  # json.dumps writes NaN, which the server's parser reads
        status, ans = post_json(server, "/v1/pin", {"namespace": NS.to_dict(),
                                                    "keys": [KEYS[0].hex()], "lease_s": lease})
        assert status == 400 and "lease_s must be a positive number" in ans["error"]
    assert server.store.pin_count(KEYS[0]) == 0


def test_namespace_whose_chunk_exceeds_every_tier_is_400_not_500(server):
    big = Namespace("tiny-model", KVLayout(num_layers=100_000, num_kv_heads=1, head_dim=8,
                                           dtype="float16", chunk_size=4))  # 12.8 MB > 1 MiB tier
    keys = big.chunk_keys(list(range(4)))
    for path in ("/v1/lookup", "/v1/get", "/v1/exists", "/v1/pin"):
        status, ans = post_json(server, path, {"namespace": big.to_dict(),
                                               "keys": [k.hex() for k in keys]})
        assert status == 400, (path, status, ans)
        assert "smaller than one chunk" in ans["error"]
    e = P.ChunkEntry(keys[0], big.layout.chunk_bytes, "float16", big.layout.shape(), "0" * 16)
    status, ans = do_put(server, P.put_header(big, [e]))  # refused before any payload is read
    assert status == 400 and "smaller than one chunk" in ans["error"]


def test_durable_put_is_committed_to_the_disk_tier_before_the_answer(server):
    kvs = [chunk(20), chunk(21)]
    status, ans = do_put(server, put_body(KEYS[:2], kvs, durable=True))
    assert (status, ans) == (200, {"stored": 2, "num_chunks": 2, "durable": True})
    disk = server.store.tiers[-1]
    assert disk.name == "disk" and all(disk.contains(k) and not disk.is_pending(k)
                                       for k in KEYS[:2])
    assert torch.equal(disk.read(KEYS[1]), kvs[1])


def test_durable_put_without_a_disk_tier_is_refused_and_nothing_stored():
    store = make_store()
    with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
        status, ans = do_put(srv, put_body(KEYS[:1], [chunk(0)], durable=True))
        assert status == 400 and ans["error"].startswith("durable put needs a disk tier")
        assert stored(srv, KEYS[:1]) == [False]
    store.close()


def test_stats_metrics_and_unknown_routes(server):
    do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))
    post_json(server, "/v1/lookup", {"namespace": NS.to_dict(), "keys": [KEYS[0].hex()]})
    status, data, _ = request(server, "GET", "/v1/stats")
    st = json.loads(data)
    assert status == 200 and st["server"]["protocol_version"] == 1
    assert st["server"]["max_batch_keys"] == 8
    status, data, resp = request(server, "GET", "/metrics")
    text = data.decode()
    assert status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    assert 'kvstore_server_requests_total{route="/v1/put",status="200"}' in text
    assert "kvstore_server_request_duration_seconds_bucket" in text
    assert "\nkvstore_lookups_total " in text and 'kvstore_capacity_bytes{tier="cpu"} 1.048576e+06' in text
    status, data, _ = request(server, "GET", "/nope")
    assert status == 404 and json.loads(data)["status"] == 404
    status, data, _ = request(server, "GET", "/v1/put")
    assert status == 405 and json.loads(data)["status"] == 405


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
