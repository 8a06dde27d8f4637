"""kernels/reference.py against dense attention written out by hand (tiny random sizes)."""
import math

import pytest
import torch

from kernels import reference as ref

L, NB, BS, HKV, HQ, D = 2, 8, 4, 2, 4, 8


def dense_attention(q, k, v, qpos):
    """q [N, HQ, D] at positions qpos [N]; k, v [S, HKV, D]; causal by position; GQA h // G."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)       # [S, HQ, D]
    scores = torch.einsum("nhd,shd->hns", q, k) / math.sqrt(q.shape[-1])
    mask = torch.arange(k.shape[0])[None, :] > qpos[:, None]         # [N, S]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v)


def fill(kv_layer, table, k, v):
    """Write k, v [S, HKV, D] as a sequence's tokens 0..S-1 through reshape_and_cache."""
    pos = torch.arange(k.shape[0])
    slots = torch.tensor(table)[pos // BS] * BS + pos % BS
    ref.reshape_and_cache(k, v, kv_layer, slots)


def test_reshape_and_cache_writes_exact_slots():
    kv = torch.zeros(2, NB, BS, HKV, D)
    key, val = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    ref.reshape_and_cache(key, val, kv, torch.tensor([5 * BS + 1, 2 * BS + 3, 7 * BS]))
    assert torch.equal(kv[0, 5, 1], key[0]) and torch.equal(kv[0, 2, 3], key[1])
    assert torch.equal(kv[1, 7, 0], val[2])
    assert int((kv != 0).any(-1).any(-1).sum()) == 2 * 3  # nothing else touched


def test_decode_matches_dense_over_scattered_blocks():
    torch.manual_seed(0)
    kv = torch.zeros(2, NB, BS, HKV, D)
    tables, lens = [[3, 6, 1], [7, 2, 0]], [10, 5]       # second table padded with null block 0
    ks, vs = [], []
    for t, n in zip(tables, lens):
        k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        fill(kv, t, k, v)
        ks.append(k), vs.append(v)
    q = torch.randn(2, HQ, D)
    out = ref.paged_attention_decode(q, kv, torch.tensor(tables), torch.tensor(lens), D ** -0.5)
    for i in range(2):
        want = dense_attention(q[i:i + 1], ks[i], vs[i], torch.tensor([lens[i] - 1]))
        torch.testing.assert_close(out[i:i + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start", [0, 3, 8])
def test_prefill_with_cached_prefix_matches_dense(start):
    torch.manual_seed(start)
    kv = torch.zeros(2, NB, BS, HKV, D)
    table, total = [4, 1, 6], 11
    k, v = torch.randn(total, HKV, D), torch.randn(total, HKV, D)
    fill(kv, table, k, v)
    q = torch.randn(total - start, HQ, D)
    out = ref.paged_attention_prefill(q, kv, torch.tensor(table), total, D ** -0.5)
    want = dense_attention(q, k, v, torch.arange(start, total))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_gather_scatter_chunk_layout_and_roundtrip():
    cache = torch.randn(L, 2, NB, BS, HKV, D)
    chunk = ref.gather_chunk(cache, [5, 2])
    assert chunk.shape == (L, 2, 2 * BS, HKV, D)
    assert torch.equal(chunk[:, :, :BS], cache[:, :, 5]) and torch.equal(chunk[:, :, BS:], cache[:, :, 2])
    other = torch.zeros_like(cache)
    ref.scatter_chunk(other, [1, 7], chunk)
    assert torch.equal(other[:, :, 1], cache[:, :, 5]) and torch.equal(other[:, :, 7], cache[:, :, 2])
    assert int(other.abs().sum(dim=(0, 1, 3, 4, 5)).ne(0).sum()) == 2
    with pytest.raises(ValueError, match="does not fit 3 blocks"):
        ref.scatter_chunk(other, [1, 2, 3], chunk)


def test_copy_blocks():
    cache = torch.randn(L, 2, NB, BS, HKV, D)
    before = cache.clone()
    ref.copy_blocks(cache, [3], [6])
    assert torch.equal(cache[:, :, 6], before[:, :, 3])
    assert torch.equal(cache[:, :, :6], before[:, :, :6])
