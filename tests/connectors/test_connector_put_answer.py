"""What EngineMinConnector does with a real ``kvstore serve``'s put answer (``PutResult``):
chunks the daemon refused are counted in ``refused_chunks`` (``engine_kvstore_refused_chunks``),
never in ``saved_chunks``; a ``parent_missing`` refusal is logged once at INFO, then at DEBUG;
the demotion of the tail pieces a saved chunk covers asks ``exists`` only when the answer does
not say which chunks are stored (an older daemon, or chunks stored before among refused ones).

Stand-in engine of ``fake_engine`` (block size 4; chunks C = 8, pieces F = 4): a 13-token
prompt saves chunk 0 = [0, 8) and piece 2 = [8, 12) after its prefill; with 4 tokens generated
its end saves chunk 1 = [8, 16) with chunk 0 as parent, which covers piece 2.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest

from connectors.chunk_records import Superseded
from connectors.save_queue import demote_superseded, known_present
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.put_result import PutResult
from kvstore.keys import Namespace
from tests.connectors.fake_engine import prompt
from tests.connectors.test_connector_tail_faults import conn_for, first_run
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.store_helpers import LAY, NS, kv_for

LOGGER = "connectors.engine_min"
TAIL = Namespace("tiny", dataclasses.replace(LAY, chunk_size=2))


@pytest.fixture(scope="module")
def url():
    """A real ``kvstore serve`` (4 MiB CPU tier in 256-byte pages) on a free port."""
    port = free_port()
    proc = start(port, None)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


class Client(KVStoreClient):
    """A client of the real daemon that counts its ``exists`` calls and may remove a put's
    first parent just before the put (``evict_parents``: the prefix evicted between the
    request's lookup and its save), or answer as a client of an older daemon does
    (``older``: a ``PutResult`` without ``refused`` / ``first_refused``)."""

    def __init__(self, url: str) -> None:
        super().__init__(url, same_host=False, timeout_s=10)
        self.exists_calls, self.evict_parents, self.older = 0, False, False

    def exists(self, ns, keys, **kw):
        self.exists_calls += 1
        return super().exists(ns, keys, **kw)

    def put_chunks(self, ns, keys, kvs, parents=None, **kw):
        if self.evict_parents and parents and parents[0] is not None:
            assert self.remove(ns, [parents[0]]) == 1
        out = super().put_chunks(ns, keys, kvs, parents, **kw)
        return PutResult(int(out), out.num_chunks) if self.older else out


@pytest.fixture
def client(url):
    c = Client(url)
    c.clear()
    yield c
    c.clear()
    c.close()


def _stats(conn) -> tuple[int, int, int, int]:
    st = conn.get_stats()
    return (st["kvstore_saved_chunks"], st["kvstore_refused_chunks"],
            st["kvstore_demoted_tail_chunks"], st["kvstore_demote_errors"])


def _refusal_lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == LOGGER and "refused" in r.getMessage()]


def test_parent_evicted_before_the_save_is_counted_refused_and_logged_once(client, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    conn = conn_for(client)
    client.evict_parents = True
    for base in (100, 300):
        first_run(conn, prompt(13, base), max_tokens=4)
    # per request: chunk 0 and piece 2 stored, chunk 1 refused (its parent, chunk 0, gone)
    assert _stats(conn) == (2, 2, 0, 0)
    assert conn.get_stats()["kvstore_saved_tail_chunks"] == 2
    assert client.exists_calls == 0        # the answer said chunk 1 is not stored
    lines = _refusal_lines(caplog)
    assert [lvl for lvl, _ in lines] == [logging.INFO, logging.DEBUG], lines
    assert "1 of 1 chunks" in lines[0][1] and "parent_missing" in lines[0][1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and "refused" in r.getMessage()]
    conn.close()


def test_a_chunk_stored_before_demotes_its_pieces_without_asking(client):
    conn = conn_for(client)
    toks = prompt(13)
    first_run(conn, toks + [7, 8, 9])           # chunks 0 and 1 (the answer's KV), no piece
    assert (_stats(conn), client.exists_calls) == ((2, 0, 0, 0), 0)
    # loads chunk 0, saves piece 2; its end's chunk 1 is stored already (stored 0, refused 0)
    first_run(conn, toks, max_tokens=4)
    assert (_stats(conn), client.exists_calls) == ((2, 0, 1, 0), 0)
    assert conn.get_stats()["kvstore_saved_tail_chunks"] == 1
    conn.close()


def test_an_older_daemons_answer_is_checked_with_exists(client):
    conn = conn_for(client)
    client.older = True
    toks = prompt(13)
    first_run(conn, toks + [7, 8, 9])
    first_run(conn, toks, max_tokens=4)            # chunk 1 stored before: exists tells
    assert (_stats(conn), client.exists_calls) == ((2, 0, 1, 0), 1)
    client.evict_parents = True
    first_run(conn, prompt(13, 300), max_tokens=4)  # chunk 1 refused, not said: exists tells
    assert (_stats(conn), client.exists_calls) == ((3, 0, 1, 0), 2)
    conn.close()


def test_demote_superseded_asks_only_when_the_answer_leaves_chunks_unknown(client):
    """Direct calls on the daemon (``store_helpers``' tiny layout, pieces of 2 tokens): a put
    of [orphan X, chunk 1 stored before] is refused from X on, yet chunk 1 is held (refused
    1 of 2 after the first refusal at 0): only ``exists`` can tell, and only the piece under
    chunk 1 is demoted. A put refused whole needs no call and demotes nothing."""
    toks = list(range(100, 108))
    c0, c1 = NS.chunk_keys(toks)
    pieces = TAIL.chunk_keys(toks)
    assert client.put_chunks(NS, [c0, c1], [kv_for(toks[:4]), kv_for(toks[4:])]) == 2
    assert client.put_chunks(TAIL, pieces, [kv_for(toks[i:i + 2]) for i in (0, 2, 4, 6)]) == 4
    lost = NS.chunk_keys([9, 9, 9, 9])[0]          # stored nowhere
    orphan = NS.chunk_keys([9, 9, 9, 9, 5, 5, 5, 5])[1]
    kv = kv_for(toks[4:])
    out = client.put_chunks(NS, [orphan, c1], [kv, kv], [lost, c0])
    assert (int(out), out.already_stored, out.refused) == (0, 1, 1)
    assert out.first_refused["index"] == 0 and out.first_refused["reason"] == "parent_missing"
    assert known_present([orphan, c1], out) is None
    sup = Superseded(TAIL, (pieces[1], pieces[3]), (0, 1))   # one piece under each chunk
    demoted = client.stats()["demoted_chunks"]
    assert demote_superseded(client, NS, [orphan, c1], out, sup) == 1   # pieces[3] only
    assert client.exists_calls == 1
    out = client.put_chunks(NS, [orphan], [kv], [lost])
    assert (int(out), out.refused, known_present([orphan], out)) == (0, 1, [False])
    assert demote_superseded(client, NS, [orphan], out, Superseded(TAIL, pieces[1:2], (0,))) == 0
    assert client.exists_calls == 1
    assert client.stats()["demoted_chunks"] == demoted + 1
