"""EngineMinConnector against engine_min's real Scheduler and BlockManager, with a stand-in
forward pass (no model): the "computed" KV of token t at position p is ``kv_value(t, p)``, so
every slot of the pool says whether it was computed, loaded, or never written.

Block size 4 throughout; chunk sizes 4 or 8.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.engine_min import EngineMinConnector
from connectors.factory import create_connector
from kvstore.layered import LayeredStore
from engine_min.block_manager import BlockManager
from engine_min.sampler import SamplingParams
from engine_min.scheduler import Scheduler
from engine_min.sequence import Sequence
from kernels import reference as K
from kvstore.api import KVStoreBase, PrefixStore
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey, chain_hashes
from kvstore.store import ChunkStore

L, H, D, BS = 2, 1, 2, 4
STORE_MARK = 1000.0  # KV put straight into the store = computed value + STORE_MARK


def kv_value(tokens: list[int], start: int, end: int, mark: float = 0.0) -> torch.Tensor:
    """``[L, 2, end - start, H, D]`` KV of tokens[start:end]: value = token * 10 + position (+ mark)."""
    t = torch.tensor(tokens[start:end], dtype=torch.float32)
    p = torch.arange(start, end, dtype=torch.float32)
    v = (t * 10 + p + mark)[None, None, :, None, None]
    return v.expand(L, 2, end - start, H, D).contiguous()


class FakeEngine:
    """Scheduler + block manager + pool; ``forward`` writes kv_value into computed slots."""

    def __init__(self, connector, num_blocks=64, budget=512, prefix_caching=True):
        self.kv = torch.full((L, 2, num_blocks, BS, H, D), -1.0)
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.bm, budget, 8, connector)
        self.conn = connector
        self.computed_tokens = 0
        self.tables: dict[str, list[int]] = {}   # last block table of each request
        connector.register_kv_caches(self.kv, BS)

    def add(self, rid, tokens, max_tokens=1) -> Sequence:
        seq = Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
        self.sched.add(seq)
        return seq

    def step(self):
        out = self.sched.schedule()
        self.conn.start_load_kv(out, self.kv)
        self.conn.wait_for_load()
        for it in out.scheduled:
            s, n = it.seq.num_computed_tokens, it.num_new_tokens
            kv = kv_value(it.seq.token_ids, s, s + n)
            pos = torch.arange(s, s + n)
            slots = torch.tensor(it.seq.block_table)[pos // BS] * BS + pos % BS
            for layer in range(L):
                K.reshape_and_cache(kv[layer, 0], kv[layer, 1], self.kv[layer], slots)
            self.computed_tokens += n
        self.conn.save(out, self.kv)
        for it in out.scheduled:
            self.tables[it.seq.request_id] = list(it.seq.block_table)
        for it in out.scheduled:
            seq, samples = it.seq, it.samples
            seq.num_computed_tokens += it.num_new_tokens
            self.bm.cache_blocks(seq)
            if samples:
                seq.token_ids.append(7 + seq.num_output_tokens)
                if seq.num_output_tokens >= seq.sampling.max_tokens:
                    self.sched.finish(seq, "length")
        return out

    def run(self, max_steps=100):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")

    def seq_kv(self, seq, start, end) -> torch.Tensor:
        """KV of seq's tokens [start, end) read back from its blocks."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(self.tables[seq.request_id])[pos // BS]
        return self.kv[:, :, blocks, pos % BS]


def make_store(cpu="1MiB") -> ChunkStore:
    return ChunkStore(StoreConfig(cpu_bytes=cpu))


def make_conn(store=None, chunk=8, **kw) -> EngineMinConnector:
    return EngineMinConnector(store or make_store(), chunk_size=chunk, deadline_s=5.0, **kw)


def prompt(n, base=100):
    return [base + i for i in range(n)]


# ---- index arithmetic ----------------------------------------------------------------------
def test_chunk_geometry_arithmetic():
    m = ChunkGeometry(4, 8)
    assert m.blocks_per_chunk == 2
    assert m.num_external_tokens(num_tokens=40, num_local=16, num_hit=24) == 8
    assert m.num_external_tokens(num_tokens=40, num_local=20, num_hit=16) == 0
    assert m.num_external_tokens(num_tokens=16, num_local=0, num_hit=16) == 15  # last token computed
    assert m.num_external_tokens(num_tokens=40, num_local=6, num_hit=24) == 0   # not block aligned
    p = m.load_plan(20, 12)   # tokens [20, 32): chunks 2..3, blocks 5..7
    assert (p.first_chunk, p.last_chunk, p.first_block, p.last_block) == (2, 4, 5, 8)
    assert m.landed_end(p, 1) == 24 and m.landed_end(p, 0) == 20 and m.landed_end(p, 2) == 32
    assert list(m.chunks_to_save(8, 31)) == [1, 2] and list(m.chunks_to_save(24, 31)) == []
    assert m.chunk_blocks([9, 8, 7, 6, 5], 1) == [7, 6]
    with pytest.raises(ValueError, match="multiple of the engine's block_size=4"):
        ChunkGeometry(4, 6)
    with pytest.raises(ValueError, match="overwrite computed slots"):
        m.load_plan(6, 8)
    with pytest.raises(ValueError, match="block table has 5"):
        m.chunk_blocks([1, 2, 3, 4, 5], 2)


def test_chunk_size_not_multiple_of_block_size_is_a_clear_error():
    conn = make_conn(chunk=6)
    with pytest.raises(ValueError, match="chunk_size=6 must be a multiple"):
        conn.register_kv_caches(torch.zeros(L, 2, 4, BS, H, D), BS)
    conn.close()


# ---- admission: what is loaded, and where --------------------------------------------------
def _local_then_store(num_local, num_store, n=40):
    """An engine holding ``num_local`` tokens of a prompt in its prefix cache and a store
    holding ``num_store`` (marked) tokens of it; returns (engine, seq) after the admission step."""
    toks = prompt(n)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn)
    # fill the engine's prefix cache with num_local tokens: run the prefix as its own request
    if num_local:
        eng.add("warm", toks[:num_local] + [1])
        eng.run()
        conn.wait_for_save(5)
        conn.store.clear()
    PrefixStore(conn.store, conn.ns).put(toks, kv_value(toks, 0, num_store, STORE_MARK))
    eng.computed_tokens = 0
    seq = eng.add("r", toks)
    eng.step()
    return eng, seq, conn


def test_store_hit_24_with_16_local_loads_exactly_8_and_never_overwrites_computed_slots():
    eng, seq, conn = _local_then_store(16, 24)
    assert seq.num_cached_tokens == 24
    st = conn.get_stats()
    assert (st["kvstore_loaded_tokens"], st["external_prefix_cache_hits"]) == (8, 8)
    assert st["kvstore_hit_tokens_by_tier"] == {"cpu": 8}
    toks = seq.token_ids
    assert torch.equal(eng.seq_kv(seq, 0, 16), kv_value(toks, 0, 16))             # untouched
    assert torch.equal(eng.seq_kv(seq, 16, 24), kv_value(toks, 16, 24, STORE_MARK))  # loaded
    assert torch.equal(eng.seq_kv(seq, 24, 40), kv_value(toks, 24, 40))             # computed
    assert eng.computed_tokens == 40 - 24
    conn.close()


def test_store_16_with_20_local_loads_nothing():
    eng, seq, conn = _local_then_store(20, 16)
    assert seq.num_cached_tokens == 20
    st = conn.get_stats()
    assert (st["kvstore_loaded_tokens"], st["external_prefix_cache_hits"]) == (0, 0)
    assert torch.equal(eng.seq_kv(seq, 0, 40), kv_value(seq.token_ids, 0, 40))
    conn.close()


def test_store_hit_with_unaligned_local_start_loads_the_chunk_tail_only():
    eng, seq, conn = _local_then_store(20, 32)   # chunk 2 = [16, 24) is partly local
    assert seq.num_cached_tokens == 32
    toks = seq.token_ids
    assert conn.get_stats()["kvstore_loaded_tokens"] == 12
    assert torch.equal(eng.seq_kv(seq, 0, 20), kv_value(toks, 0, 20))
    assert torch.equal(eng.seq_kv(seq, 20, 32), kv_value(toks, 20, 32, STORE_MARK))
    conn.close()


def test_full_prompt_hit_loads_all_but_the_last_token():
    toks = prompt(16)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    PrefixStore(conn.store, conn.ns).put(toks, kv_value(toks, 0, 16, STORE_MARK))
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 15 and eng.computed_tokens == 1
    assert conn.get_stats()["external_prefix_cache_hits"] == 15
    conn.close()


# ---- saves ---------------------------------------------------------------------------------
def test_prompt_prefilled_in_6_token_slices_stores_all_4_chunks_and_replays():
    toks = prompt(16)
    conn = make_conn(chunk=4)
    eng = FakeEngine(conn, budget=6, prefix_caching=False)
    eng.add("a", toks, max_tokens=1)
    eng.run()
    assert conn.wait_for_save(5)
    ps = PrefixStore(conn.store, conn.ns)
    assert ps.lookup(toks).num_hit_chunks == 4
    assert torch.equal(ps.get(toks, 16), kv_value(toks, 0, 16))
    eng.computed_tokens = 0
    seq = eng.add("b", toks, max_tokens=1)
    eng.step()
    assert seq.num_cached_tokens == 15 and eng.computed_tokens == 1
    assert torch.equal(eng.seq_kv(seq, 0, 16), kv_value(toks, 0, 16))
    conn.close()


def test_generated_tokens_full_chunks_are_saved_at_request_end_partial_ones_not():
    toks = prompt(10)
    for save_generated, want in ((True, 4), (False, 2)):
        conn = make_conn(chunk=4, save_generated=save_generated)
        eng = FakeEngine(conn, prefix_caching=False)
        seq = eng.add("a", toks, max_tokens=9)   # 19 tokens, 18 with KV: 4 full chunks
        eng.run()
        assert conn.wait_for_save(5)
        assert seq.num_tokens == 19
        assert PrefixStore(conn.store, conn.ns).lookup(seq.token_ids).num_hit_chunks == want
        assert conn.get_stats()["kvstore_saved_chunks"] == want
        conn.close()


def test_full_save_queue_drops_and_counts_without_blocking():
    gate = threading.Event()

    class SlowPut(ChunkStore):
        def put_chunks(self, ns, keys, kvs):
            gate.wait(10)
            return super().put_chunks(ns, keys, kvs)

    store = SlowPut(StoreConfig(cpu_bytes="1MiB"))
    conn = EngineMinConnector(store, chunk_size=4, deadline_s=5.0, save_queue_bytes=1)
    eng = FakeEngine(conn, prefix_caching=False)
    t0 = time.perf_counter()
    eng.add("a", prompt(8, 100), max_tokens=1)
    eng.add("b", prompt(8, 300), max_tokens=1)
    eng.run()
    assert time.perf_counter() - t0 < 5   # the writer is stuck; the engine is not
    st = conn.get_stats()
    assert st["kvstore_queued_chunks"] == 2 and st["kvstore_dropped_save_chunks"] == 2
    gate.set()
    assert conn.wait_for_save(5)
    assert conn.get_stats()["kvstore_saved_chunks"] == 2
    conn.close()


# ---- counting ------------------------------------------------------------------------------
def test_repeated_lookups_while_waiting_do_not_inflate_counts():
    calls = []

    class Counting(ChunkStore):
        def lookup_keys(self, ns, keys):
            calls.append(len(keys))
            return super().lookup_keys(ns, keys)

    conn = make_conn(Counting(StoreConfig(cpu_bytes="1MiB")), chunk=4)
    eng = FakeEngine(conn, num_blocks=7, prefix_caching=False)   # 6 usable blocks = 24 tokens
    toks_a, toks_b = prompt(20, 100), prompt(16, 300)
    PrefixStore(conn.store, conn.ns).put(toks_b, kv_value(toks_b, 0, 16))
    eng.add("a", toks_a, max_tokens=4)
    b = eng.add("b", toks_b, max_tokens=1)
    for _ in range(3):   # b waits: a holds 5 of 6 blocks
        eng.step()
        assert b.status.value == "waiting"
    for _ in range(3):
        assert conn.get_num_new_matched_tokens(b, 0) == (15, False)
    assert calls.count(4) == 1      # b looked up once, its answer cached while it waits
    assert conn.get_stats()["external_prefix_cache_queries"] == 20
    eng.run()
    st = conn.get_stats()
    assert (st["external_prefix_cache_queries"], st["external_prefix_cache_hits"]) == (36, 15)
    assert st["kvstore_requests"] == 2
    conn.close()


def test_preemption_does_not_double_count():
    conn = make_conn(chunk=4)
    eng = FakeEngine(conn, num_blocks=9, budget=64, prefix_caching=False)   # 8 blocks
    ta, tb = prompt(12, 100), prompt(12, 300)
    ps = PrefixStore(conn.store, conn.ns)
    ps.put(tb, kv_value(tb, 0, 8))
    eng.add("a", ta, max_tokens=12)
    b = eng.add("b", tb, max_tokens=12)
    eng.run(200)
    assert eng.sched.num_preemptions >= 1
    st = conn.get_stats()
    assert st["external_prefix_cache_queries"] == 24
    # b's first admission loaded 8 tokens; readmissions reload real bytes but count no new hits
    assert st["external_prefix_cache_hits"] == 8
    assert st["kvstore_loaded_tokens"] >= 8
    assert b.is_finished
    conn.close()


# ---- robustness ----------------------------------------------------------------------------
def test_chunk_removed_from_the_middle_stops_the_hit_before_it():
    toks = prompt(33)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    ps = PrefixStore(conn.store, conn.ns)
    ps.put(toks, kv_value(toks, 0, 32, STORE_MARK))
    conn.store.remove(conn.ns, ps.keys(toks)[2:3])      # chunk 2 = tokens [16, 24)
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 16 and eng.computed_tokens == 17
    assert torch.equal(eng.seq_kv(seq, 16, 33), kv_value(toks, 16, 33))
    conn.close()


class _Flaky(ChunkStore):
    """A store whose get_chunks misses from chunk ``miss_from`` on, or stalls."""

    miss_from: int | None = None
    stall_s: float = 0.0
    lookup_stall_s: float = 0.0

    def lookup_keys(self, ns, keys):
        time.sleep(self.lookup_stall_s)
        return super().lookup_keys(ns, keys)

    def get_chunks(self, ns, keys):
        time.sleep(self.stall_s)
        out = super().get_chunks(ns, keys)
        if self.miss_from is not None:
            out[self.miss_from:] = [None] * (len(out) - self.miss_from)
        return out


def _flaky_run(caplog, **flaw):
    toks = prompt(33)
    store = _Flaky(StoreConfig(cpu_bytes="1MiB"))
    conn = EngineMinConnector(store, chunk_size=8, deadline_s=0.2, deadline_s_per_chunk=0.0)
    eng = FakeEngine(conn, prefix_caching=False)
    PrefixStore(store, conn.ns).put(toks, kv_value(toks, 0, 32, STORE_MARK))
    for k, v in flaw.items():
        setattr(store, k, v)
    seqs = []
    for i in range(2):
        seqs.append(eng.add(f"r{i}", toks))
        eng.run()
    return eng, conn, seqs, toks


def test_partial_load_leaves_num_computed_at_what_landed(caplog):
    eng, conn, seqs, toks = _flaky_run(caplog, miss_from=1)
    for seq in seqs:
        assert seq.num_cached_tokens == 8 and seq.is_finished
    assert eng.computed_tokens == 2 * 25
    st = conn.get_stats()
    assert (st["kvstore_fallbacks"], st["kvstore_load_failed_tokens"]) == (2, 48)
    assert st["external_prefix_cache_hits"] == 16
    assert sum("recomputing the rest" in r.message for r in caplog.records) == 1  # logged once
    conn.close()


def test_stalled_load_misses_deadline_and_recomputes(caplog):
    eng, conn, seqs, toks = _flaky_run(caplog, stall_s=1.0)
    assert [s.num_cached_tokens for s in seqs] == [0, 0]
    assert eng.computed_tokens == 66
    st = conn.get_stats()
    assert st["kvstore_load_fallbacks"] == 2 and st["external_prefix_cache_hits"] == 0
    assert st["kvstore_load_seconds_max"] < 0.6
    assert sum("missed its deadline" in r.message for r in caplog.records) == 1
    conn.close()


def test_stalled_lookup_misses_deadline_and_recomputes(caplog):
    eng, conn, seqs, toks = _flaky_run(caplog, lookup_stall_s=1.0)
    assert [s.num_cached_tokens for s in seqs] == [0, 0]
    st = conn.get_stats()
    assert st["kvstore_lookup_fallbacks"] == 2 and st["kvstore_lookup_seconds_max"] < 0.6
    conn.close()


def test_failing_store_never_fails_a_request(caplog):
    class Broken(ChunkStore):
        def lookup_keys(self, ns, keys):
            raise OSError("disk on fire")

        def put_chunks(self, ns, keys, kvs):
            raise OSError("disk on fire")

    conn = make_conn(Broken(StoreConfig(cpu_bytes="1MiB")), chunk=4)
    eng = FakeEngine(conn, prefix_caching=False)
    seq = eng.add("a", prompt(16), max_tokens=3)
    eng.run()
    assert seq.is_finished and conn.wait_for_save(5)
    st = conn.get_stats()
    assert st["kvstore_lookup_fallbacks"] == 1 and st["kvstore_save_errors"] >= 1
    conn.close()


# ---- layered store -------------------------------------------------------------------------
def test_layered_store_reads_local_first_then_remote_and_copies_back():
    local, remote = make_store(), make_store()
    conn = make_conn(LayeredStore(local, remote), chunk=8)
    FakeEngine(conn, prefix_caching=False)
    toks = prompt(33)
    PrefixStore(remote, conn.ns).put(toks, kv_value(toks, 0, 32))
    PrefixStore(local, conn.ns).put(toks[:8], kv_value(toks, 0, 8))
    res = PrefixStore(conn.store, conn.ns).lookup(toks)
    assert res.tiers == ("cpu", "remote:cpu", "remote:cpu", "remote:cpu")
    eng = FakeEngine(conn, prefix_caching=False)
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 32
    assert conn.get_stats()["kvstore_hit_tokens_by_tier"] == {"cpu": 8, "remote:cpu": 24}
    assert PrefixStore(local, conn.ns).lookup(toks).num_hit_chunks == 4   # copied back
    conn.close()


def test_layered_store_survives_a_dead_remote(caplog):
    from kvstore.daemon.client import KVStoreClient
    local = make_store()
    dead = KVStoreClient("http://127.0.0.1:9", timeout_s=0.2)
    conn = make_conn(LayeredStore(local, dead), chunk=4)
    eng = FakeEngine(conn, prefix_caching=False)
    toks = prompt(12)
    eng.add("a", toks)
    eng.run()
    assert conn.wait_for_save(10)
    eng.computed_tokens = 0
    seq = eng.add("b", toks)
    eng.run()
    assert seq.num_cached_tokens == 11 and eng.computed_tokens == 1
    assert conn.store.remote_errors >= 1
    conn.close()


def test_circuit_breaker_skips_a_failed_remote_for_a_doubling_cooldown_then_probes():
    from kvstore.daemon.client import RemoteError, StoreUnavailable

    from kvstore.layered import CircuitBreakerStore, RemoteSkipped
    now = [100.0]

    class Remote(ChunkStore):
        url = "http://127.0.0.1:9"
        fail: BaseException | None = None
        calls = 0

        def exists(self, ns, keys):
            self.calls += 1
            if self.fail is not None:
                raise self.fail
            return super().exists(ns, keys)

    remote = Remote(StoreConfig(cpu_bytes="1MiB"))
    br = CircuitBreakerStore(remote, cooldown_s=2.0, max_cooldown_s=5.0, clock=lambda: now[0])
    conn = make_conn(br, chunk=4)
    FakeEngine(conn)
    ns = conn.ns
    keys = [ChunkKey(ns.ns_id, h) for h in chain_hashes(ns.digest, prompt(8), 4, "sha256")]
    assert br.exists(ns, keys) == [False, False] and not br.is_open
    remote.fail = StoreUnavailable("connection refused")
    for expect_cooldown in (2.0, 4.0, 5.0, 5.0):   # doubles, capped at max_cooldown_s
        with pytest.raises(StoreUnavailable, match="connection refused"):
            br.exists(ns, keys)                      # the probe (or first call) fails: opens
        calls = remote.calls
        now[0] += expect_cooldown - 0.01
        for _ in range(3):
            with pytest.raises(RemoteSkipped, match="failed recently"):
                br.exists(ns, keys)
        assert remote.calls == calls and br.is_open  # skipped: never sent
        now[0] += 0.01
    assert (br.skipped_calls, br.trips) == (12, 4)
    remote.fail = None
    assert br.exists(ns, keys) == [False, False] and not br.is_open   # the probe closes it
    remote.fail = StoreUnavailable("hung")
    with pytest.raises(StoreUnavailable):
        br.exists(ns, keys)
    assert br._open_until == now[0] + 2.0          # reset to the first cool-down
    now[0] += 2.0
    for exc in (RemoteError(401, "bad token"), ValueError("bad tensor")):  # not unavailability
        remote.fail = exc
        with pytest.raises(type(exc)):
            br.exists(ns, keys)
    remote.fail = None
    assert br.exists(ns, keys) == [False, False] and br.trips == 5
    assert conn.get_stats()["kvstore_remote_skipped_calls"] == 12
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreakerStore(remote, cooldown_s=0)
    conn.close()


def test_dead_daemon_costs_requests_nothing_after_the_first_failure(caplog):
    from socket import socket
    with socket() as sk:
        sk.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sk.getsockname()[1]}"   # nothing listens once closed
    conn = create_connector(url=url, chunk_size=4, deadline_s=0.5)
    eng = FakeEngine(conn, prefix_caching=False)
    seqs = [eng.add(f"r{i}", prompt(12, base=100 * i)) for i in range(6)]
    t0 = time.monotonic()
    eng.run()
    elapsed = time.monotonic() - t0
    assert all(s.is_finished and s.num_cached_tokens == 0 for s in seqs)  # recomputed
    assert eng.computed_tokens == 6 * 12
    assert conn.wait_for_save(5)
    st = conn.get_stats()
    # the first lookup is refused (2 tries, ~50 ms) and opens the breaker for 2 s: the other
    # lookups and the saves are skipped without a connection attempt
    assert st["kvstore_lookup_fallbacks"] == 6 and st["kvstore_remote_breaker_trips"] == 1
    assert st["kvstore_remote_skipped_calls"] >= 5 and st["kvstore_remote_breaker_open"]
    assert st["kvstore_lookup_seconds_max"] < 0.4 and elapsed < 1.0
    conn.close()


def test_factory_validates_and_builds_each_store_kind(tmp_path):
    with pytest.raises(ValueError, match="no store"):
        create_connector()
    with pytest.raises(ValueError, match="disk_bytes needs disk_path"):
        create_connector(disk_bytes="1MiB")
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        create_connector(url="127.0.0.1:9")
    for url, why in (("http://127.0.0.1:99999", "out of range"), ("tcp://h:port", "port"),
                     ("http://:8500", "no host")):  # each used to be accepted silently
        with pytest.raises(ValueError, match=why):
            create_connector(url=url)
    c = create_connector(cpu_bytes="1MiB", chunk_size=8)
    assert isinstance(c.store, ChunkStore) and c.store.config.tiers == ("cpu",)
    c.close()
    c = create_connector(disk_path=str(tmp_path / "d"), disk_bytes="4MiB", chunk_size=8)
    assert c.store.config.tiers == ("disk",)
    c.close()
    c = create_connector(cpu_bytes="1MiB", url="tcp://127.0.0.1:9", chunk_size=8)
    assert isinstance(c.store, LayeredStore) and c.store.remote.url == "http://127.0.0.1:9"
    assert type(c.store.remote).__name__ == "CircuitBreakerStore"
    c.close()
    assert isinstance(KVStoreBase, type)


def test_server_flags_build_the_connector_through_the_factory(tmp_path):
    import argparse

    from engine_min.serve.cli import add_serve_args, build_connector
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert build_connector(parse([])) is None
    c = build_connector(parse(["--kvstore-cpu-bytes", "8MiB", "--kvstore-disk-path",
                               str(tmp_path / "d"), "--kvstore-disk-bytes", "16MiB",
                               "--kvstore-chunk-size", "32"]))
    assert isinstance(c, EngineMinConnector) and c.chunk_size == 32
    assert c.store.config.tiers == ("cpu", "disk") and c.store.config.disk_bytes == 16 << 20
    c.close()


def test_breaker_gives_background_saves_a_long_deadline_and_gets_a_per_chunk_one():
    """A save of many chunks must not inherit the 0.5 s lookup deadline: on a busy host it
    timed out, tripped the breaker and so turned the next lookups into misses."""
    from connectors.factory import SAVE_TIMEOUT_S, create_connector
    from kvstore.layered import CircuitBreakerStore

    class Remote(ChunkStore):
        url = "http://127.0.0.1:9"

        def __init__(self, cfg):
            super().__init__(cfg)
            self.seen: list[tuple[str, float | None]] = []

        def put_chunks(self, ns, keys, kvs, *, timeout_s=None):
            self.seen.append(("put", timeout_s))
            return super().put_chunks(ns, keys, kvs)

        def get_chunks(self, ns, keys, *, timeout_s=None):
            self.seen.append(("get", timeout_s))
            return super().get_chunks(ns, keys)

    remote = Remote(StoreConfig(cpu_bytes="4MiB"))
    br = CircuitBreakerStore(remote, put_timeout_s=30.0, get_timeout_s_per_chunk=0.05,
                             get_timeout_s_base=0.5)
    conn = make_conn(br, chunk=4)
    FakeEngine(conn)
    ns = conn.ns
    toks = prompt(8)
    keys = ns.chunk_keys(toks)
    kvs = [torch.zeros(ns.layout.shape(), dtype=ns.layout.torch_dtype) for _ in keys]
    assert br.put_chunks(ns, keys, kvs) == 2
    assert [c is not None for c in br.get_chunks(ns, keys)] == [True, True]
    assert remote.seen == [("put", 30.0), ("get", pytest.approx(0.5 + 2 * 0.05))]
    # The factory wires the same deadlines around its daemon client.
    c = create_connector(url="http://127.0.0.1:9", chunk_size=16, deadline_s=0.5)
    store = c.store
    assert isinstance(store, CircuitBreakerStore)
    assert (store.put_timeout_s, store.get_timeout_s_per_chunk, store.get_timeout_s_base) == (
        SAVE_TIMEOUT_S, 0.05, 0.5)
    c.close()
