"""bench.gpu_check, the prepared GPU script, run on a machine without CUDA (as CI does): it exits
0 quickly, says what it skipped and why, and its CPU-meaningful checks report real figures."""
import json
import subprocess
import sys

import pytest
import torch

from bench import gpu_check

# one 256-token chunk of SmolLM2-135M's KV at float16: 30 layers x K,V x 256 x 3 heads x 64 x 2 B
CHUNK_BYTES = 30 * 2 * 256 * 3 * 64 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; CUDA has its own")
def test_cpu_run_exits_0_with_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert json.loads(proc.stdout) == res
    assert res["cuda"] is False and res["device"] == "cpu" and res["ok"] is True
    assert set(res["skipped"]) >= {"kernels", "model_logits", "long_doc_ttft",
                                   "layerwise_ttft", "gpu_tests"}
    assert "test_kernels_triton_cache.py" in res["skipped"]["kernels"]
    checks = res["checks"]
    bw = checks["chunk_copy_bandwidth"]
    assert bw["ok"] and bw["impl"] == "reference"
    assert bw["chunk"]["blocks"] == 16 and bw["chunk"]["bytes"] == CHUNK_BYTES
    for k in ("copy_GBps", "gather_GBps", "scatter_GBps"):
        assert bw["chunk"][k] > 0 and bw["bulk"][k] > 0
    assert bw["ratio"] == min(bw["bulk"]["gather_ratio"], bw["bulk"]["scatter_ratio"])
    host = checks["host_copy_bandwidth"]
    assert host["ok"] and host["pinned"] is False and host["bytes"] == 4 * CHUNK_BYTES
    if host["path"].startswith("store tiers"):       # the store's own spill and load path ran
        assert host["bit_exact"] is True and host["store_d2h_GBps"] > 0
    if "spill_roundtrip" in checks:
        spill = checks["spill_roundtrip"]
        assert spill["ok"] and spill["mismatches"] == 0 and spill["spills"] > 0
    else:
        assert "spill_roundtrip" in res["skipped"]
    # CPU figures are not a GPU's: each target says what was measured, met is null
    for name, t in res["targets"].items():
        assert t["met"] is None and t["value"] == checks[name].get("ratio")
    assert all(c["seconds"] >= 0 for c in checks.values())


def test_targets_met_only_on_cuda():
    checks = {"chunk_copy_bandwidth": {"ratio": 0.69}, "host_copy_bandwidth": {"ratio": 0.9}}
    t = gpu_check.targets(checks, cuda=True)
    assert t["chunk_copy_bandwidth"] == {"target": 0.70, "value": 0.69, "met": False}
    assert t["host_copy_bandwidth"] == {"target": 0.90, "value": 0.9, "met": True}
    assert gpu_check.targets(checks, cuda=False)["host_copy_bandwidth"]["met"] is None
    assert gpu_check.targets({}, cuda=True)["chunk_copy_bandwidth"]["met"] is None


def test_a_failing_check_is_recorded_and_the_exit_status_is_1(monkeypatch, tmp_path, capsys):
    def plan(device, args):
        return {"boom": lambda: {"ok": 1 / 0}, "fine": lambda: {"ok": True, "x": 3}}, {}

    monkeypatch.setattr(gpu_check, "plan", plan)
    out = tmp_path / "r.json"
    assert gpu_check.main(["--device", "cpu", "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["ok"] is False
    assert res["checks"]["boom"]["ok"] is False
    assert res["checks"]["boom"]["error"] == "ZeroDivisionError: division by zero"
    assert res["checks"]["fine"]["ok"] is True and res["checks"]["fine"]["x"] == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there")
def test_cuda_asked_for_without_cuda_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_kernel_check_code_runs_on_the_reference():
    """The kernel check's own code (shapes, dtypes, comparisons) on the CPU, where ops picks the
    reference: everything equal, the decode error 0."""
    from bench.gpu_check_kernels import kernel_check
    res = kernel_check("cpu")
    assert res["ok"] is True and res["impl"] == "reference"
    for dtype in ("float16", "bfloat16", "float32"):
        r = res[dtype]
        assert r["gather"] and r["scatter"] and r["copy_blocks"] and r["reshape_and_cache"]
        assert r["decode_max_abs_err"] == 0.0 and r["decode"]


def test_host_copy_says_when_only_plain_copies_were_timed(monkeypatch):
    """Tiers without a pool-to-pool copy (an older store): the plain copies are timed, the
    result says so and claims no ratio."""
    from bench import gpu_check_kernels as kern

    class Bare:
        def close(self):
            pass

    monkeypatch.setattr(kern, "_store_tiers", lambda device, nbytes, page: (Bare(), Bare()))
    res = kern.host_copy_bandwidth("cpu", quick=True, reps=1)
    assert res["ok"] and res["path"].startswith("plain tensor.copy_ only")
    assert "ratio" not in res and res["plain_d2h_GBps"] > 0 and res["plain_h2d_GBps"] > 0
    assert gpu_check.targets({"host_copy_bandwidth": res}, cuda=True)["host_copy_bandwidth"] == \
        {"target": 0.90, "value": None, "met": None}


def test_layerwise_check_runs_the_comparison_on_the_real_model():
    """The check gpu_check runs on CUDA, here on the CPU on a short document: both modes hit,
    outputs equal the engine's without a store, nothing falls back."""
    res = gpu_check.layerwise_ttft_check("cpu", 320, rounds=2)
    assert res["ok"] is True and res["outputs_identical"] is True
    for mode in ("whole", "layerwise"):
        assert res[mode]["fallbacks"] == 0 and len(res[mode]["ttft_hit_runs_s"]) == 2
        assert res[mode]["loaded_tokens"] >= 2 * 256   # the document's full chunk, each hit
    assert res["layerwise_over_whole"] > 0
