"""Eviction keeps stored prefixes reachable, and every chunk keeps its true parent.

A lookup walks a prompt's chunks from the first one and stops at the first one stored nowhere,
so a stored chunk whose parent is gone from every tier can never be served: its bytes are
wasted (``unreachable_bytes``). Chunks here are 128 bytes (``LAY``); bitstrings list which of
a prompt's chunks are stored, first chunk first.
"""
import tempfile

import pytest
import torch

from kvstore.layered import LayeredStore
from kvstore.api import PrefixStore, chain_parents
from kvstore.daemon.client import KVStoreClient
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore

LAY = KVLayout(1, 1, 4, "float32", 4)  # [1, 2, 4, 1, 4] float32 = 128 bytes per chunk
NS = Namespace("reach", LAY)
CHUNK = 128
DISK_SLOT = CHUNK + HEADER_BYTES_MAX  # what a queued disk put reserves per chunk
POLICIES = ["lru", "lfu", "fifo", "s3fifo"]


def prompt(n, base=0):
    return [base + t for t in range(4 * n)]


def kv_of(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, 4 * n, 1, 4, generator=g)  # [L, 2, T, H, D]


def chunks(kv, n):
    return [kv[:, :, 4 * i:4 * i + 4].contiguous() for i in range(n)]


def bits(store, keys):
    return "".join("1" if e else "0" for e in store.exists(NS, keys))


def cpu_store(n_chunks, policy="lru"):
    return ChunkStore(StoreConfig(cpu_bytes=n_chunks * CHUNK, page_bytes=CHUNK,
                                  cpu_policy=policy), [NS])


def disk_store(path, n_chunks, policy="lru"):
    return ChunkStore(StoreConfig(cpu_bytes=0, disk_bytes=n_chunks * DISK_SLOT, disk_path=path,
                                  disk_policy=policy), [NS])


@pytest.mark.parametrize("policy", POLICIES)
def test_one_put_larger_than_the_cpu_tier_keeps_its_head_chunks(policy):
    """Was: hits 0, chunks 5, 6, 9, 10 stored (0000110011), 512 bytes unreachable; 3 chunks
    into 2 kept 101 (hits 1)."""
    for n, cap, want in ((10, 4, "1111000000"), (3, 2, "110")):
        store = cpu_store(cap, policy)
        p = PrefixStore(store, NS)
        toks = prompt(n)
        assert p.put(toks, kv_of(n)) == cap
        assert bits(store, p.keys(toks)) == want
        assert p.lookup(toks).num_hit_chunks == cap
        st = store.stats()
        assert st["unreachable_bytes"] == 0
        assert st["rejected_chunks"] == n - cap
        assert torch.equal(p.get(toks, 4 * cap), kv_of(n)[:, :, :4 * cap])
        store.check_integrity()
        store.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_one_put_larger_than_the_disk_tier_keeps_its_head_chunks_across_a_restart(policy, tmp_path):
    for n, cap, want in ((10, 4, "1111000000"), (3, 2, "110")):
        path = str(tmp_path / f"d{n}")
        store = disk_store(path, cap, policy)
        p = PrefixStore(store, NS)
        toks = prompt(n)
        assert p.put(toks, kv_of(n)) == cap
        store.flush()
        assert bits(store, p.keys(toks)) == want
        assert p.lookup(toks).num_hit_chunks == cap
        assert store.stats()["unreachable_bytes"] == 0
        store.close()
        store = disk_store(path, cap, policy)  # the parents come back from the value headers
        p = PrefixStore(store, NS)
        assert bits(store, p.keys(toks)) == want
        keys = p.keys(toks)
        assert [store.tiers[0].parent_of(k) for k in keys[:cap]] == [None] + keys[:cap - 1]
        assert store.stats()["unreachable_bytes"] == 0
        store.close()


def test_ten_chunks_into_two_cpu_and_two_disk_chunks_keep_four_head_chunks(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=2 * CHUNK, page_bytes=CHUNK,
                                   disk_bytes=2 * DISK_SLOT, disk_path=str(tmp_path)), [NS])
    p = PrefixStore(store, NS)
    toks = prompt(10)
    assert p.put(toks, kv_of(10)) == 4
    assert bits(store, p.keys(toks)) == "1111000000"
    assert p.lookup(toks).num_hit_chunks == 4
    assert store.stats()["unreachable_bytes"] == 0
    store.close()


def test_a_chunk_put_after_its_parent_keeps_the_parent_in_memory_and_on_disk(tmp_path):
    """Was: the second call's chunk had no parent, so removing chunk 1 left
    ``unreachable_bytes`` at 0."""
    k = NS.chunk_keys(prompt(2))
    kv = chunks(kv_of(2), 2)
    store = cpu_store(8)
    store.put_chunks(NS, k[:1], kv[:1])
    store.put_chunks(NS, k[1:], kv[1:], parents=chain_parents(k[1:], k[0]))
    assert store.tiers[0].parent_of(k[1]) == k[0]
    assert store.remove(NS, k[:1]) == 1
    assert store.stats()["unreachable_bytes"] == CHUNK
    store.close()

    path = str(tmp_path / "disk")
    store = disk_store(path, 8)
    store.put_chunks(NS, k[:1], kv[:1])
    store.put_chunks(NS, k[1:], kv[1:], parents=[k[0]])
    store.close()
    store = disk_store(path, 8)  # restart: the parent is read back from the header
    assert store.tiers[0].parent_of(k[1]) == k[0]
    assert store.remove(NS, k[:1]) == 1
    assert store.stats()["unreachable_bytes"] == store.tiers[0].nbytes_of(k[1]) == 278  # 128 + header with a parent
    store.close()


def test_a_chunk_whose_parent_is_stored_nowhere_is_refused():
    k = NS.chunk_keys(prompt(3))
    kv = chunks(kv_of(3), 3)
    store = cpu_store(8)
    assert store.put_chunks(NS, k[2:], kv[2:], parents=[k[1]]) == 0
    assert store.exists(NS, k) == [False, False, False]
    assert store.stats()["rejected_chunks"] == 1
    with pytest.raises(ValueError, match="its own parent"):
        store.put_chunks(NS, k[:1], kv[:1], parents=[k[0]])
    with pytest.raises(ValueError, match="2 parents"):
        store.put_chunks(NS, k[:1], kv[:1], parents=[None, None])
    other = Namespace("other", LAY).chunk_keys(prompt(1))[0]
    with pytest.raises(ValueError, match="another namespace"):
        store.put_chunks(NS, k[1:2], kv[1:2], parents=[other])
    assert store.exists(NS, k) == [False, False, False]
    store.close()


def split_puts(put, keys, kvs, sizes):
    """Put ``keys`` in consecutive calls of ``sizes`` chunks, each naming its first parent."""
    i = 0
    for size in sizes:
        put(keys[i:i + size], kvs[i:i + size], chain_parents(keys[i:i + size],
                                                              keys[i - 1] if i else None))
        i += size


SIZES = [1, 2, 1, 2, 1, 1, 2]  # 10 chunks, one or two per call


def test_one_or_two_chunks_per_call_into_four_cpu_chunks_keep_the_head():
    store = cpu_store(4)
    keys = NS.chunk_keys(prompt(10))
    split_puts(lambda k, v, p: store.put_chunks(NS, k, v, p), keys, chunks(kv_of(10), 10), SIZES)
    assert bits(store, keys) == "1111000000"
    assert store.lookup_keys(NS, keys).num_hit_chunks == 4
    assert store.stats()["unreachable_bytes"] == 0
    store.close()


def test_an_unrelated_prompt_evicts_the_tail_of_another_never_its_head():
    store = cpu_store(4)
    a, b = prompt(4), prompt(2, base=1000)
    pa, pb = PrefixStore(store, NS), PrefixStore(store, NS)
    pa.put(a, kv_of(4))
    pb.put(b, kv_of(2, seed=1))
    assert bits(store, pa.keys(a)) == "1100"
    assert bits(store, pb.keys(b)) == "11"
    assert store.stats()["unreachable_bytes"] == 0
    store.close()


@pytest.fixture
def daemon():
    store = cpu_store(4)
    srv = ThreadedServer(create_app(store, ServerLimits()))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


def test_daemon_puts_of_one_or_two_chunks_keep_the_head_of_a_long_prompt(daemon):
    """Was: lookup hit 0, stored 0000001111, ``unreachable_bytes`` 0 while 4 stored chunks
    were unreachable."""
    keys = NS.chunk_keys(prompt(10))
    with KVStoreClient(daemon.url, timeout_s=5.0) as c:
        split_puts(lambda k, v, p: c.put_chunks(NS, k, v, p), keys, chunks(kv_of(10), 10), SIZES)
        assert c.lookup_keys(NS, keys).num_hit_chunks == 4
        assert "".join("1" if e else "0" for e in c.exists(NS, keys)) == "1111000000"
        assert c.stats()["unreachable_bytes"] == 0
    assert [daemon.store.tiers[0].parent_of(k) for k in keys[:4]] == [None] + keys[:3]


def test_daemon_put_header_parent_is_validated_like_a_key(daemon):
    import json
    import urllib.error
    import urllib.request

    from kvstore.daemon import protocol as P
    keys = NS.chunk_keys(prompt(2))
    kv = chunks(kv_of(2), 2)
    other = Namespace("other", LAY).chunk_keys(prompt(1))[0]
    for parent, why in ((keys[1].hex(), "its parent"), (other.hex(), "namespace"),
                        ("zz", "bad key"), (7, "hex string")):
        entry, view = P.entry_for(keys[1], kv[1])
        head = {"namespace": NS.to_dict(), "durable": False,
                "chunks": [dict(entry.to_dict(), parent=parent)]}
        blob = json.dumps(head).encode()
        body = P.PREAMBLE.pack(P.MAGIC, len(blob)) + blob + bytes(view)
        req = urllib.request.Request(daemon.url + "/v1/put", data=body, method="POST",
                                     headers={"Content-Type": P.BINARY_CONTENT_TYPE})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        text = err.value.read().decode()
        assert err.value.code == 400 and why in json.loads(text)["error"], (parent, text)
    assert daemon.store.exists(NS, keys) == [False, False]


def test_layered_store_copies_remote_chunks_with_their_true_parents():
    keys = NS.chunk_keys(prompt(4))
    kv = chunks(kv_of(4), 4)
    remote, local = cpu_store(8), cpu_store(8)
    remote.put_chunks(NS, keys, kv)
    local.put_chunks(NS, keys[:2], kv[:2])
    layered = LayeredStore(local, remote)
    got = layered.get_chunks(NS, keys[2:], chain_parents(keys[2:], keys[1]))
    assert all(torch.equal(g, w) for g, w in zip(got, kv[2:]))
    assert [local.tiers[0].parent_of(k) for k in keys] == [None] + keys[:3]
    local.remove(NS, keys[:1])
    assert local.stats()["unreachable_bytes"] == 3 * CHUNK

    local2 = cpu_store(8)  # no parents given: the first fetched key's parent is unknown
    got = LayeredStore(local2, remote).get_chunks(NS, keys[1:])
    assert all(torch.equal(g, w) for g, w in zip(got, kv[1:]))
    assert local2.exists(NS, keys) == [False, False, False, False]  # orphans are refused
    for s in (remote, local, local2):
        s.close()


def test_two_tiers_spill_and_promote_keep_parents(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=2 * CHUNK, page_bytes=CHUNK,
                                   disk_bytes=8 * DISK_SLOT, disk_path=str(tmp_path)), [NS])
    keys = NS.chunk_keys(prompt(4))
    kv = chunks(kv_of(4), 4)
    split_puts(lambda k, v, p: store.put_chunks(NS, k, v, p), keys, kv, [1, 1, 1, 1])
    store.flush()
    assert store.lookup_keys(NS, keys).tiers == ("disk", "disk", "cpu", "cpu")
    store.get_chunks(NS, keys[:2])  # promoted: chunks 3, 4 spill to disk
    assert store.lookup_keys(NS, keys).tiers == ("cpu", "cpu", "disk", "disk")
    cpu, disk = store.tiers
    assert [cpu.parent_of(k) for k in keys[:2]] == [None, keys[0]]
    assert [disk.parent_of(k) for k in keys] == [None] + keys[:3]  # 1, 2 stayed there too
    assert store.stats()["unreachable_bytes"] == 0
    store.close()


def test_daemon_put_continuing_a_prefix_evicts_other_prompts_not_its_own_head(daemon):
    """Pages are reserved chunk by chunk as the bytes arrive: reserving chunk 4 must not evict
    chunk 2, whose child (chunk 3) is reserved but not yet committed."""
    a = NS.chunk_keys(prompt(4))
    b = NS.chunk_keys(prompt(2, base=1000))
    kv = chunks(kv_of(4), 4)
    with KVStoreClient(daemon.url, timeout_s=5.0) as c:
        assert c.put_chunks(NS, a[:2], kv[:2]) == 2
        assert c.put_chunks(NS, b, chunks(kv_of(2, seed=1), 2)) == 2
        assert c.put_chunks(NS, a[2:], kv[2:], chain_parents(a[2:], a[1])) == 2
        assert "".join("1" if e else "0" for e in c.exists(NS, a + b)) == "111100"
        assert c.lookup_keys(NS, a).num_hit_chunks == 4
        assert c.stats()["unreachable_bytes"] == 0


def test_engine_connector_saves_per_prefill_step_and_at_request_end_with_true_parents():
    """The connector saves a prompt's chunks as prefill steps complete them and its answer's
    at request end: every chunk after the first call names its parent."""
    from tests.connectors.fake_engine import FakeEngine, make_conn
    toks = list(range(100, 116))
    conn = make_conn(ChunkStore(StoreConfig(cpu_bytes="1MiB", page_bytes="4KiB")), chunk=4)
    eng = FakeEngine(conn, budget=6, prefix_caching=False)  # 6-token prefill steps
    seq = eng.add("a", toks, max_tokens=9)  # 24 tokens with KV at the end: 6 chunks
    eng.run()
    assert conn.wait_for_save(5)
    store, ns = conn.store, conn.ns
    keys = ns.chunk_keys(seq.token_ids[:24])
    assert store.exists(ns, keys) == [True] * 6
    assert [store.tiers[0].parent_of(k) for k in keys] == [None] + keys[:5]
    store.remove(ns, keys[2:3])
    assert store.stats()["unreachable_bytes"] == 3 * 4096  # chunks 4-6, one 4 KiB page each
    conn.close()


def test_vllm_connector_saves_name_the_parent_of_their_first_chunk():
    """vLLM saves the chunks each step completed (the connector core's save ranges, turned
    into transfers): a save continuing chunks saved earlier names the chunk before it; the
    prompt's tail pieces start their own chain at its last full chunk, a later piece names
    the piece before it."""
    from connectors.chunk_geometry import ChunkGeometry
    from connectors.chunk_plan import RequestChunks
    from connectors.vllm.records import save_transfer
    ns = Namespace("reach", KVLayout(1, 1, 4, "float32", 8))
    tail_ns = Namespace("reach", KVLayout(1, 1, 4, "float32", 2))
    toks = prompt(6, 100)[:22]                       # chunks 0-1, then pieces 8-10 (2 tokens)
    keys, pieces = ns.chunk_keys(toks), tail_ns.chunk_keys(toks)
    req = RequestChunks(ChunkGeometry(2, 8, 2), ns, tail_ns)
    blocks = list(range(11))

    def step(done):
        ranges = [req.chunks_to_save(toks, done)]
        if done >= 16:                               # past the prompt's last full chunk
            ranges.append(req.pieces_to_save(toks, done))
        return [(t.ns.layout.chunk_size, t.first_chunk, t.keys, t.start, t.end, t.parent)
                for t in (save_transfer("r", r, blocks) for r in ranges if r is not None)]

    assert step(6) == []
    assert step(12) == [(8, 0, keys[:1], 0, 8, None)]
    assert step(18) == [(8, 1, keys[1:2], 8, 16, keys[0]), (2, 8, pieces[8:9], 16, 18, None)]
    assert step(22) == [(2, 9, pieces[9:11], 18, 22, pieces[8])]


def test_engine_connector_loads_through_a_layered_store_copy_chunks_with_true_parents():
    """Chunks 2-4 come from the remote store and are copied into the local one: the first of
    them names chunk 1 (held locally) as its parent, which only the connector knows."""
    from tests.connectors.fake_engine import FakeEngine, kv_value, make_conn
    local, remote = cpu_store(16), cpu_store(16)
    conn = make_conn(LayeredStore(local, remote), chunk=8)
    FakeEngine(conn, prefix_caching=False)  # binds the connector's namespace
    toks = list(range(100, 133))
    PrefixStore(remote, conn.ns).put(toks, kv_value(toks, 0, 32))
    PrefixStore(local, conn.ns).put(toks[:8], kv_value(toks, 0, 8))
    eng = FakeEngine(conn, prefix_caching=False)
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 32
    keys = conn.ns.chunk_keys(toks[:32])
    assert [local.tiers[0].parent_of(k) for k in keys] == [None] + keys[:3]
    local.remove(conn.ns, keys[1:2])
    assert conn.ns.layout.chunk_bytes == 256  # two 128-byte pages per chunk
    assert local.stats()["unreachable_bytes"] == 2 * 256  # chunks 3 and 4
    conn.close()
