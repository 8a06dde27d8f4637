"""``bench.fleet``'s table: the full run judges its targets (``MISSED`` when one is not met);
``--quick`` prints the ratios without verdicts and says the targets apply to the full run
(its small documents made ``remote_vs_recompute 4.79 MISSED`` read as a failure)."""
import io

from bench.fleet import QUICK_TARGETS_NOTE, TARGETS, print_table, unjudged_targets


def _res(quick: bool) -> dict:
    res = {"recompute_ttft_s": 0.5, "host1_read_ttft_s": 0.6, "remote_hit_ttft_s": 0.1,
           "local_hit_ttft_s": 0.05, "remote_hit_redis_get_s": 0.01, "remote_get_gbps": 1.0,
           "redis_raw_get_gbps": 1.1, "outputs_identical": True, "hits_counted_exactly": True,
           "remote_vs_recompute": 4.79, "remote_vs_local": 2.0, "remote_get_vs_raw": 0.9,
           "settings": {"num_docs": 2, "doc_tokens": 512, "chunks_per_doc": 8, "chunk_size": 64,
                        "masters": 3, "quick": quick}}
    res["targets"] = {k: {"target": f"{op} {v}",
                          "met": res[k] >= v if op == ">=" else res[k] <= v}
                      for k, (op, v) in TARGETS.items()}
    return unjudged_targets(res) if quick else res


def _table(res: dict) -> list[str]:
    out = io.StringIO()
    print_table(res, out)
    return out.getvalue().splitlines()


def test_the_full_run_judges_the_targets():
    lines = _table(_res(quick=False))
    row = next(line for line in lines if "remote_vs_recompute" in line)
    assert "(target >= 10.0)" in row and row.endswith("4.79  MISSED")
    assert next(line for line in lines if "remote_get_vs_raw" in line).endswith("0.90")
    assert not any("targets apply" in line for line in lines)


def test_quick_prints_the_ratios_without_verdicts():
    res = _res(quick=True)
    assert all(t["met"] is None for t in res["targets"].values())
    lines = _table(res)
    row = next(line for line in lines if "remote_vs_recompute" in line)
    assert row.split() == ["remote_vs_recompute", "4.79"]
    assert not any("MISSED" in line or "(target " in line for line in lines[:-1])
    assert lines[-1] == f"  ({QUICK_TARGETS_NOTE})"
    assert res["targets_note"].startswith("targets apply to the full run")
