"""Page size of the memory tiers: small chunks fill the tier when pages are small, and large
chunks spanning many small pages still take one run.

4 KiB chunks (2 layers x 2 x 8 tokens x 1 head x 64 x fp16 = 4,096 bytes) in a 64 MiB CPU tier:
16,384 chunks with 4 KiB pages (the daemon's default), 1,024 with 64 KiB pages (one chunk per
page, 6.25% of the tier's bytes used).
"""
from __future__ import annotations

import pytest
import torch

from kvstore.daemon import cli

from kvstore.daemon import config as serve_config
from kvstore.daemon.client import KVStoreClient
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.memory import PageAllocator

SMALL = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float16", chunk_size=8)
NS = Namespace("tiny-model", SMALL)
N_PUT = 16_384 + 64                       # more than fit: the tier fills and evicts
#: one-chunk prompts (each key a chain head), so eviction picks among independent chunks
KEYS = [NS.chunk_keys(list(range(8 * i, 8 * i + 8)))[0] for i in range(N_PUT)]
TIER = 64 << 20


def small_chunk(i: int) -> torch.Tensor:
    return torch.full(SMALL.shape(), float(i % 2048), dtype=torch.float16)  # [2, 2, 8, 1, 64]


def _fill(put, n: int, batch: int = 1024) -> None:
    """Put chunks ``N_PUT - n .. N_PUT - 1`` (the newest ones, so the last always stays)."""
    for s in range(N_PUT - n, N_PUT, batch):
        put(KEYS[s:s + batch], [small_chunk(i) for i in range(s, min(s + batch, N_PUT))])


def test_small_chunk_layout_is_4kib():
    assert SMALL.chunk_bytes == 4096


@pytest.mark.parametrize("page, held", [("4KiB", 16_384), ("64KiB", 1_024)])
def test_4kib_chunks_in_a_64mib_tier_hold_16384_with_4kib_pages_1024_with_64kib(page, held):
    store = ChunkStore(StoreConfig(cpu_bytes=TIER, page_bytes=page))
    _fill(lambda keys, kvs: store.put_chunks(NS, keys, kvs), held + 64)
    cpu = store.stats()["tiers"]["cpu"]
    assert (cpu["num_chunks"], cpu["used_bytes"]) == (held, TIER)
    assert held * SMALL.chunk_bytes / TIER == {16_384: 1.0, 1_024: 0.0625}[held]
    last = KEYS[N_PUT - 1]   # the newest chunk is held, bit-exact
    assert torch.equal(store.get_chunks(NS, [last])[0], small_chunk(N_PUT - 1))
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("flags, held", [([], 4_096), (["--page-bytes", "64KiB"], 256)])
def test_the_daemon_default_page_fills_a_16mib_tier_with_4096_small_chunks(flags, held):
    """``kvstore serve``'s settings -> its store -> puts over HTTP (direct I/O into pages);
    a 16 MiB tier: 4,096 chunks with the default page, 256 with ``--page-bytes 64KiB``."""
    args = cli.build_parser().parse_args(["serve", "--cpu-bytes", "16MiB", *flags])
    cfg = serve_config.resolve({k: v for k, v in vars(args).items()
                                if k in serve_config.FIELDS}, env={})
    assert cfg.page_bytes == {4_096: 4096, 256: 65536}[held]
    store = cli.build_store(cfg)
    with ThreadedServer(create_app(store, ServerLimits())) as srv, \
            KVStoreClient(srv.url, timeout_s=30) as c:
        # batches below the tier's size: a put batch reserves its chunks' pages until it commits
        _fill(lambda keys, kvs: c.put_chunks(NS, keys, kvs), held + 64, batch=128)
        assert c.stats()["tiers"]["cpu"]["num_chunks"] == held
        got = c.get_chunks(NS, KEYS[N_PUT - 3:])
        assert all(torch.equal(g, small_chunk(N_PUT - 3 + i)) for i, g in enumerate(got))
    store.check_integrity()
    store.close()


def test_page_bytes_from_env_and_file_and_bad_values(tmp_path, capsys):
    assert serve_config.resolve({}, env={"KVSTORE_PAGE_BYTES": "16KiB"}).page_bytes == 16384
    f = tmp_path / "serve.yaml"
    f.write_text("page-bytes: 8KiB\n")
    assert serve_config.resolve({}, env={}, config_file=str(f)).page_bytes == 8192
    for bad in ("100", "0", "-64", "4 parsecs"):
        with pytest.raises(ValueError):
            serve_config.resolve({"page_bytes": bad}, env={})
    assert cli.main(["serve", "--port", "0", "--page-bytes", "100"]) == 2
    assert "page_bytes must be a positive multiple of 64, got 100" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cpu_bytes=65536 is smaller than one page"):
        StoreConfig(cpu_bytes="64KiB", page_bytes="1MiB")


def test_a_large_chunk_spans_small_pages_as_one_run_and_shares_the_arena():
    big = KVLayout(30, 3, 64, "float16", 256)                  # SmolLM2: 5,898,240 bytes
    assert big.chunk_bytes == 1440 * 4096
    a = PageAllocator(4096)
    assert a.alloc(1440) == ((0, 1440),)                       # one extent, not 1440 page ids
    t = CpuTier(2 * big.chunk_bytes + 4 * 4096, 4096, pin_memory=False)
    bns = Namespace("m", big)
    bkeys = bns.chunk_keys(list(range(512)))
    kv = torch.randn(big.shape()).to(torch.float16)
    t.put(KEYS[0], small_chunk(0), None)                       # small, big, small, big
    t.put(bkeys[0], kv, None)
    t.put(KEYS[1], small_chunk(1), KEYS[0])
    t.put(bkeys[1], kv, bkeys[0])
    assert t.free_bytes == 2 * 4096 and t.used_bytes == 2 * big.chunk_bytes + 2 * 4096
    assert [len(t._entries[k].runs) for k in bkeys[:2]] == [1, 1]
    t.delete(KEYS[0])
    t.delete(bkeys[0])
    t.put(bkeys[0], kv, None)  # into the freed big run: still one run
    assert len(t._entries[bkeys[0]].runs) == 1 and torch.equal(t.read(bkeys[0]), kv)
    assert torch.equal(t.read(KEYS[1]), small_chunk(1))
    t.check_integrity()
