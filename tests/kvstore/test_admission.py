"""The TinyLFU admission filter: sketch estimates, aging and the admission test worked by
hand, its growth, and the store option (a put, a promotion and a spill into a full tier
must beat the victim's request count)."""
import pytest

from kvstore.api import PrefixStore
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.daemon import config as serve_config
from kvstore.eviction import ADMISSIONS, TinyLFU, create_admission
from tests.kvstore.store_helpers import CB, NS, gauge, kv_for, make, prompt


def test_estimates_count_requests_behind_the_doorkeeper():
    f = TinyLFU(width=64, window=1000)
    assert f.width == 64 and f.window == 1000
    assert f.estimate(1) == 0
    f.record(1)  # first request: the doorkeeper only
    assert f.estimate(1) == 1 and f._table == [0] * (4 * 64)
    for _ in range(3):  # later requests: the sketch
        f.record(1)
    assert f.estimate(1) == 4 and sum(f._table) == 4 * 3
    for _ in range(20):  # 4-bit counters stop at 15 (+1 for the doorkeeper)
        f.record(2)
    assert f.estimate(2) == 16 and f.estimate(3) == 0
    assert f.estimate(1) == 4  # (no collision between these keys' slots)


def test_aging_halves_counters_and_clears_the_doorkeeper():
    f = TinyLFU(width=64, window=8)
    for _ in range(5):
        f.record("a")  # door + 4
    for _ in range(3):
        f.record("b")  # door + 2; the 8th request ages: 4 -> 2, 2 -> 1, door cleared
    assert f.agings == 1 and f._events == 4
    assert (f.estimate("a"), f.estimate("b")) == (2, 1)
    f.record("b")  # back in the doorkeeper
    assert f.estimate("b") == 2


def test_admit_needs_strictly_more_requests():
    f = TinyLFU(width=64)
    for key, n in (("hot", 3), ("warm", 2), ("new", 1)):
        for _ in range(n):
            f.record(key)
    assert f.admit("hot", "warm") and not f.admit("warm", "hot")
    assert not f.admit("new", "new2") or f.estimate("new2") < 1  # a tie keeps the victim
    f.record("new2")
    assert not f.admit("new", "new2") and f.admit("warm", "new2")
    assert f.admit("new", "never-seen")


def test_fit_widens_the_sketch_and_starts_over():
    f = TinyLFU(width=16)
    f.record(7)
    f.record(7)
    f.fit(10)
    assert f.width == 16 and f.estimate(7) == 2
    f.fit(100)
    assert f.width == 128 and f.window == 1280 and f.estimate(7) == 0
    fixed = TinyLFU(width=16, auto_grow=False)
    fixed.fit(100)
    assert fixed.width == 16


def test_names_and_bad_arguments():
    assert ADMISSIONS == ("none", "tinylfu")
    assert create_admission("none") is None
    assert isinstance(create_admission("tinylfu"), TinyLFU)
    with pytest.raises(ValueError, match="unknown admission filter 'lfu'.*tinylfu"):
        create_admission("lfu")
    with pytest.raises(ValueError, match="width 0"):
        TinyLFU(width=0)
    with pytest.raises(ValueError, match="unknown admission 'tiny'"):
        StoreConfig(admission="tiny")
    cfg = serve_config.resolve({"admission": "tinylfu"}, {})
    assert cfg.store_config_kwargs()["admission"] == "tinylfu"
    with pytest.raises(ValueError, match="'tiny'"):
        serve_config.resolve({"admission": "tiny"}, {})


def _refusals(store, tier):
    return gauge(store, "kvstore_admission_refusals_total", tier) or 0


@pytest.mark.parametrize("admission", ["none", "tinylfu"])
def test_store_keeps_a_read_chunk_over_a_newcomer_until_the_newcomer_is_asked_more(admission):
    # CPU tier of 2 one-chunk prompts, LRU. A and B are put (1 request each) and read twice
    # (3 each; A least recent). C is put again and again (the caller found it missing each
    # time): requests 1, 2, 3 tie or lose against A's 3 and are refused; the 4th is admitted
    # and evicts A. Without a filter the first put of C evicts A.
    store = make(cpu=2, admission=admission)
    ps = PrefixStore(store, NS)
    a, b, c = prompt(0), prompt(1), prompt(2)
    for toks in (a, b):
        assert ps.put(toks, kv_for(toks)) == 1
    for toks in (a, a, b, b):
        assert ps.get(toks, 4) is not None
    stored = [ps.put(c, kv_for(c)) for _ in range(4)]
    if admission == "none":
        assert stored == [1, 0, 0, 0]
        assert _refusals(store, "cpu") == 0
    else:
        assert stored == [0, 0, 0, 1]
        assert _refusals(store, "cpu") == 3
        assert store.metrics.registry.get_sample_value("kvstore_rejected_chunks_total") == 3
    assert [ps.lookup(t).num_hit_tokens for t in (a, b, c)] == [0, 4, 4]
    store.check_integrity()


def test_store_does_not_spill_a_chunk_asked_once_over_one_asked_twice(tmp_path):
    # CPU 1 chunk over disk 1 chunk (disk bytes: room for one stored value), LRU, tinylfu.
    # A is put and read (2 requests); B is put (1): refused by the CPU (A has more), taken
    # by the disk (room). B read (2): promoted? A ties -> no. C put 3 times: the third (3)
    # beats A in the CPU; A (2) spilled to a full disk loses the tie against B (2): A is not
    # written to the disk and leaves the store.
    store = make(tmp_path, cpu=1, disk=CB + HEADER_BYTES_MAX + CB // 2, admission="tinylfu",
                 disk_codec="raw")
    ps = PrefixStore(store, NS)
    a, b, c = prompt(0), prompt(1), prompt(2)
    assert ps.put(a, kv_for(a)) == 1 and ps.get(a, 4) is not None
    assert ps.put(b, kv_for(b)) == 1
    assert ps.lookup(b).hits_by_tier == {"disk": 1}
    assert ps.get(b, 4) is not None
    assert ps.lookup(b).hits_by_tier == {"disk": 1}  # not promoted over A
    assert [ps.put(c, kv_for(c)) for _ in range(3)] == [0, 0, 1]
    store.flush()
    assert [ps.lookup(t).num_hit_tokens for t in (a, b, c)] == [0, 4, 4]
    assert ps.lookup(c).hits_by_tier == {"cpu": 1}
    assert store.metrics.registry.get_sample_value("kvstore_spills_total", {"tier": "cpu"}) in (None, 0.0)
    # CPU: B's put, B's promotion, C's first two puts; disk: C's first two puts (B: 2
    # requests), A's spill
    assert (_refusals(store, "cpu"), _refusals(store, "disk")) == (4, 3)
    store.check_integrity()
    store.close()


def test_persist_is_an_explicit_write_the_filter_does_not_refuse(tmp_path):
    # the disk holds B, read twice (3 requests); persisting C (1 request) replaces it anyway
    store = make(tmp_path, cpu=1, disk=CB + HEADER_BYTES_MAX + CB // 2, admission="tinylfu",
                 disk_codec="raw")
    ps = PrefixStore(store, NS)
    b, c = prompt(1), prompt(2)
    (kb,), (kc,) = ps.keys(b), ps.keys(c)
    assert store.persist(NS, [kb], [kv_for(b)], timeout=10.0) == 1
    for _ in range(2):
        assert ps.get(b, 4) is not None
    assert store.persist(NS, [kc], [kv_for(c)], timeout=10.0) == 1
    disk = store.tiers[-1]
    assert disk.contains(kc) and not disk.contains(kb)
    assert _refusals(store, "disk") == 0
    store.check_integrity()
    store.close()


def test_record_many_equals_record_one_at_a_time_across_agings():
    rng_keys = [(i * 7919) % 53 for i in range(500)]  # repeats, so counters and agings move
    one, many = TinyLFU(width=16, window=40), TinyLFU(width=16, window=40)
    for k in rng_keys:
        one.record(k)
    many.record_many(rng_keys[:123])
    many.record_many(rng_keys[123:])
    assert many.agings == one.agings == 24  # at 40 events, then every 20 (halved count)
    assert many._table == one._table and many._door == one._door
    assert many._events == one._events
    assert [many.estimate(k) for k in range(53)] == [one.estimate(k) for k in range(53)]


def test_admit_is_the_estimate_comparison_on_every_pair():
    f = TinyLFU(width=16, window=40)  # narrow: collisions; saturated counters too
    keys = [(i * 7919) % 53 for i in range(300)] + ["s"] * 20
    f.record_many(keys)
    pairs = [(a, b) for a in [*range(60), "s"] for b in [*range(60), "s"]]
    verdicts = [f.admit(a, b) for a, b in pairs]
    assert verdicts == [f.estimate(a) > f.estimate(b) for a, b in pairs]
    assert 0 < sum(verdicts) < len(pairs) // 2  # both answers given (ties say no)
    f.victim_demoted = lambda key: key == 5
    assert f.admit(0, 5) and f.admit("never", 5) and not f.admit(5, "s")
    g = TinyLFU(width=64, window=1000)
    g.record_many(["x", "y"])  # each once: in the doorkeeper only, a tie
    assert not g.admit("y", "x") and not g.admit("x", "y") and g.admit("x", "z")
