"""kernels/cpu_attention.py (the CPU prefill fast path) against kernels/reference.py."""
import pytest
import torch

from kernels import cpu_attention as cpu
from kernels import ops
from kernels import reference as ref

BS, HKV, HQ, D = 4, 2, 6, 8   # 3 query heads per KV head


def pool_with_sequence(table: list[int], total: int, nb: int = 12, dtype=torch.float32):
    """A pool ``[2, nb, BS, HKV, D]`` holding ``total`` random tokens through ``table``."""
    kv = torch.zeros(2, nb, BS, HKV, D, dtype=dtype)
    pos = torch.arange(total)
    slots = torch.tensor(table)[pos // BS] * BS + pos % BS
    ref.reshape_and_cache(torch.randn(total, HKV, D), torch.randn(total, HKV, D), kv, slots)
    return kv


@pytest.mark.parametrize("table", [[7, 2, 9, 4], [3, 4, 5, 6], [6, 5, 4, 3], [4, 6, 3, 5]],
                         ids=["scattered", "consecutive", "descending", "permuted-range"])
@pytest.mark.parametrize("start,new", [(0, 13), (1, 12), (4, 9), (8, 5), (12, 1), (5, 3)])
def test_prefill_equals_reference(table, start, new):
    """Every split of cached prefix / new tokens, block-aligned or not, over both block orders."""
    torch.manual_seed(100 * start + new)
    total = start + new
    kv = pool_with_sequence(table, 16)
    q = torch.randn(new, HQ, D)
    bt = torch.tensor(table + [0, 0])            # padded like the engine's tables may be
    want = ref.paged_attention_prefill(q, kv, bt, total, D ** -0.5)
    got = cpu.paged_attention_prefill(q, kv, bt, total, D ** -0.5)
    assert got.shape == (new, HQ, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_masked_fallback_equals_reference():
    """The path used when torch lacks the CPU flash op gives the same result."""
    torch.manual_seed(1)
    kv = pool_with_sequence([5, 1, 8], 11)
    q = torch.randn(4, HQ, D)
    bt = torch.tensor([5, 1, 8])
    want = ref.paged_attention_prefill(q, kv, bt, 11, 0.3)
    got = cpu._masked(q.transpose(0, 1).unsqueeze(0), kv, bt, 11, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_pool_close_to_reference():
    """A bf16 pool: output in the query's dtype, close to the reference at bf16 precision."""
    torch.manual_seed(2)
    kv = pool_with_sequence([2, 6, 3, 9], 16, dtype=torch.bfloat16)
    q = torch.randn(7, HQ, D, dtype=torch.bfloat16)
    bt = torch.tensor([2, 6, 3, 9])
    want = ref.paged_attention_prefill(q, kv, bt, 15, D ** -0.5)
    got = cpu.paged_attention_prefill(q, kv, bt, 15, D ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_ops_selects_cpu_path_for_cpu_tensors():
    torch.manual_seed(3)
    kv = pool_with_sequence([1, 2, 3], 12)
    q = torch.randn(5, HQ, D)
    bt = torch.tensor([1, 2, 3])
    assert torch.equal(ops.paged_attention_prefill(q, kv, bt, 12, 0.5),
                       cpu.paged_attention_prefill(q, kv, bt, 12, 0.5))


def test_prefix_view_only_for_a_consecutive_range():
    """No copy for consecutive ids, or a permuted range on a block-aligned prefix; else a copy."""
    kv = torch.zeros(2, 12, BS, HKV, D)
    view = lambda t, n, any_order: cpu._prefix_kv(kv, torch.tensor(t), n, any_order)  # noqa: E731
    assert view([3, 4, 5], 12, False).data_ptr() == kv[:, 3].data_ptr()
    assert view([5, 3, 4], 12, True).data_ptr() == kv[:, 3].data_ptr()
    assert view([5, 3, 4], 12, False).data_ptr() != kv[:, 3].data_ptr()   # order matters here
    assert view([5, 3, 4], 11, True).data_ptr() != kv[:, 3].data_ptr()    # partial last block
    assert view([5, 3, 7], 12, True).data_ptr() != kv[:, 3].data_ptr()    # not one range
