"""bench.miss_cost: the figures from the pairs (exact medians), and the quick run whole (three
``engine_min serve`` servers and a daemon on the real model)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.miss_cost import build_parser, cold_requests, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_summary_is_the_median_over_pairs_of_each_pairs_median():
    pairs = [{"no_store": [1.0, 1.2, 1.1], "inprocess": [1.1, 1.0, 1.3], "daemon": [2.0, 1.2, 1.2]},
             {"no_store": [2.0, 2.0, 2.0], "inprocess": [2.1, 2.2, 2.2], "daemon": [1.9, 2.0, 2.0]},
             {"no_store": [1.0, 1.0, 1.0], "inprocess": [1.0, 1.0, 1.0], "daemon": [1.5, 1.5, 9.0]}]
    s = summarize(pairs)
    # per pair: no_store 1.1, 2.0, 1.0; inprocess 1.1, 2.2, 1.0; daemon 1.2, 2.0, 1.5
    assert s["pair_ttft_s"] == {"no_store": [1.1, 2.0, 1.0], "inprocess": [1.1, 2.2, 1.0],
                                "daemon": [1.2, 2.0, 1.5]}
    assert (s["no_store_ttft_s"], s["inprocess_ttft_s"], s["daemon_ttft_s"]) == (1.1, 1.1, 1.5)
    assert s["inprocess_overhead"] == pytest.approx(0.0)           # 0, 0.1, 0 -> 0
    assert s["daemon_overhead"] == pytest.approx(1.2 / 1.1 - 1)    # 0.0909, 0, 0.5


def test_cold_prompts_are_unique_and_of_the_asked_length():
    args = build_parser().parse_args(["--pairs", "2", "--requests-per-pair", "2",
                                      "--prompt-tokens", "40"])
    reqs = cold_requests(args)
    assert len(reqs) == 2 * 3 * 2 and {len(r.prompt) for r in reqs} == {40}
    assert len({r.prompt[:16] for r in reqs}) == len(reqs)        # no shared first block


def test_quick_run_writes_every_figure(tmp_path):
    out = tmp_path / "miss.json"
    proc = subprocess.run([sys.executable, "-m", "bench.miss_cost", "--quick", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for k in ("no_store_ttft_s", "inprocess_ttft_s", "daemon_ttft_s"):
        assert res[k] > 0, k
    assert len(res["pairs"]) == 1 and res["pairs"][0]["order"] == ["no_store", "inprocess",
                                                                   "daemon"]
    assert [len(res["pairs"][0][n]) for n in ("no_store", "inprocess", "daemon")] == [1, 1, 1]
    assert len(res["load_avg"]) == 2
