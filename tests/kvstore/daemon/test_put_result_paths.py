"""A put's refusals reach the caller on every client path, against a real ``kvstore serve``:
``KVStoreClient.put_chunks`` returns the stored count as a ``PutResult`` whose
``already_stored``, ``refused`` and ``first_refused`` (indexed from the call's first key, over
the requests it was split into) are the daemon's answer, over HTTP and over the same-host
socket (read from the client's memory, through a staging area split into groups, and over the
socket's bytes); the raw socket answer carries the same fields as HTTP's."""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time

import pytest
import torch

from kvstore.daemon.client import KVStoreClient, PutResult
from kvstore.keys import Namespace
from tests.kvstore.daemon.serve_proc import free_port, start, stop

#: 2 x 2 x 4 x 1 x 8 fp16 = 256-byte chunks
NS = Namespace.from_dict({"model_id": "example/refusals", "layout": {
    "num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "fp16", "chunk_size": 4}})
KEYS = NS.chunk_keys(list(range(4 * 8)))
#: 1 x 2 x 1024 x 1 x 64 fp16 = 256 KiB chunks: four fill the 1 MiB arena
BIG = Namespace.from_dict({"model_id": "example/refusals-big", "layout": {
    "num_layers": 1, "num_kv_heads": 1, "head_dim": 64, "dtype": "fp16", "chunk_size": 1024}})
BATCH = 4
#: client kwargs: HTTP; the socket with the daemon reading the client's memory; the socket
#: through a staging area of two 2-chunk halves; the socket's own bytes
PATHS = {"http": {"same_host": False}, "unix-vm": {},
         "unix-staged": {"vm_put": False, "staging_bytes": 1024},
         "unix-socket": {"vm_put": False, "staging_bytes": 0}}


@pytest.fixture(scope="module")
def daemon():
    with tempfile.TemporaryDirectory() as d:
        sock, port = os.path.join(d, "kv.sock"), free_port()
        proc = start(port, sock, ["--cpu-bytes", "1MiB", "--max-batch-keys", str(BATCH)])
        try:
            yield port, sock
        finally:
            stop(proc)


@pytest.fixture(params=list(PATHS))
def client(request, daemon):
    port, sock = daemon
    kw = PATHS[request.param]
    url = f"http://127.0.0.1:{port}" if request.param == "http" else "unix://" + sock
    c = KVStoreClient(url, **kw)
    try:
        yield c
    finally:
        c.clear(NS)
        c.clear(BIG)
        c.close()


def _chunks(ns: Namespace, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ns.layout.shape(), generator=g).to(torch.float16) for _ in range(n)]


def test_an_orphan_tells_its_index_over_split_requests(client):
    """Six chunks whose fourth names a parent stored nowhere: on the default CPU arena the
    batch stops there, so 3 are stored and 3 refused, the first refused being index 3 of the
    call (the second of a 4-key batch on HTTP, the second group of the staged path)."""
    keys = KEYS[:3] + KEYS[4:7]
    parents = [None, KEYS[0], KEYS[1], KEYS[3], KEYS[4], KEYS[5]]
    out = client.put_chunks(NS, keys, _chunks(NS, 6), parents)
    assert isinstance(out, PutResult) and out == 3
    assert (out.num_chunks, out.already_stored, out.refused) == (6, 0, 3)
    assert out.first_refused == {"index": 3, "key": KEYS[4].hex(), "reason": "parent_missing"}
    assert client.exists(NS, keys) == [True] * 3 + [False] * 3


def test_already_stored_is_not_refused(client):
    kvs = _chunks(NS, 6, seed=1)
    assert client.put_chunks(NS, KEYS[:2], kvs[:2]) == 2
    out = client.put_chunks(NS, KEYS[:6], kvs)  # batches [0, 4), [4, 6) on HTTP
    assert (int(out), out.already_stored, out.refused, out.first_refused) == (4, 2, 0, None)
    assert sum([out, out]) == 8  # still counts as an int


def test_no_room_is_named_and_later_chunks_are_not_stored(client):
    """An arena whose every page is pinned refuses the next prompt's first chunk
    (``no_room``), and the chunk after it with it."""
    pinned = []
    try:
        for i in range(4):
            key = BIG.chunk_keys([1000 + i] * 1024)[0]
            assert client.put_chunks(BIG, [key], _chunks(BIG, 1, seed=i)) == 1
            assert client.pin(BIG, [key], 60) == 1
            pinned.append(key)
        keys = BIG.chunk_keys([7] * 2048)
        out = client.put_chunks(BIG, keys, _chunks(BIG, 2, seed=9))
        assert (int(out), out.already_stored, out.refused) == (0, 0, 2)
        assert out.first_refused == {"index": 0, "key": keys[0].hex(), "reason": "no_room"}
    finally:
        if pinned:
            client.unpin(BIG, pinned)


def test_a_refusal_is_logged_at_debug(daemon, caplog):
    port, _ = daemon
    with KVStoreClient(f"http://127.0.0.1:{port}", same_host=False) as c:
        try:
            with caplog.at_level(logging.DEBUG, logger="kvstore.client"):
                c.put_chunks(NS, [KEYS[1]], _chunks(NS, 1), [KEYS[0]])
        finally:
            c.clear(NS)
    assert any("first refused" in r.getMessage() and "parent_missing" in r.getMessage()
               for r in caplog.records)


def test_the_raw_socket_answer_has_the_http_fields(daemon):
    """The socket's put reply, read as bytes off the wire, carries HTTP's answer fields."""
    from kvstore.daemon.shm_conn import Conn
    from kvstore.daemon.shm_put import put_on
    _, sock = daemon
    conn = Conn(sock, None, time.monotonic() + 30, {}, vm_put=False)
    try:
        answers = []
        real = conn.reply
        conn.reply = lambda deadline: answers.append(real(deadline)) or answers[-1]
        put_on(conn, time.monotonic() + 30, NS, [KEYS[0], KEYS[2]], _chunks(NS, 2),
               [None, KEYS[1]], False, 0)
    finally:
        conn.close()
        with KVStoreClient("unix://" + sock) as c:
            c.clear(NS)
    (answer,) = answers
    answer.pop("payload_bytes", None)  # (the client's own note of the reply's payload)
    assert json.loads(json.dumps(answer)) == {
        "ok": True, "stored": 1, "num_chunks": 2, "durable": False, "already_stored": 0,
        "refused": 1, "first_refused": {"index": 1, "key": KEYS[2].hex(),
                                        "reason": "parent_missing"}}


def test_an_older_daemons_answer_leaves_the_counts_unknown():
    """A put answer with ``stored`` only (an older daemon) still counts; the rest is None."""
    old = PutResult.from_answer({"stored": 2, "num_chunks": 3, "durable": False,
                                 "rejected": {"no_room": 1}})
    assert old == 2 and old.refused is None and old.first_refused is None
    new = PutResult.from_answer({"stored": 0, "num_chunks": 1, "already_stored": 0,
                                 "refused": 1, "first_refused": {
                                     "index": 0, "key": "ab", "reason": "no_room"}}, 3)
    both = PutResult.combine([old, new])
    assert both == 2 and both.num_chunks == 4 and both.refused is None
    assert both.first_refused == {"index": 3, "key": "ab", "reason": "no_room"}
