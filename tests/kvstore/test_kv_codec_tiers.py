"""The rule of ``kvstore.kv_codec`` in a store: a tier configured lossy writes a chunk lossily
only for a namespace that accepts that codec; a bit-exact namespace reads exact bytes from the
same tier; the CPU tier always holds exact bytes; a disk tier reopened with another codec reads
what it holds; the default codecs stay bit-exact. Real lmdb and (for the remote tier) a real
Redis (``tests.redis_fixtures``)."""
import pytest
import torch

from kvstore import kv_codec
from kvstore.codec import HEADER_BYTES_MAX, unpack_header
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from tests.redis_fixtures import redis_server  # noqa: F401

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", chunk_size=8)
CB = LAY.chunk_bytes  # 2048
EXACT = Namespace("codec-test", LAY)
INT8 = Namespace("codec-test", LAY, lossy_codec="int8")
FP8 = Namespace("codec-test", LAY, lossy_codec="fp8")
TOKENS = list(range(100, 100 + 3 * 8))


def chunks(n=3, seed=0):
    """``n`` chunks [2, 2, 8, 2, 16] fp16 with an outlier key channel."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((n, *LAY.shape()), generator=g)
    kv[:, :, 0, :, 1, 7] *= 30
    return list(kv.to(torch.float16))


def decoded(kv, codec, sink_tokens=0):
    return kv_codec.decode(kv_codec.encode(kv, codec, sink_tokens), codec, kv.dtype,
                           tuple(kv.shape))


def disk_store(tmp_path, codec, cpu_chunks=0):
    cfg = StoreConfig(cpu_bytes=cpu_chunks * CB, page_bytes=CB, disk_bytes=64 * CB,
                      disk_path=str(tmp_path / "db"), disk_codec=codec)
    return ChunkStore(cfg, [EXACT, INT8, FP8])


def disk_codecs(store, keys):
    """The codec in the header of each key's value on disk."""
    disk = store.tiers[-1]
    assert disk.name == "disk" and store.flush(10.0)
    with disk.env.begin() as txn:
        return [unpack_header(txn.get(bytes(k))).codec for k in keys]


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_int8_disk_tier_writes_lossily_only_for_the_namespace_that_accepts_int8(tmp_path):
    kvs = chunks()
    with disk_store(tmp_path, "int8") as store:
        for ns in (EXACT, INT8, FP8):
            assert store.put_chunks(ns, ns.chunk_keys(TOKENS), kvs) == 3
        # an fp8-accepting namespace is not written int8: it accepted fp8 only
        assert disk_codecs(store, EXACT.chunk_keys(TOKENS)) == ["raw"] * 3
        assert disk_codecs(store, INT8.chunk_keys(TOKENS)) == ["int8"] * 3
        assert disk_codecs(store, FP8.chunk_keys(TOKENS)) == ["raw"] * 3
        exact = store.get_chunks(EXACT, EXACT.chunk_keys(TOKENS))
        lossy = store.get_chunks(INT8, INT8.chunk_keys(TOKENS))
        assert all(bits_equal(g, w) for g, w in zip(exact, kvs))
        assert all(bits_equal(g, decoded(w, "int8")) for g, w in zip(lossy, kvs))
        assert not any(torch.equal(g, w) for g, w in zip(lossy, kvs))
        # int8 payload: 1024 values + 96 fp16 scales + 1 = 1217 bytes (tiny chunks: scales
        # weigh more than at chunk_size 256), plus header and trailer (<= HEADER_BYTES_MAX)
        assert kv_codec.payload_nbytes("int8", LAY.shape()) == 1217
        for k in INT8.chunk_keys(TOKENS):
            assert 1217 < store.tiers[-1].nbytes_of(k) <= 1217 + HEADER_BYTES_MAX
        store.check_integrity()


def test_cpu_tier_holds_exact_bytes_even_for_a_lossy_namespace(tmp_path):
    kvs = chunks(seed=1)
    with disk_store(tmp_path, "int8", cpu_chunks=8) as store:
        keys = INT8.chunk_keys(TOKENS)
        assert store.put_chunks(INT8, keys, kvs) == 3
        assert store.lookup_keys(INT8, keys).tiers == ("cpu",) * 3
        assert all(bits_equal(g, w) for g, w in zip(store.get_chunks(INT8, keys), kvs))


def test_disk_tier_reopened_with_another_codec_reads_what_it_holds(tmp_path):
    first, second = chunks(seed=2), chunks(seed=3)
    more = list(range(500, 500 + 3 * 8))
    with disk_store(tmp_path, "int8") as store:
        assert store.put_chunks(INT8, INT8.chunk_keys(TOKENS), first) == 3
        assert store.put_chunks(EXACT, EXACT.chunk_keys(TOKENS), first) == 3
        assert store.flush(10.0)
    with disk_store(tmp_path, "fp8") as store:
        # written int8 / exact before the restart: read as written
        got = store.get_chunks(INT8, INT8.chunk_keys(TOKENS))
        assert all(bits_equal(g, decoded(w, "int8")) for g, w in zip(got, first))
        got = store.get_chunks(EXACT, EXACT.chunk_keys(TOKENS))
        assert all(bits_equal(g, w) for g, w in zip(got, first))
        # new chunks: fp8 for the fp8 namespace, exact for the int8 one now
        assert store.put_chunks(FP8, FP8.chunk_keys(more), second) == 3
        assert store.put_chunks(INT8, INT8.chunk_keys(more), second) == 3
        assert disk_codecs(store, FP8.chunk_keys(more)) == ["fp8"] * 3
        assert disk_codecs(store, INT8.chunk_keys(more)) == ["raw"] * 3
        assert disk_codecs(store, INT8.chunk_keys(TOKENS)) == ["int8"] * 3
        got = store.get_chunks(FP8, FP8.chunk_keys(more))
        assert all(bits_equal(g, decoded(w, "fp8")) for g, w in zip(got, second))
        store.check_integrity()


@pytest.mark.parametrize("codec", ["auto", "raw"])
def test_default_codecs_stay_bit_exact_for_every_namespace(tmp_path, codec):
    kvs = chunks(seed=4)
    with disk_store(tmp_path, codec) as store:
        for ns in (EXACT, INT8):
            assert store.put_chunks(ns, ns.chunk_keys(TOKENS), kvs) == 3
            assert set(disk_codecs(store, ns.chunk_keys(TOKENS))) <= {"raw", "shuffle-lz4"}
            got = store.get_chunks(ns, ns.chunk_keys(TOKENS))
            assert all(bits_equal(g, w) for g, w in zip(got, kvs))


def test_lossy_codecs_are_valid_tier_codecs_and_others_are_refused():
    assert StoreConfig(disk_bytes=CB, disk_path="/tmp/x", disk_codec="fp8").disk_codec == "fp8"
    assert StoreConfig(remote_url="redis://h:1", remote_codec="int8").remote_codec == "int8"
    with pytest.raises(ValueError, match="unknown disk_codec 'int4'"):
        StoreConfig(disk_bytes=CB, disk_path="/tmp/x", disk_codec="int4")
    with pytest.raises(ValueError, match="unknown remote_codec 'int4'"):
        StoreConfig(remote_url="redis://h:1", remote_codec="int4")


def test_int8_remote_tier_writes_lossily_only_for_the_accepting_namespace(redis_server):
    def remote_store(codec):
        cfg = StoreConfig(cpu_bytes=16 * CB, page_bytes=CB, remote_url=redis_server.url,
                          remote_codec=codec)
        return ChunkStore(cfg, [EXACT, INT8])

    kvs = chunks(seed=5)
    with remote_store("int8") as a, remote_store("raw") as b:
        for ns in (EXACT, INT8):
            assert a.put_chunks(ns, ns.chunk_keys(TOKENS), kvs) == 3
        assert a.flush(10.0)
        with redis_server.client() as r:
            for ns, want in ((EXACT, "raw"), (INT8, "int8")):
                for k in ns.chunk_keys(TOKENS):
                    rk = f"kvstore:{k.ns_id.hex()}:{k.prefix_hash.hex()}".encode()
                    assert unpack_header(r.get(rk)).codec == want
        # another store (its own codec raw) reads each as written
        got = b.get_chunks(EXACT, EXACT.chunk_keys(TOKENS))
        assert all(bits_equal(g, w) for g, w in zip(got, kvs))
        got = b.get_chunks(INT8, INT8.chunk_keys(TOKENS))
        assert all(bits_equal(g, decoded(w, "int8")) for g, w in zip(got, kvs))


def test_kivi_disk_tier_beside_int8_chunks_of_a_previous_run(tmp_path):
    """A disk tier changed from int8 to kivi between restarts: the int8 chunks read as written,
    the kivi namespace's new chunks are written kivi (within its bound, fewer bytes; the
    prompt's first chunk, which has no parent, with its ``SINK_TOKENS`` sink tokens in fp16),
    the other namespaces' exactly."""
    kivi = Namespace("codec-test", LAY, lossy_codec="kivi")
    first, second = chunks(seed=6), chunks(seed=7)
    more = list(range(700, 700 + 3 * 8))
    with disk_store(tmp_path, "int8") as store:
        assert store.put_chunks(INT8, INT8.chunk_keys(TOKENS), first) == 3
        assert store.flush(10.0)
    cfg = StoreConfig(cpu_bytes=0, page_bytes=CB, disk_bytes=64 * CB,
                      disk_path=str(tmp_path / "db"), disk_codec="kivi")
    with ChunkStore(cfg, [EXACT, INT8, kivi]) as store:
        for ns in (EXACT, INT8, kivi):
            assert store.put_chunks(ns, ns.chunk_keys(more), second) == 3
        assert disk_codecs(store, INT8.chunk_keys(TOKENS)) == ["int8"] * 3
        assert disk_codecs(store, kivi.chunk_keys(more)) == ["kivi"] * 3
        assert disk_codecs(store, INT8.chunk_keys(more)) == ["raw"] * 3
        assert disk_codecs(store, EXACT.chunk_keys(more)) == ["raw"] * 3
        got = store.get_chunks(INT8, INT8.chunk_keys(TOKENS))
        assert all(bits_equal(g, decoded(w, "int8")) for g, w in zip(got, first))
        got = store.get_chunks(kivi, kivi.chunk_keys(more))
        sinks = [kv_codec.SINK_TOKENS, 0, 0]                  # the first chunk only
        assert all(bits_equal(g, decoded(w, "kivi", n)) for g, w, n in zip(got, second, sinks))
        assert bits_equal(got[0][:, :, :4], second[0][:, :, :4])   # fp16 KV: sinks exact
        assert not bits_equal(got[1][:, :, :4], second[1][:, :, :4])
        for g, w, n in zip(got, second, sinks):
            bound = kv_codec.error_bound(w, "kivi", n) + g.float().abs() * 2 ** -11
            assert bool(((g.float() - w.float()).abs() <= bound).all())
        got = store.get_chunks(EXACT, EXACT.chunk_keys(more))
        assert all(bits_equal(g, w) for g, w in zip(got, second))
        for k, s in zip(kivi.chunk_keys(more), sinks):
            n = kv_codec.payload_nbytes("kivi", LAY.shape(), 2, s)
            assert n < store.tiers[-1].nbytes_of(k) <= n + HEADER_BYTES_MAX
        store.check_integrity()
