"""The copy streams (``kvstore.tiers.copy_stream``): inline copies complete at once, the manual
stream's copies land only when completed (in issue order), ``run_pairs`` maps a chunk's page
runs in one pool onto its runs in another byte for byte. The CUDA stream's test is marked
``gpu`` (skipped without CUDA)."""

import pytest
import torch

from kvstore.tiers.copy_stream import (CudaCopyStream, InlineCopyStream, ManualCopyStream,
                                       make_copy_stream, run_pairs)


def test_inline_copy_is_complete_when_returned():
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    h = InlineCopyStream().copy_async(dst, src)
    assert h.done() and torch.equal(dst, src)
    h.wait()  # no-op
    assert isinstance(make_copy_stream("cpu"), InlineCopyStream)


def test_manual_copies_land_in_issue_order_when_completed():
    s = ManualCopyStream()
    src = torch.arange(1, 9, dtype=torch.uint8)
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    ha = s.copy_async(a, src[:4])
    hb = s.copy_runs_async([(b[:2], src[4:6]), (b[2:], src[6:])])
    assert s.num_pending == 2 and not ha.done() and not hb.done()
    assert a.tolist() == [0, 0, 0, 0]          # nothing copied yet
    assert s.complete(1) == 1
    assert ha.done() and not hb.done() and a.tolist() == [1, 2, 3, 4] and b.tolist() == [0] * 4
    src[4:] = 9                                # the source changes before the copy runs ...
    hb.wait()
    assert b.tolist() == [9, 9, 9, 9] and s.num_pending == 0  # ... so the copy sees it


def test_manual_wait_runs_everything_issued_before():
    s = ManualCopyStream()
    dsts = [torch.zeros(2, dtype=torch.uint8) for _ in range(3)]
    hs = [s.copy_async(d, torch.full((2,), i + 1, dtype=torch.uint8)) for i, d in enumerate(dsts)]
    hs[1].wait()
    assert [h.done() for h in hs] == [True, True, False]
    assert [d.tolist() for d in dsts] == [[1, 1], [2, 2], [0, 0]]
    s.synchronize()
    assert hs[2].done() and dsts[2].tolist() == [3, 3]


def test_copy_of_different_sizes_is_refused():
    for s in (InlineCopyStream(), ManualCopyStream()):
        with pytest.raises(ValueError, match="copy of 4 bytes into 8"):
            s.copy_async(torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
    assert s.num_pending == 0


def test_run_pairs_splits_where_either_side_changes_run():
    src_pool = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dst_pool = torch.zeros(64, dtype=torch.uint8)
    # 16 bytes: src at [100, 104) + [200, 212); dst at [0, 8) + [32, 40)
    pairs = run_pairs(dst_pool, ((0, 8), (32, 8)), src_pool, ((100, 4), (200, 12)))
    assert [d.numel() for d, _ in pairs] == [4, 4, 8]
    for d, s in pairs:
        d.copy_(s)
    assert dst_pool[:8].tolist() == [100, 101, 102, 103, 200, 201, 202, 203]
    assert dst_pool[32:40].tolist() == list(range(204, 212))
    assert dst_pool[8:32].sum() == 0 and dst_pool[40:].sum() == 0


@pytest.mark.gpu
def test_cuda_copy_waits_for_the_producer_kernel():
    """A device-to-host copy issued right after a kernel that writes the source reads the
    kernel's result (the side stream waits for the current stream's event)."""
    s = CudaCopyStream("cuda")
    src = torch.zeros(1 << 24, dtype=torch.float32, device="cuda")
    dst = torch.empty(1 << 24, dtype=torch.float32, pin_memory=True)
    for i in range(1, 6):
        src.fill_(float(i))                      # the producer, on the current stream
        src.mul_(3.0)
        h = s.copy_async(dst, src)
        h.wait()
        assert h.done() and bool((dst == 3.0 * i).all())
