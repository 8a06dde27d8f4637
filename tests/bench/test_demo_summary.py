"""``bench.demo.summarize``: each target marked met or missed from the two reports' speed-ups,
configurations with failed requests listed apart (a missed speed target is not a failure)."""
from __future__ import annotations

from bench.demo import TARGETS, summarize


def _rep(pair: str, ratio: float | None, failed: int = 0) -> dict:
    return {"speedups": {"ttft_p50_s": {} if ratio is None else {pair: ratio}},
            "configs": {"recompute": {"num_ok": 8, "num_failed": 0},
                        "kvstore-remote": {"num_ok": 8 - failed, "num_failed": failed}}}


def test_targets_are_marked_met_or_missed_and_failures_kept_apart(capsys):
    (b1, _, p1, t1), (b2, _, p2, t2) = TARGETS
    s = summarize({b1: _rep(p1, t1 + 0.5), b2: _rep(p2, t2 - 4.0, failed=1)}, 300.0,
                  [6.5, 5.0, 4.0])
    assert [(t["measured"], t["met"]) for t in s["targets"]] == [(t1 + 0.5, True),
                                                                  (t2 - 4.0, False)]
    assert s["missed_targets"] == [f"{b2}/{p2}"]
    assert s["failed"] == [f"{b2}/kvstore-remote"]
    assert s["load_average"] == [6.5, 5.0, 4.0]
    out = capsys.readouterr().out
    assert f"(target >= {t2:.0f}x: MISSED)" in out and "load average 6.5" in out
    s = summarize({b1: _rep(p1, None), b2: _rep(p2, t2)}, 1.0, [0.1, 0.1, 0.1])
    assert [t["met"] for t in s["targets"]] == [False, True]       # no figure: not met
    assert s["missed_targets"] == [f"{b1}/{p1}"] and s["failed"] == []
