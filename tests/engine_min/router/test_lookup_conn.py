"""The router's store lookups on kept-alive connections of their own
(``engine_min.router.lookup_conn``), against a real daemon and against raw servers that
answer late, close idle connections, answer chunked or refuse: lookups reuse one connection,
a late answer is never read as the next lookup's, a connection the daemon closed is replaced
without an error, and a lookup the policy does not need builds no lookup body."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from connectors.prompt_keys import parse_namespace
from engine_min.router.lookup_conn import LookupAnswerError, LookupConnections
from engine_min.router.metrics import RouterMetrics
from engine_min.router.store_lookup import StoreLookup
from kvstore.config import StoreConfig
from kvstore.daemon.run import ThreadedServer
from kvstore.daemon.server import create_app as create_daemon_app
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

NS = Namespace("router-lookup-test", KVLayout(num_layers=2, num_kv_heads=1, head_dim=8,
                                               chunk_size=16))
PROMPT = list(range(100, 164))          # 64 tokens: 4 chunks of 16


def _result(metrics: RouterMetrics, result: str) -> float:
    return metrics.store_lookups.labels(result)._value.get()


@pytest.fixture(scope="module")
def daemon():
    """A daemon holding PROMPT's first 3 chunks (48 tokens), closing connections idle 0.3 s."""
    store = ChunkStore(StoreConfig(cpu_bytes="16MiB"))
    keys = NS.chunk_keys(PROMPT)[:3]
    store.put_chunks(NS, keys, [torch.ones(NS.layout.shape(), dtype=torch.float16)] * 3)
    srv = ThreadedServer(create_daemon_app(store), idle_timeout_s=0.3)
    yield srv
    srv.stop()
    store.close()


def test_lookups_reuse_one_connection_and_survive_the_daemons_idle_close(daemon):
    async def scenario():
        store, metrics = StoreLookup(daemon.url, timeout_s=5.0), RouterMetrics()
        bodies = store.lookup_bodies([parse_namespace(NS.to_dict())], PROMPT)
        got = [await store.hit_tokens(None, bodies, metrics) for _ in range(5)]
        opened_kept = store._conns.opened
        await asyncio.sleep(0.8)       # the daemon closes the idle connection (0.3 s)
        again = await store.hit_tokens(None, bodies, metrics)
        store.close()
        return got, opened_kept, again, store._conns.opened, metrics
    got, opened_kept, again, opened, metrics = asyncio.run(scenario())
    ns_id = NS.ns_id
    assert got == [{ns_id: 48}] * 5            # 3 chunks of 16, the 4th not held
    assert opened_kept == 1                    # five lookups, one connection
    assert again == {ns_id: 48} and opened == 2
    assert _result(metrics, "ok") == 6 and _result(metrics, "error") == 0


async def _raw_server(handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def _answer(obj: dict, status: str = "200 OK", extra: bytes = b"") -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body)}\r\n").encode() + extra + b"\r\n" + body


def test_a_late_answer_is_not_read_as_the_next_lookups():
    """The first lookup's answer comes after its deadline; the second lookup, on whatever
    connection, gets its own answer, never the first one's."""
    async def handler(reader, writer):
        try:
            while True:
                body = json.loads(await _read_request(reader))
                late = body["keys"] == ["late"]
                if late:
                    await asyncio.sleep(0.2)
                writer.write(_answer({"num_hit_chunks": 9 if late else 2, "chunk_size": 16}))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def scenario():
        server, url = await _raw_server(handler)
        store, metrics = StoreLookup(url, timeout_s=0.05), RouterMetrics()
        first = await store.hit_tokens(None, {b"a": b'{"keys": ["late"]}'}, metrics)
        await asyncio.sleep(0.3)           # the late answer arrives meanwhile
        second = await store.hit_tokens(None, {b"a": b'{"keys": ["now"]}'}, metrics)
        opened = store._conns.opened
        store.close()
        server.close()
        return first, second, opened, metrics
    first, second, opened, metrics = asyncio.run(scenario())
    assert first == {} and _result(metrics, "timeout") == 1
    # both lookups' waits are in router_store_lookup_seconds, the timed-out one >= 50 ms
    samples = {s.name + str(s.labels): s.value
               for s in metrics.store_lookup_time.collect()[0].samples}
    assert samples["router_store_lookup_seconds_count{}"] == 2
    assert samples["router_store_lookup_seconds_bucket{'le': '0.025'}"] <= 1
    assert samples["router_store_lookup_seconds_sum{}"] >= 0.05
    assert second == {b"a": 32}                 # 2 x 16, not the late 9 x 16
    assert opened == 2                          # the timed-out connection was not kept


def test_chunked_answers_connection_close_and_refusals():
    async def handler(reader, writer):
        body = json.loads(await _read_request(reader))
        if body["keys"] == ["refused"]:
            writer.write(_answer({"error": "missing or wrong bearer token"},
                                 "401 Unauthorized"))
        else:    # chunked, in two pieces, then the connection closes
            payload = json.dumps({"num_hit_chunks": 3, "chunk_size": 256}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
            half = len(payload) // 2
            for piece in (payload[:half], payload[half:]):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server, url = await _raw_server(handler)
        store, metrics = StoreLookup(url, timeout_s=2.0), RouterMetrics()
        ok = await store.hit_tokens(None, {b"a": b'{"keys": ["x"]}'}, metrics)
        kept = len(store._conns._idle)
        refused = await store.hit_tokens(None, {b"a": b'{"keys": ["refused"]}'}, metrics)
        store.close()
        server.close()
        return ok, kept, refused, store.answering, metrics
    ok, kept, refused, answering, metrics = asyncio.run(scenario())
    assert ok == {b"a": 768} and kept == 0          # Connection: close: not kept
    assert refused == {} and _result(metrics, "error") == 1 and answering is False


def test_answers_that_are_not_http_and_bad_urls_are_errors():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server, url = await _raw_server(handler)
        conns = LookupConnections(url, {})
        try:
            with pytest.raises(LookupAnswerError, match="not an HTTP/1.x status line"):
                await conns.post("/v1/lookup", b"{}")
        finally:
            conns.close()
            server.close()
    asyncio.run(scenario())
    with pytest.raises(ValueError, match="http://host"):
        LookupConnections("https://127.0.0.1:1", {})
    conns = LookupConnections("http://127.0.0.1:8200", {"Authorization": "Bearer t"})
    assert conns.request_bytes("/v1/lookup", b"{}") == (
        b"POST /v1/lookup HTTP/1.1\r\nHost: 127.0.0.1:8200\r\nAuthorization: Bearer t\r\n"
        b"Content-Length: 2\r\n\r\n{}")


def test_a_skipped_lookup_builds_no_body_and_a_made_one_builds_it_once(daemon):
    """A prompt no engine holds cannot be decided by the store: no chunk keys are hashed, no
    lookup is sent (``skipped``); when the store can change the pick the bodies are built
    once and the daemon's answer comes back."""
    from engine_min.router.policy import CacheAwarePolicy
    from engine_min.router.prompt import PreparedPrompt
    from engine_min.router.proxy import Router
    from engine_min.tokenizer import load_tokenizer

    store = StoreLookup(daemon.url, timeout_s=5.0)
    built = []
    real = store.lookup_bodies
    store.lookup_bodies = lambda spaces, toks: built.append(len(toks)) or real(spaces, toks)
    router = Router(["http://127.0.0.1:1", "http://127.0.0.1:2"], load_tokenizer(None),
                    CacheAwarePolicy(), store=store)
    ns = parse_namespace(NS.to_dict())
    for e in router.engines:
        e.healthy, e.store_namespace = True, ns
    prompt = PreparedPrompt(PROMPT, {})

    async def scenario():
        skipped = await router._store_hits(prompt, [ns, ns], None)
        n_skip = len(built)
        router._store_can_matter = lambda p: True
        made = await router._store_hits(prompt, [ns, ns], None)
        short = await router._store_hits(PreparedPrompt(PROMPT[:15], {}), [ns], None)
        store.close()
        return skipped, n_skip, made, short
    skipped, n_skip, made, short = asyncio.run(scenario())
    assert skipped == {NS.ns_id: 0} and n_skip == 0      # scored as a store hit of 0
    assert _result(router.metrics, "skipped") == 1
    assert made == {NS.ns_id: 48} and built == [64]
    assert short == {} and built == [64]     # 15 tokens: no full chunk, nothing asked
    assert _result(router.metrics, "skipped") == 1 and _result(router.metrics, "ok") == 1


def test_lookup_client_cpu_is_below_the_general_clients():
    """The kept connection's lookup costs the router less CPU than ``aiohttp``'s
    ``ClientSession.post`` (median of 200 each, against one in-process daemon thread
    whose CPU is not in the router thread's ``thread_time``)."""
    import aiohttp
    store_ = ChunkStore(StoreConfig(cpu_bytes="16MiB"))
    srv = ThreadedServer(create_daemon_app(store_))
    try:
        async def scenario():
            store, metrics = StoreLookup(srv.url, timeout_s=5.0), RouterMetrics()
            body = store.lookup_bodies([parse_namespace(NS.to_dict())], PROMPT)[NS.ns_id]
            ours, theirs = [], []
            async with aiohttp.ClientSession() as session:
                for _ in range(200):
                    c0 = time.thread_time()
                    await store.hit_tokens(None, {NS.ns_id: body}, metrics)
                    c1 = time.thread_time()
                    async with session.post(srv.url + "/v1/lookup", data=body,
                                            headers=store.headers) as r:
                        await r.json()
                    ours.append(c1 - c0)
                    theirs.append(time.thread_time() - c1)
            store.close()
            return sorted(ours)[100], sorted(theirs)[100]
        ours, theirs = asyncio.run(scenario())
    finally:
        srv.stop()
        store_.close()
    assert ours < theirs, (ours, theirs)


def test_lookup_body_of_a_list_and_of_the_prompts_id_array_agree():
    import numpy as np
    from connectors.prompt_keys import lookup_body
    from engine_min.router.prompt import prepare_source
    from engine_min.tokenizer import load_tokenizer
    ids = [7, 2**32 - 1] * 40                  # 80 tokens: 5 chunks of 16
    arr = np.asarray(ids, dtype=np.uint32)
    body = json.loads(lookup_body(NS, ids))
    assert body == json.loads(lookup_body(NS, arr))
    assert body["keys"] == [k.hex() for k in NS.chunk_keys(np.asarray(ids, dtype=np.int64))]
    assert len(body["keys"]) == 5
    for bad in ([1, -1] * 16, [1, 2**32] * 16, [1.5] * 32):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            lookup_body(NS, bad)
    prompt = prepare_source(load_tokenizer(None), "Hello there, a prompt of some tokens.",
                            [(b"\0" * 16, 4)])
    assert prompt.id_array.dtype == np.uint32
    assert prompt.id_array.tolist() == prompt.token_ids
