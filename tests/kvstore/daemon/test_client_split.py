"""Clients split calls to fit a real ``kvstore serve``'s ``--max-body-bytes`` and
``--max-batch-keys``: a put of more chunks or bytes than one request takes stores every chunk
(in order, parents first), lookups/gets/exists/removes of more keys than a batch answer as one
call would, and a single chunk larger than the body limit is refused with both sizes named.
Both paths: HTTP and the same-host Unix socket. Tiny layout (``server_helpers``: 256-byte
chunks)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile

import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.daemon.async_client import AsyncKVStoreClient
from kvstore.daemon.batches import ChunkTooLarge, DaemonLimits
from kvstore.daemon.client import KVStoreClient
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.daemon.server_helpers import NS, chunk

N = 400
KEYS = NS.chunk_keys(list(range(4 * N)))  # 400 chained chunk keys
BODY, BATCH = 4096, 8  # the daemon's limits: 256-byte chunks, so several requests per put
#: a namespace whose chunk (2 x 2 x 128 x 1 x 8 fp16 = 8 KiB) alone exceeds BODY
BIG = Namespace("tiny-model", KVLayout(num_layers=2, num_kv_heads=1, head_dim=8,
                                       dtype="float16", chunk_size=128))


@contextlib.contextmanager
def _serve(extra: list[str]):
    """``(http_url, unix_url)`` of a real ``kvstore serve`` run with ``extra`` arguments."""
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "kv.sock")
        proc = start(port, sock, extra)
        try:
            yield f"http://127.0.0.1:{port}", "unix://" + sock
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def daemon():
    """A real ``kvstore serve`` with small limits (``BODY``, ``BATCH``)."""
    with _serve(["--max-body-bytes", str(BODY), "--max-batch-keys", str(BATCH)]) as urls:
        yield urls


@pytest.fixture(params=["http", "unix"])
def client(request, daemon):
    url = daemon[0] if request.param == "http" else daemon[1]
    c = KVStoreClient(url, same_host=False, timeout_s=10)
    c.clear()
    yield c
    c.clear()
    c.close()


def test_a_put_past_both_limits_stores_every_chunk_in_order(client):
    kvs = [chunk(i) for i in range(N)]
    before = client.stats()["stored_chunks"]
    assert client.put_chunks(NS, KEYS, kvs) == N
    assert client.exists(NS, KEYS) == [True] * N
    r = client.lookup_keys(NS, KEYS)
    assert (r.num_hit_chunks, r.num_requested_chunks, len(r.tiers)) == (N, N, N)
    got = client.get_chunks(NS, KEYS)
    assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))
    assert client.stats()["stored_chunks"] - before == N
    assert client.remove(NS, KEYS[200:]) == N - 200
    assert client.exists(NS, KEYS).count(True) == 200


def test_a_lookup_of_400_keys_stops_at_the_first_missing_one(client):
    client.put_chunks(NS, KEYS[:137], [chunk(i) for i in range(137)])
    r = client.lookup_keys(NS, KEYS)
    assert (r.num_hit_chunks, r.num_requested_chunks, len(r.tiers)) == (137, N, 137)
    assert client.exists(NS, KEYS) == [i < 137 for i in range(N)]
    got = client.get_chunks(NS, KEYS, [torch.empty_like(chunk(0)) for _ in range(N)])
    assert [g is None for g in got] == [i >= 137 for i in range(N)]
    assert torch.equal(got[136], chunk(136))


def test_pins_split_too(client):
    client.put_chunks(NS, KEYS[:50], [chunk(i) for i in range(50)])
    assert client.pin(NS, KEYS[:50], 30.0) == 50
    assert client.unpin(NS, KEYS[:50]) == 50
    assert client.demote(NS, KEYS[:50]) == 50


def test_a_batch_continuing_a_prompt_names_its_first_parent(client):
    """Each request of a split put carries its first chunk's parent: removing chunk 100
    leaves the chunks after it unreachable as a prefix, so a lookup stops there."""
    assert client.put_chunks(NS, KEYS[:120], [chunk(i) for i in range(120)]) == 120
    assert client.remove(NS, KEYS[100:101]) == 1
    assert client.lookup_keys(NS, KEYS[:120]).num_hit_chunks == 100


def test_a_chunk_larger_than_the_body_limit_is_refused_naming_both_sizes(client):
    kv = torch.zeros(BIG.layout.shape(), dtype=torch.float16)
    keys = BIG.chunk_keys(list(range(128 * 2)))
    with pytest.raises(ChunkTooLarge) as e:
        client.put_chunks(BIG, keys, [kv, kv])
    assert e.value.status == 413 and e.value.max_body_bytes == BODY
    assert e.value.nbytes >= kv.nbytes > BODY
    assert f"{e.value.nbytes} bytes" in str(e.value) and str(BODY) in str(e.value)
    assert client.exists(BIG, keys) == [False, False]


def test_the_async_client_learns_the_limits_from_answers(daemon):
    async def go():
        c = AsyncKVStoreClient(daemon[0], timeout_s=10)
        try:
            assert c._http.limits is None
            # a lookup past the key limit: the 413 names the limits, the rest is split
            r = await c.lookup_keys(NS, KEYS[:40])
            assert c._http.limits == DaemonLimits(BODY, BATCH)
            assert r.num_requested_chunks == 40
            c2 = AsyncKVStoreClient(daemon[0], timeout_s=10)
            try:  # a put of several chunks asks first (a 413 to a body may be a reset)
                assert await c2.put_chunks(NS, KEYS[:40], [chunk(i) for i in range(40)]) == 40
                assert c2._http.limits == DaemonLimits(BODY, BATCH)
            finally:
                await c2.close()
            assert (await c.lookup_keys(NS, KEYS[:40])).num_hit_chunks == 40
            assert await c.clear() == 40
        finally:
            await c.close()
    asyncio.run(go())


def test_a_discovering_client_puts_over_the_socket_within_its_limits(daemon):
    with KVStoreClient(daemon[0], timeout_s=10) as c:
        assert c.put_chunks(NS, KEYS[:60], [chunk(i) for i in range(60)]) == 60
        assert c.transport == "unix"
        assert c._shm.limits == DaemonLimits(BODY, BATCH)
        assert c.lookup_keys(NS, KEYS[:60]).num_hit_chunks == 60
        assert c.clear() == 60


def test_a_prefix_store_put_over_the_limits_reads_back(client):
    store = PrefixStore(client, NS)
    tokens = list(range(4 * 50))
    kv = torch.cat([chunk(i) for i in range(50)], dim=2)  # [2, 2, 200, 1, 8]
    store.put(tokens, kv)
    assert store.lookup(tokens).num_hit_tokens == 200
    assert torch.equal(store.get(tokens, 200), kv)


def test_smollm2_chunks_past_a_16mib_body_limit_are_all_stored():
    """The reported case: 4 fp16 SmolLM2-135M chunks (5.9 MB each, 23.6 MB in all) to a
    daemon at ``--max-body-bytes 16MiB``, through ``PrefixStore`` on both paths."""
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                      chunk_size=256)
    ns = Namespace("HuggingFaceTB/SmolLM2-135M", layout)
    kv = torch.randn(30, 2, 4 * 256, 3, 64).to(torch.float16)
    tokens = list(range(4 * 256))
    with _serve(["--max-body-bytes", "16MiB", "--cpu-bytes", "64MiB", "--page-bytes", "4KiB"]
                ) as (http, unix):
        for url in (http, unix):
            with KVStoreClient(url, same_host=False, timeout_s=30) as c:
                store = PrefixStore(c, ns)
                store.put(tokens, kv)
                assert store.lookup(tokens).num_hit_tokens == 4 * 256
                assert torch.equal(store.get(tokens, 4 * 256), kv)
                assert c.clear() == 4


def test_the_daemon_exports_the_store_wide_gauges(daemon):
    with KVStoreClient(daemon[0], same_host=False, timeout_s=10) as c:
        c.clear()
        c.put_chunks(NS, KEYS[:10], [chunk(i) for i in range(10)])
        text = c.metrics_text()
        assert "kvstore_resident_chunks 10.0" in text
        assert float(text.split("\nkvstore_namespaces ")[1].split()[0]) >= 1  # (NS, ...)
        for name in ("kvstore_unreachable_bytes", "kvstore_pinned_chunks",
                     "kvstore_dropped_chunks_total", "kvstore_removed_chunks_total"):
            assert f"\n{name} " in text, name
        assert c.clear() == 10


def test_a_borrow_past_the_key_limit_is_copied_in_batches(client):
    kvs = [chunk(i) for i in range(40)]
    client.put_chunks(NS, KEYS[:40], kvs)
    with client.get_borrowed(NS, KEYS[:41]) as b:
        assert b.parts[40] is None
        assert all(torch.equal(p[0], kv.reshape(-1).view(torch.uint8))
                   for p, kv in zip(b.parts[:40], kvs))


@pytest.mark.parametrize("path", [0, 1], ids=["http", "unix"])
def test_an_engines_saves_past_the_limits_are_stored(daemon, path):
    """The connector's save (``EngineMinConnector`` under engine_min's real scheduler, a
    stand-in forward pass) of a 400-token prompt: 50 chunks, at 8 keys and 4 KiB a request."""
    from tests.connectors.fake_engine import FakeEngine, make_conn, prompt
    conn = make_conn(KVStoreClient(daemon[path], same_host=False, timeout_s=10), chunk=8)
    conn.store.clear()
    eng = FakeEngine(conn, num_blocks=256, budget=1024)
    toks = prompt(400)
    eng.add("r", toks)
    eng.run()
    conn.close()  # (waits for the queued saves; closes its client)
    st = conn.get_stats()
    assert st["kvstore_save_errors"] == 0 and st["kvstore_saved_chunks"] >= 49
    with KVStoreClient(daemon[path], same_host=False, timeout_s=10) as c:
        assert c.lookup_keys(conn.ns, conn.ns.chunk_keys(toks)).num_hit_chunks >= 49
        c.clear()
