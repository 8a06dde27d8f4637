"""Triton kernels against kernels/reference.py on CUDA (skipped on CPU-only machines)."""
import pytest
import torch

from kernels import reference as ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tri():
    from kernels import triton_attention
    return triton_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d, bs", [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 80, 8)])
def test_decode_matches_reference(tri, dtype, hq, hkv, d, bs):
    torch.manual_seed(0)
    nb, b = 64, 5
    kv = torch.randn(2, nb, bs, hkv, d, device="cuda", dtype=dtype)
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 2, 7 * bs], device="cuda")
    width = 7
    tables = torch.zeros(b, width, dtype=torch.long, device="cuda")
    perm = torch.randperm(nb - 1, device="cuda")[: b * width].view(b, width) + 1
    for i, n in enumerate(lens.tolist()):
        k = -(-n // bs)
        tables[i, :k] = perm[i, :k]                     # scattered blocks, padded with null block 0
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
    want = ref.paged_attention_decode(q, kv, tables, lens, d ** -0.5)
    got = tri.paged_attention_decode(q, kv, tables, lens, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reshape_and_cache_matches_reference(tri, dtype):
    torch.manual_seed(1)
    nb, bs, h, d, t = 16, 16, 3, 64, 37
    qkv = torch.randn(t, (9 + 2 * h) * d, device="cuda", dtype=dtype)    # strided views, as in the model
    key, value = qkv[:, 9 * d:(9 + h) * d].view(t, h, d), qkv[:, (9 + h) * d:].view(t, h, d)
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    a = torch.zeros(2, nb, bs, h, d, device="cuda", dtype=dtype)
    b = torch.zeros_like(a)
    ref.reshape_and_cache(key, value, a, slots)
    tri.reshape_and_cache(key, value, b, slots)
    assert torch.equal(a, b)
