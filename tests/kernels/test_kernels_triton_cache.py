"""kernels/triton_cache.py (chunk gather/scatter, block copies) against kernels/reference.py.

On every machine the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU
tensors: the same kernel code, the same index arithmetic and masks, executed by numpy. They are
copies, so the results must equal the reference's bit for bit. The ``gpu``-marked tests run the
compiled kernels on CUDA (skipped on CPU-only machines, tests/conftest.py).
"""
import pytest
import torch

from kernels import reference as ref

pytest.importorskip("triton")
from tests.kernels.triton_interp import load_interpreted  # noqa: E402


@pytest.fixture(scope="module")
def tc():
    return load_interpreted("triton_cache")


def _pool(layers, nb, bs, h, d, dtype, device="cpu", seed=0):
    """A random ``[layers, 2, nb, bs, h, d]`` pool with a NaN, an inf and a -0.0 in it (copies
    must keep every bit)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(layers, 2, nb, bs, h, d, generator=g).to(dtype)
        flat = x.view(-1)
        flat[3], flat[-2], flat[min(7, flat.numel() - 1)] = float("nan"), float("inf"), -0.0
    else:
        x = torch.randint(-100, 100, (layers, 2, nb, bs, h, d), generator=g).to(dtype)
    return x.to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


# (layers, num_blocks, block_size, num_kv_heads, head_dim): SmolLM2's heads; one KV head;
# odd sizes (tile masks); a block of 5,120 elements (two tiles of 4,096, the second masked)
SHAPES = [(2, 9, 4, 3, 64), (3, 17, 16, 1, 8), (1, 6, 2, 3, 5), (1, 4, 16, 2, 160)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]
IDS = [7, 2, 5, 0, 3]   # not contiguous, not sorted, the null block included


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_equals_reference(tc, shape, dtype):
    layers, nb, bs, h, d = shape
    pool = _pool(layers, nb, bs, h, d, dtype)
    before = pool.clone()
    ids = [i % nb for i in IDS]
    got = tc.gather_chunk(pool, ids)
    assert got.shape == (layers, 2, len(ids) * bs, h, d) and got.is_contiguous()
    assert _same_bits(got, ref.gather_chunk(pool, ids))
    assert _same_bits(pool, before)                              # the pool is only read
    # block i of the chunk is pool block ids[i], token by token
    assert _same_bits(got[:, :, bs:2 * bs], pool[:, :, ids[1]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_equals_reference(tc, shape, dtype):
    layers, nb, bs, h, d = shape
    ids = [i % nb for i in IDS][:3]
    chunk = _pool(layers, 1, len(ids) * bs, h, d, dtype, seed=1)[:, :, 0]  # [L, 2, 3*bs, h, d]
    want, got = _pool(layers, nb, bs, h, d, dtype), _pool(layers, nb, bs, h, d, dtype)
    ref.scatter_chunk(want, ids, chunk)
    tc.scatter_chunk(got, ids, chunk)
    assert _same_bits(got, want)                  # written blocks and untouched ones alike
    assert _same_bits(tc.gather_chunk(got, ids), chunk)          # the round trip


def test_ids_as_tensor_and_empty(tc):
    pool = _pool(2, 8, 4, 3, 8, torch.float16)
    ids = torch.tensor([6, 1, 4])
    assert _same_bits(tc.gather_chunk(pool, ids), ref.gather_chunk(pool, ids))
    empty = tc.gather_chunk(pool, [])
    assert empty.shape == (2, 2, 0, 3, 8)
    before = pool.clone()
    tc.scatter_chunk(pool, [], empty)
    tc.copy_blocks(pool, [], [])
    assert _same_bits(pool, before)


def test_scatter_converts_dtype_and_reads_strided_chunks(tc):
    """As the connector's load does: a float32 slice of a longer chunk into a float16 pool."""
    pool_ref, pool = _pool(2, 8, 4, 3, 8, torch.float16), _pool(2, 8, 4, 3, 8, torch.float16)
    long = torch.randn(2, 2, 20, 3, 8)
    piece = long[:, :, 4:12]                          # [2, 2, 8, 3, 8], not contiguous
    ref.scatter_chunk(pool_ref, [5, 2], piece)
    tc.scatter_chunk(pool, [5, 2], piece)
    assert _same_bits(pool, pool_ref)


def test_pool_view_with_contiguous_blocks(tc):
    """A view of a bigger pool (blocks 2..8): strides of the whole pool, blocks contiguous."""
    big = _pool(2, 12, 4, 3, 8, torch.float32)
    view = big[:, :, 2:9]
    assert _same_bits(tc.gather_chunk(view, [6, 0, 3]), ref.gather_chunk(view, [6, 0, 3]))
    want = big.clone()
    chunk = torch.randn(2, 2, 8, 3, 8)
    ref.scatter_chunk(want[:, :, 2:9], [1, 4], chunk)
    tc.scatter_chunk(view, [1, 4], chunk)
    assert _same_bits(big, want)                      # blocks outside the view untouched


@pytest.mark.parametrize("src, dst", [([1, 2], [5, 6]), ([1, 2], [2, 3]), ([4], [4]),
                                      ([3, 3], [0, 7])])
def test_copy_blocks_equals_reference(tc, src, dst):
    """Disjoint, overlapping (block 2 is read before it is written), self, repeated source."""
    want, got = _pool(2, 8, 4, 3, 8, torch.bfloat16), _pool(2, 8, 4, 3, 8, torch.bfloat16)
    ref.copy_blocks(want, src, dst)
    tc.copy_blocks(got, src, dst)
    assert _same_bits(got, want)


@pytest.mark.parametrize("bad", [[1, 8], [-1], [2, 100]])
def test_out_of_range_block_ids_are_refused(tc, bad):
    pool = _pool(2, 8, 4, 3, 8, torch.float16)
    before = pool.clone()
    with pytest.raises(IndexError):
        ref.gather_chunk(pool, bad)                   # the reference refuses them too
    with pytest.raises(ValueError, match=r"block id (8|-1|100) is outside the pool's 8 blocks"):
        tc.gather_chunk(pool, bad)
    chunk = torch.zeros(2, 2, 4 * len(bad), 3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="outside the pool's 8 blocks"):
        tc.scatter_chunk(pool, bad, chunk)
    with pytest.raises(ValueError, match="outside the pool's 8 blocks"):
        tc.copy_blocks(pool, [0] * len(bad), bad)
    with pytest.raises(ValueError, match="outside the pool's 8 blocks"):
        tc.copy_blocks(pool, bad, [0, 1, 2][:len(bad)])
    assert _same_bits(pool, before)                   # nothing written


def test_bad_input_is_refused_and_nothing_written(tc):
    pool = _pool(2, 8, 4, 3, 8, torch.float16)
    before = pool.clone()
    chunk = torch.zeros(2, 2, 12, 3, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"chunk shape \[2, 2, 12, 3, 8\] does not fit 2 "
                                         r"blocks: expected \[2, 2, 8, 3, 8\]"):
        tc.scatter_chunk(pool, [1, 2], chunk)
    with pytest.raises(ValueError, match="block id repeats"):
        tc.scatter_chunk(pool, [1, 2, 1], chunk)
    with pytest.raises(ValueError, match="block id repeats"):
        tc.copy_blocks(pool, [1, 2], [3, 3])
    with pytest.raises(ValueError, match="2 source blocks, 1 destinations"):
        tc.copy_blocks(pool, [1, 2], [3])
    with pytest.raises(ValueError, match="1-D list of block ids"):
        tc.gather_chunk(pool, [[1, 2]])
    with pytest.raises(ValueError, match="must be contiguous"):
        tc.gather_chunk(pool.transpose(4, 5), [1])    # [.., head_dim, num_kv_heads] view
    with pytest.raises(ValueError, match=r"must be \[num_layers, 2, num_blocks"):
        tc.gather_chunk(pool[0], [1])
    assert _same_bits(pool, before)


def test_more_blocks_than_one_launch_takes(tc, monkeypatch):
    """Past CUDA's grid limit the blocks are copied in turns (here 2 blocks per launch)."""
    monkeypatch.setattr(tc, "MAX_BLOCKS_PER_LAUNCH", 2)
    pool = _pool(2, 9, 4, 3, 8, torch.float16)
    ids = [8, 1, 6, 3, 0]
    assert _same_bits(tc.gather_chunk(pool, ids), ref.gather_chunk(pool, ids))
    chunk = torch.randn(2, 2, 20, 3, 8)
    want, got = pool.clone(), pool.clone()
    ref.scatter_chunk(want, ids, chunk)
    tc.scatter_chunk(got, ids, chunk)
    assert _same_bits(got, want)
    ref.copy_blocks(want, [1, 2, 3], [4, 5, 7])
    tc.copy_blocks(got, [1, 2, 3], [4, 5, 7])
    assert _same_bits(got, want)


# --- compiled kernels on CUDA (skipped without CUDA and Triton) ---------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_kernels_equal_reference(dtype):
    from kernels import ops, triton_cache
    layers, nb, bs, h, d = 30, 64, 16, 3, 64                     # SmolLM2-135M's KV
    pool = _pool(layers, nb, bs, h, d, dtype, device="cuda")
    ids = torch.randperm(nb - 1)[:9].add(1).tolist()
    assert _same_bits(triton_cache.gather_chunk(pool, ids), ref.gather_chunk(pool, ids))
    assert _same_bits(ops.gather_chunk(pool, ids), ref.gather_chunk(pool, ids))
    chunk = torch.randn(layers, 2, 9 * bs, h, d, device="cuda")
    want, got = pool.clone(), pool.clone()
    ref.scatter_chunk(want, ids, chunk)
    ops.scatter_chunk(got, ids, chunk.cpu())                     # a host chunk, as from the store
    assert _same_bits(got, want)
    ref.copy_blocks(want, ids[:4], ids[3:7])
    ops.copy_blocks(got, ids[:4], ids[3:7])
    assert _same_bits(got, want)

