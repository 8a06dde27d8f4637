"""Layer-wise loads of the vLLM connector's worker side, without vLLM: a 3-layer paged cache
``[num_blocks, block_size, 2, H, D]`` per layer, chunks read from a store stub, the scatter of
one layer held back to show that a layer's wait depends on that layer only."""
from __future__ import annotations

import threading

import pytest
import torch

from connectors.vllm.paged_layout import PagedLayout
from connectors.vllm.records import ChunkTransfer
from connectors.vllm.shared import Counters, StoreCalls
from connectors.vllm.worker import WorkerSide
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

L, H, D, BS, NB, C = 3, 2, 4, 4, 6, 8          # layers, heads, head dim, block, blocks, chunk
LAY = KVLayout(L, H, D, "float32", C)
NS = Namespace("m", LAY)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
TOKENS = list(range(100, 124))                   # 3 chunks


class Store:
    """``get_chunks`` from a dict; ``fail``: raise instead; ``missing``: keys answered None."""

    def __init__(self, chunks: dict, fail: bool = False, missing=()):
        self.chunks, self.fail, self.missing = chunks, fail, set(missing)

    def get_chunks(self, ns, keys):
        if self.fail:
            raise TimeoutError("injected deadline")
        return [None if k in self.missing else self.chunks[k] for k in keys]


def _worker(store: Store, layerwise: bool) -> WorkerSide:
    w = WorkerSide(LAY, NAMES, BS, NB, StoreCalls(store, False, 1.0), Counters(), 1 << 20,
                   lambda: {}, layerwise=layerwise)
    w.register({n: torch.zeros(NB, BS, 2, H, D) for n in NAMES})
    cache = w.kv_caches[NAMES[0]]
    inner = torch.arange(BS * 2 * H * D).view(BS, 2, H, D)    # [token, K/V, head, dim]
    w.paged = PagedLayout(BS, 0, inner, int(cache.stride(0)), tuple(cache.shape),
                          tuple(cache.stride()))
    return w


def _chunks() -> tuple[list, dict]:
    keys = NS.chunk_keys(TOKENS)
    g = torch.Generator().manual_seed(0)
    return keys, {k: torch.randn(LAY.shape(), generator=g) for k in keys}


# block table of the request: token t in block BLOCKS[t // BS]
BLOCKS = [5, 0, 3, 1, 4, 2]


def _cache_kv(w: WorkerSide, layer: int, lo: int, hi: int) -> torch.Tensor:
    """``[2, hi - lo, H, D]`` read back from layer ``layer``'s paged cache."""
    cache = w.kv_caches[NAMES[layer]]
    rows = [cache[BLOCKS[t // BS], t % BS] for t in range(lo, hi)]   # each [2, H, D]
    return torch.stack(rows, dim=1)


def _transfer(keys) -> ChunkTransfer:
    # tokens [4, 22): vLLM has [0, 4); the last 2 tokens of chunk 2 are computed
    return ChunkTransfer("r", NS, 0, list(keys), 4, 22, BLOCKS)


def _expected(chunks, keys, layer: int, lo: int, hi: int) -> torch.Tensor:
    kv = torch.cat([chunks[k] for k in keys], dim=2)              # [L, 2, 24, H, D]
    return kv[layer, :, lo:hi]


@pytest.mark.parametrize("layerwise", [True, False])
def test_loads_write_exactly_the_planned_tokens_of_every_layer(layerwise):
    keys, chunks = _chunks()
    w = _worker(Store(chunks), layerwise)
    w.start_load([_transfer(keys)])
    for name in NAMES:
        w.wait_layer(name)
    w.finish_load()
    for layer in range(L):
        assert torch.equal(_cache_kv(w, layer, 4, 22), _expected(chunks, keys, layer, 4, 22))
        assert not _cache_kv(w, layer, 0, 4).any() and not _cache_kv(w, layer, 22, 24).any()
    assert w.counters.values["loaded_tokens"] == 18 and w.counters.values["loaded_chunks"] == 3
    assert w.failed_blocks() == set()
    w.close()


def test_a_layer_waits_only_for_its_own_layer():
    keys, chunks = _chunks()
    w = _worker(Store(chunks), layerwise=True)
    gate, at_layer_1 = threading.Event(), threading.Event()
    real = w._scatter_layer

    def held(moves, layer):                  # layer 1's scatter waits for the gate
        if layer == 1:
            at_layer_1.set()
            assert gate.wait(10)
        real(moves, layer)

    w._scatter_layer = held
    w.start_load([_transfer(keys)])
    w.wait_layer(NAMES[0])                   # returns while layer 1 is held back
    assert at_layer_1.wait(10)
    assert torch.equal(_cache_kv(w, 0, 4, 22), _expected(chunks, keys, 0, 4, 22))
    assert not _cache_kv(w, 1, 4, 22).any() and not _cache_kv(w, 2, 4, 22).any()
    released = threading.Event()
    t = threading.Thread(target=lambda: (w.wait_layer(NAMES[2]), released.set()))
    t.start()
    assert not released.wait(0.2)            # layer 2 waits behind layer 1
    gate.set()
    assert released.wait(10)
    w.finish_load()
    assert torch.equal(_cache_kv(w, 2, 4, 22), _expected(chunks, keys, 2, 4, 22))
    w.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_failed_read_marks_blocks_failed_and_releases_every_layer(layerwise):
    keys, chunks = _chunks()
    w = _worker(Store(chunks, fail=True), layerwise)
    w.start_load([_transfer(keys)])
    for name in NAMES:
        w.wait_layer(name)
    w.finish_load()
    assert w.failed_blocks() == {BLOCKS[j] for j in range(1, 6)}   # tokens [4, 22)
    assert w.counters.values["load_errors"] == 1 and w.counters.values["loaded_tokens"] == 0
    w.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_missing_chunk_stops_the_load_there(layerwise):
    keys, chunks = _chunks()
    w = _worker(Store(chunks, missing=[keys[1]]), layerwise)
    piece = ChunkTransfer("r", NS, 2, [keys[2]], 16, 22, BLOCKS)   # a later transfer of "r"
    w.start_load([ChunkTransfer("r", NS, 0, list(keys[:2]), 4, 16, BLOCKS), piece])
    w.finish_load()
    # chunk 0 landed (tokens [4, 8)); chunk 1 missing: blocks of [8, 22) recomputed, and the
    # later transfer of the same request is not read
    assert w.failed_blocks() == {BLOCKS[j] for j in range(2, 6)}
    assert w.counters.values["loaded_tokens"] == 4 and w.counters.values["load_errors"] == 1
    for layer in range(L):
        assert torch.equal(_cache_kv(w, layer, 4, 8), _expected(chunks, keys, layer, 4, 8))
        assert not _cache_kv(w, layer, 8, 24).any()
    w.close()


def test_an_error_while_scattering_fails_the_whole_load():
    keys, chunks = _chunks()
    w = _worker(Store(chunks), layerwise=True)

    def broken(moves, layer):
        raise RuntimeError("scatter broke")

    w._scatter_layer = broken
    w.start_load([_transfer(keys)])
    w.wait_layer(NAMES[2])
    w.finish_load()
    assert w.failed_blocks() == {BLOCKS[j] for j in range(1, 6)}
    w.close()


def test_auto_loads_whole_on_cpu_caches():
    w = _worker(Store({}), layerwise=None)
    assert w.layerwise is False          # CPU caches: copies would take the forward's cores
