"""``KVStoreClient`` / ``AsyncKVStoreClient``: the in-process store's surface over the wire
(the ``client`` tests run over HTTP and over the daemon's Unix socket, discovered), deadlines
against dead, hung and restarting servers, retries only where safe."""
import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestServer

from kvstore.api import LookupResult, PrefixStore
from kvstore.config import StoreConfig
from kvstore.daemon.client import AsyncKVStoreClient, KVStoreClient, RemoteError, StoreUnavailable
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import LAYOUT, NS, OTHER, chunk, make_store

ROOT = Path(__file__).resolve().parents[3]

KEYS = NS.chunk_keys(list(range(4 * 6)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The daemon over HTTP and over its Unix socket (a shared CPU arena, a disk tier)."""
    d = tmp_path_factory.mktemp("daemon")
    store = ChunkStore(StoreConfig(cpu_bytes=64 << 20, cpu_shared=True, page_bytes=256,
                                   disk_path=str(d / "disk"), disk_bytes=64 << 20))
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token="tok", max_lease_s=5.0)),
                         unix_socket=str(d / "kv.sock"))
    srv.store, srv.sock_path = store, d / "kv.sock"
    yield srv
    srv.stop()
    store.close()


@pytest.fixture(params=["http", "unix"])
def client(server, request):
    """The same tests on both paths: HTTP, and the Unix socket the client discovers."""
    server.store.clear()
    with KVStoreClient(server.url, auth_token="tok", timeout_s=5.0,
                       same_host=request.param == "unix") as c:
        c.whoami()  # the first call picks the path
        assert c.transport == request.param
        yield c


def test_sync_client_has_the_store_surface_bit_exact(client):
    kvs = [chunk(i) for i in range(4)]
    assert client.put_chunks(NS, KEYS[:4], kvs) == 4
    assert client.put_chunks(NS, KEYS[:4], kvs) == 0
    got = client.get_chunks(NS, KEYS[:5])
    assert all(torch.equal(g, kv) for g, kv in zip(got[:4], kvs)) and got[4] is None
    assert got[0].shape == (2, 2, 4, 1, 8) and got[0].dtype == torch.float16
    assert client.lookup_keys(NS, KEYS) == LookupResult(4, 4, ("cpu",) * 4, 6)
    assert client.exists(NS, KEYS[3:5]) == [True, False]
    assert client.get_chunks(NS, KEYS[4:6]) == [None, None]  # a 404 is all misses
    assert client.pin(NS, KEYS[:2], lease_s=1.0) == 2
    assert client.unpin(NS, KEYS[:2]) == 2
    assert client.remove(NS, KEYS[3:5]) == 1
    assert client.clear(NS) == 3
    assert client.exists(NS, KEYS[:4]) == [False] * 4
    assert client.stats()["server"]["protocol_version"] == 1
    assert "kvstore_server_requests_total" in client.metrics_text()
    assert client.healthy()


def test_prefix_store_works_over_the_client(client):
    ps = PrefixStore(client, NS)
    tokens = list(range(100, 114))  # 3 full chunks + 2 tokens
    kv = torch.randn(LAYOUT.shape(14)).to(torch.float16)  # [2, 2, 14, 1, 8]
    assert ps.put(tokens, kv) == 3
    assert ps.lookup(tokens).num_hit_tokens == 12
    assert torch.equal(ps.get(tokens, 12), kv[:, :, :12])


def test_bad_tensors_are_refused_before_sending_and_errors_are_typed(client, server):
    with pytest.raises(ValueError, match="KV dtype mismatch"):
        client.put_chunks(NS, KEYS[:1], [chunk(0).float()])
    with pytest.raises(ValueError, match="1 keys but 2 tensors"):
        client.put_chunks(NS, KEYS[:1], [chunk(0), chunk(1)])
    with pytest.raises(RemoteError) as e:
        client.exists(OTHER, KEYS[:1])
    assert e.value.status == 400 and "does not belong" in e.value.message
    with KVStoreClient(server.url, auth_token="wrong", timeout_s=2) as bad:
        with pytest.raises(RemoteError) as e:
            bad.stats()
        assert e.value.status == 401


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
def test_a_deadline_that_is_not_a_positive_number_is_a_value_error(client, server, bad):
    """Such a deadline passed before the first attempt and was reported as a dead daemon."""
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        client.put_chunks(NS, KEYS[:1], [chunk(0)], timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        client.lookup_keys(NS, KEYS[:1], timeout_s=bad)
    url = server.url if client.transport == "http" else "unix://" + str(server.sock_path)
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        KVStoreClient(url, auth_token="tok", timeout_s=bad)
    assert client.exists(NS, KEYS[:1]) == [False]


def test_keys_that_are_not_chunk_keys_are_refused_as_in_process(client):
    """Raw bytes were sent as a key of whatever namespace their first 16 bytes name."""
    raw = [bytes(k) for k in KEYS[:2]]
    with pytest.raises(ValueError, match="expected ChunkKey, got bytes"):
        client.put_chunks(NS, raw, [chunk(0), chunk(1)])
    for op in (client.lookup_keys, client.exists, client.get_chunks, client.remove):
        with pytest.raises(ValueError, match="expected ChunkKey, got bytes"):
            op(NS, raw)
    assert client.exists(NS, KEYS[:2]) == [False, False]


def test_real_model_sized_chunks_stream_bit_exact(client):
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", chunk_size=256)
    ns = Namespace("smollm2-135m", lay)
    keys = ns.chunk_keys(list(range(512)))
    kvs = [torch.randn(lay.shape()).to(torch.float16) for _ in keys]  # [30, 2, 256, 3, 64]
    assert lay.chunk_bytes == 5_898_240
    assert client.put_chunks(ns, keys, kvs, durable=True) == 2
    got = client.get_chunks(ns, keys)
    assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))


@pytest.mark.asyncio
async def test_async_client_concurrent_calls_share_one_pool(tmp_path):
    """The async client on the loop it runs on, against the daemon app in aiohttp's
    ``TestServer`` on that same loop."""
    store = make_store(str(tmp_path / "disk"), cpu_bytes=64 << 20)
    app = create_app(store, ServerLimits(auth_token="tok", max_lease_s=5.0))
    try:
        async with TestServer(app, host="127.0.0.1") as ts:
            c = AsyncKVStoreClient(str(ts.make_url("")).rstrip("/"), auth_token="tok",
                                   pool_size=4)
            try:
                await asyncio.gather(*(c.put_chunks(NS, [k], [chunk(i)])
                                       for i, k in enumerate(KEYS)))
                got = await asyncio.gather(*(c.get_chunks(NS, [k]) for k in KEYS))
            finally:
                await c.close()
    finally:
        store.close()
    assert all(torch.equal(g[0], chunk(i)) for i, g in enumerate(got))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server_fails_fast_with_a_timeout_error_well_inside_the_deadline():
    # nothing listens: the connection is refused, 2 tries 50 ms apart, not 5 s of retries
    with KVStoreClient(f"http://127.0.0.1:{_free_port()}", timeout_s=5.0) as c:
        for call in (lambda: c.lookup_keys(NS, KEYS), lambda: c.pin(NS, KEYS[:1], 1.0),
                     lambda: c.stats()):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"connection refused \(2 tries\); is "
                                                       "the kvstore daemon running"):
                call()
            assert 0.04 < time.monotonic() - t0 < 0.5
    with KVStoreClient(f"http://127.0.0.1:{_free_port()}", timeout_s=0.5,
                       refused_tries=None) as c:  # opt-in: retry refused until the deadline
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no answer within 0.5 s"):
            c.lookup_keys(NS, KEYS)
        assert 0.4 < time.monotonic() - t0 < 1.5
    with pytest.raises(ValueError, match="refused_tries"):
        KVStoreClient("http://127.0.0.1:1", refused_tries=0)


def test_hung_server_gives_a_timeout_error_within_the_deadline():
    with socket.socket() as lsock:  # accepts connections (backlog) but never answers
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(16)
        url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
        with KVStoreClient(url, timeout_s=0.5) as c:
            for call in (lambda: c.get_chunks(NS, KEYS[:1]),
                         lambda: c.put_chunks(NS, KEYS[:1], [chunk(0)]),
                         lambda: c.unpin(NS, KEYS[:1])):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    call()
                assert time.monotonic() - t0 < 1.5
            with pytest.raises(TimeoutError):  # StoreUnavailable is a TimeoutError
                c.exists(NS, KEYS[:1], timeout_s=0.2)
            with pytest.raises(StoreUnavailable, match=r"no answer within 0.2 s \(nothing "
                               r"answered: .* never replied\)"):
                c.lookup_keys(NS, KEYS, timeout_s=0.2)


def test_an_https_url_to_the_plain_http_daemon_fails_at_once_saying_so(server):
    """A TLS handshake with a plain HTTP server is not retried until the deadline; the error
    names the TLS failure and what to do, not aiohttp's object dump."""
    url = server.url.replace("http://", "https://")
    with KVStoreClient(url, auth_token="tok", timeout_s=5.0, same_host=False) as c:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as e:
            c.lookup_keys(NS, KEYS)
        assert time.monotonic() - t0 < 1.0
        msg = str(e.value)
        assert "TLS handshake failed (WRONG_VERSION_NUMBER)" in msg and "use http://" in msg
        assert "ConnectionKey" not in msg


def test_a_restarting_server_is_reached_by_retries_inside_the_deadline():
    port = _free_port()
    store = make_store()
    started = {}

    def start_later():
        time.sleep(0.6)
        started["srv"] = ThreadedServer(create_app(store), port=port)
    t = threading.Thread(target=start_later)
    t.start()
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0, refused_tries=None) as c:
            t0 = time.monotonic()
            assert c.put_chunks(NS, KEYS[:1], [chunk(7)]) == 1  # idempotent: retried
            assert 0.5 < time.monotonic() - t0 < 3.0
            assert torch.equal(c.get_chunks(NS, KEYS[:1])[0], chunk(7))
    finally:
        t.join()
        started["srv"].stop()
        store.close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8571/v1", "http://127.0.0.1:8571/v1/stats",
                                 "http://127.0.0.1:8571?x=1", "http://127.0.0.1:8571/#a"])
def test_a_url_with_a_path_is_refused_before_any_call(url):
    """``/v1`` in the URL made every route ``/v1/v1/...``: the daemon's 404s then read as
    answers (a put's missing ``stored``), so the store was off without a word."""
    with pytest.raises(ValueError, match=r"no path, query or fragment .*adds the routes"):
        KVStoreClient(url)
    from connectors.stores import StoreSpec
    with pytest.raises(ValueError, match="no path"):
        StoreSpec(url=url).check()
    assert KVStoreClient("http://127.0.0.1:8571/").url == "http://127.0.0.1:8571"


def test_a_client_left_open_exits_without_aiohttp_warnings(server):
    """A script that never closes its client (or drops it) exits quietly: no "Unclosed
    client session" / "Unclosed connector" noise on stderr."""
    script = (f"from kvstore.daemon.client import KVStoreClient\n"
              f"c = KVStoreClient({server.url!r}, auth_token='tok', same_host=False)\n"
              f"assert c.stats()['tiers']\n"
              f"d = KVStoreClient({server.url!r}, auth_token='tok', same_host=False)\n"
              f"d.stats(); del d\n"
              f"print('done')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-2000:]
    assert "Unclosed" not in proc.stderr, proc.stderr[-2000:]
