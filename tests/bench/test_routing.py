"""bench.routing, bench.routing_figures and ``bench.multi_round_qa --engines``: the session
schedule, the figures from hand-made counter increases (exact), the flags, and the quick run
whole (two real engines behind ``python -m engine_min route``, each policy without and with a
shared ``kvstore serve``)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.client import RequestResult
from bench.multi_round_qa import build_parser, resolve_defaults, workload_from_args
from bench.routing import parse_policies, session_requests
from bench.routing_figures import histogram_quantile, routed_figures, targets
from bench.servers import ServerGroup
from bench.workloads import MultiRoundQA

ROOT = Path(__file__).resolve().parents[2]
E0, E1 = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def test_sessions_run_back_to_back_with_a_bounded_number_active():
    reqs = MultiRoundQA(num_users=4, num_rounds=3, system_tokens=8, context_tokens=16,
                        question_tokens=4, answer_tokens=2, qps=2.0).requests()
    out = session_requests(reqs, active_users=2)
    assert [r.request_id for r in out] == [f"u{u}-r{r}" for u in range(4) for r in range(3)]
    assert [r.after for r in out] == [None, "u0-r0", "u0-r1", None, "u1-r0", "u1-r1",
                                      "u0-r2", "u2-r0", "u2-r1", "u1-r2", "u3-r0", "u3-r1"]
    # round 0 of user u arrived at u / qps in the round-major order; later rounds keep it
    assert [r.arrival_s for r in out] == [0.0] * 3 + [0.5] * 3 + [1.0] * 3 + [1.5] * 3
    by_id = {r.request_id: r for r in reqs}
    assert all(r.prompt == by_id[r.request_id].prompt for r in out)
    with pytest.raises(ValueError, match="active_users"):
        session_requests(reqs, 0)


def test_histogram_quantile_interpolates_in_the_bucket():
    h = {'lat_bucket{le="0.001"}': 2.0, 'lat_bucket{le="0.002"}': 6.0,
         'lat_bucket{le="0.005"}': 8.0, 'lat_bucket{le="+Inf"}': 8.0, "lat_count": 8.0}
    assert histogram_quantile(h, "lat", 0.5) == pytest.approx(0.0015)   # rank 4 of (2, 6]
    assert histogram_quantile(h, "lat", 0.95) == pytest.approx(0.0044)  # rank 7.6 of (6, 8]
    assert histogram_quantile(h, "lat", 0.1) == pytest.approx(0.0004)   # rank 0.8 of (0, 2]
    inf = {'lat_bucket{le="0.001"}': 1.0, 'lat_bucket{le="+Inf"}': 4.0}
    assert histogram_quantile(inf, "lat", 0.5) == 0.001
    assert histogram_quantile({'lat_bucket{le="+Inf"}': 0.0}, "lat", 0.5) is None
    assert histogram_quantile({}, "lat", 0.5) is None
    with pytest.raises(ValueError):
        histogram_quantile(h, "lat", 1.5)


def _result(i: int, ttft: float | None) -> RequestResult:
    return RequestResult(f"r{i}", "u", 0, "router", ok=ttft is not None, ttft_s=ttft,
                         e2e_s=None if ttft is None else ttft + 1.0,
                         error=None if ttft is not None else "HTTP 503: no engine")


def test_figures_from_counter_increases():
    results = [_result(i, t) for i, t in enumerate([0.1, 0.2, 0.3, 0.4, None])]
    deltas = {
        "engine0": {"engine_prefix_cache_queries_total": 1000.0,
                    "engine_prefix_cache_hits_total": 600.0,
                    "engine_external_prefix_cache_hits_total": 100.0,
                    'engine_request_success_total{finished_reason="length"}': 3.0,
                    # an attempt given up (the router sent the request again elsewhere)
                    'engine_request_success_total{finished_reason="abort"}': 1.0},
        "engine1": {"engine_prefix_cache_queries_total": 500.0,
                    "engine_prefix_cache_hits_total": 150.0},
        "router": {f'router_requests_total{{engine="{E0}",reason="hit"}}': 2.0,
                   f'router_requests_total{{engine="{E0}",reason="load"}}': 1.0,
                   f'router_requests_total{{engine="{E1}",reason="load"}}': 1.0,
                   f'router_predicted_hit_tokens_total{{engine="{E0}"}}': 580.0,
                   f'router_reported_cached_tokens_total{{engine="{E0}"}}': 600.0,
                   "router_overhead_seconds_sum": 0.006, "router_overhead_seconds_count": 4.0,
                   'router_overhead_seconds_bucket{le="0.001"}': 1.0,
                   'router_overhead_seconds_bucket{le="0.002"}': 3.0,
                   'router_overhead_seconds_bucket{le="+Inf"}': 4.0},
        "daemon": {"kvstore_server_sent_bytes_total": 10.0},
    }
    f = routed_figures(results, deltas, [E0, E1], store=True, wall_s=12.5)
    assert f["store"] is True
    assert f["ttft_p50_s"] == pytest.approx(0.25) and f["ttft_p95_s"] == pytest.approx(0.385)
    assert f["engine_hit_rate"] == pytest.approx(750 / 1500)
    assert f["store_hit_rate"] == pytest.approx(100 / 1500)
    # engine0 counts its own successes (not its aborted attempt); engine1 has no such
    # counter: the router's count
    assert f["requests_per_engine"] == [3, 1]
    assert f["router_overhead_ms"] == pytest.approx(1.5)
    assert f["router_overhead_p50_ms"] == pytest.approx(1.5)   # rank 2 of (1, 3] in (1, 2] ms
    assert f["routed_by_reason"] == {"hit": 2, "load": 2}
    assert (f["predicted_hit_tokens"], f["reported_cached_tokens"]) == (580, 600)
    assert (f["num_requests"], f["num_failed"], f["errors"]) == (5, 1, ["HTTP 503: no engine"])
    assert f["wall_s"] == 12.5
    assert [(q["id"], q["ttft_s"]) for q in f["requests"]] == [
        ("r0", 0.1), ("r1", 0.2), ("r2", 0.3), ("r3", 0.4), ("r4", None)]
    empty = routed_figures([], {}, [E0, E1], store=False, wall_s=0.0)
    assert empty["ttft_p50_s"] is None and empty["engine_hit_rate"] is None
    assert empty["requests_per_engine"] == [0, 0] and empty["router_overhead_ms"] is None


def test_flags_and_mode_defaults():
    args = resolve_defaults(build_parser().parse_args(["--engines", "2"]))
    assert (args.num_users, args.num_rounds, args.active_users, args.kv_cache_bytes) == (
        10, 4, 3, "64MiB")
    assert args.json == "results/multi_round_qa_routing.json"
    wl = workload_from_args(args)
    assert max(len(r.prompt) for r in wl.requests()) == 64 + 448 + 3 * (32 + 8) + 32
    quick = resolve_defaults(build_parser().parse_args(["--engines", "2", "--quick",
                                                        "--num-users", "5"]))
    assert (quick.num_users, quick.context_tokens, quick.kv_cache_bytes) == (5, 128, "20MiB")
    classic = resolve_defaults(build_parser().parse_args([]))
    assert (classic.num_users, classic.context_tokens, classic.kv_cache_bytes,
            classic.json) == (5, 1024, "64MiB", "results/multi_round_qa.json")
    assert parse_policies("cache-aware, round-robin") == ["cache-aware", "round-robin"]
    for bad in ("", "random", "cache-aware,cache-aware"):
        with pytest.raises(ValueError, match="round-robin, cache-aware"):
            parse_policies(bad)
    with pytest.raises(SystemExit):   # refused as it is parsed (bench.arg_checks)
        build_parser().parse_args(["--engines", "0"])
    with pytest.raises(ValueError, match="--engines"):
        resolve_defaults(argparse.Namespace(**{**vars(build_parser().parse_args([])),
                                               "engines": 0}))
    with pytest.raises(ValueError, match="--base-url"):
        resolve_defaults(build_parser().parse_args(["--engines", "2", "--base-url", E0]))
    with pytest.raises(ValueError, match="num_engines"):
        ServerGroup("engine-cache", num_engines=0).__enter__()


def test_unknown_router_policy_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "bench.multi_round_qa", "--engines", "2",
                           "--router", "fastest"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "fastest" in proc.stderr


def test_quick_run_compares_the_routers(tmp_path):
    out = tmp_path / "routing.json"
    proc = subprocess.run([sys.executable, "-m", "bench.multi_round_qa", "--engines", "2",
                           "--router", "round-robin,cache-aware", "--quick", "--no-progress",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)  # ~2 min on a quiet 2-core host
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    routers = rep["routers"]
    assert list(routers) == ["round-robin", "round-robin+store", "cache-aware",
                             "cache-aware+store"]
    n = rep["num_requests"]
    assert n == 4 * 3
    for key, f in routers.items():
        assert "error" not in f, (key, f.get("error"))
        assert f["store"] is key.endswith("+store")
        assert f["num_failed"] == 0, (key, f["errors"])
        assert sum(f["requests_per_engine"]) == n, key
        assert 0 < f["ttft_p50_s"] <= f["ttft_p95_s"], key
        assert 0.0 <= f["engine_hit_rate"] <= 1.0, key
        # every prompt token is looked up once in the engine that served it (a preempted
        # request looks its prompt up again when it resumes)
        queries = 4 * (176 + 196 + 216)
        if f["preemptions"] == 0:
            assert f["engine_query_tokens"] == queries, key
        else:
            assert f["engine_query_tokens"] > queries, key
        assert f["router_overhead_count"] == n and f["router_overhead_ms"] > 0, key
    for key in ("round-robin", "round-robin+store"):
        reasons = routers[key]["routed_by_reason"]
        # a request sent again after an engine failed before answering counts as a retry
        retries = reasons.get("retry", 0)
        assert set(reasons) <= {"round_robin", "retry"} and reasons["round_robin"] == n, (
            key, reasons)
        a, b = routers[key]["requests_per_engine"]
        assert abs(a - b) <= 1 + 2 * retries, (key, a, b)   # alternates engines per request
    for key in ("cache-aware", "cache-aware+store"):
        reasons = routers[key]["routed_by_reason"]
        assert set(reasons) <= {"hit", "load", "retry"}, (key, reasons)
        assert reasons.get("hit", 0) > 0, (key, reasons)
    # the store only serves what the engine's own cache lacks, and it does with round-robin
    assert routers["round-robin+store"]["store_hit_tokens"] > 0
    assert routers["round-robin"]["store_hit_tokens"] == 0
    # keeping a user on the engine that holds its history finds more there
    assert routers["cache-aware"]["engine_hit_rate"] > routers["round-robin"]["engine_hit_rate"], (
        {k: (f["engine_hit_rate"], f["routed_by_reason"]) for k, f in routers.items()})
    assert rep["router_overhead_ms"] > 0 and rep["engines"] == 2 and rep["quick"] is True
    assert set(rep["targets"]) == {"ttft_p50_speedup", "ttft_p50_speedup_store",
                                   "max_engine_imbalance", "router_overhead_ms"}


def test_targets_of_the_issue():
    routers = {"round-robin": {"ttft_p50_s": 3.0, "requests_per_engine": [10, 10]},
               "round-robin+store": {"ttft_p50_s": 1.2, "requests_per_engine": [11, 9]},
               "cache-aware": {"ttft_p50_s": 1.0, "requests_per_engine": [12, 8]},
               "cache-aware+store": {"ttft_p50_s": 1.5, "requests_per_engine": [13, 7]}}
    t = targets(routers, 0.8)
    assert t["ttft_p50_speedup"] == {"value": 3.0, "met": True}
    assert t["ttft_p50_speedup_store"] == {"value": pytest.approx(0.8), "met": False}
    assert t["max_engine_imbalance"] == {"value": pytest.approx(13 / 7), "met": False}
    assert t["router_overhead_ms"] == {"value": 0.8, "met": True}
    t = targets({"cache-aware": {"error": "x", "store": False}}, None)
    assert all(v == {"value": None, "met": None} for v in t.values())
    t = targets({"round-robin": {"ttft_p50_s": 1.0, "requests_per_engine": [20, 0]}}, 2.5)
    assert t["max_engine_imbalance"] == {"value": float("inf"), "met": False}
    assert t["router_overhead_ms"]["met"] is False


def test_store_path_http_starts_the_daemon_without_its_socket(capsys):
    from bench.routing import routing_server_options
    args = resolve_defaults(build_parser().parse_args(["--engines", "2"]))
    assert args.store_path == "socket" and routing_server_options(args).daemon_unix_socket
    args = resolve_defaults(build_parser().parse_args(["--engines", "2",
                                                       "--store-path", "http"]))
    assert routing_server_options(args).daemon_unix_socket is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--engines", "2", "--store-path", "ftp"])
    assert "invalid choice: 'ftp'" in capsys.readouterr().err


def test_repeats_alternate_the_order_and_pair_the_ratios(tmp_path, monkeypatch):
    from bench import routing
    assert routing.routing_settings(["round-robin", "cache-aware"], "with", 3) == [
        [("round-robin", True), ("cache-aware", True)],
        [("cache-aware", True), ("round-robin", True)],
        [("round-robin", True), ("cache-aware", True)]]
    assert routing.routing_settings(["cache-aware"], "both", 1) == [
        [("cache-aware", False), ("cache-aware", True)]]
    with pytest.raises(ValueError, match="store must be"):
        routing.routing_settings(["cache-aware"], "sometimes", 1)
    with pytest.raises(ValueError, match="repeat must be"):
        routing.routing_settings(["cache-aware"], "both", 0)
    with pytest.raises(SystemExit):   # refused as it is parsed (bench.arg_checks)
        build_parser().parse_args(["--engines", "2", "--repeat", "0"])
    two = vars(build_parser().parse_args(["--engines", "2"]))
    with pytest.raises(ValueError, match="--repeat"):
        resolve_defaults(argparse.Namespace(**{**two, "repeat": 0}))

    # run_routing's bookkeeping over repeats, with each run's figures given (the processes
    # themselves are covered by test_quick_run_compares_the_routers)
    p50 = {("round-robin+store", 1): 0.6, ("cache-aware+store", 1): 0.4,
           ("round-robin+store", 2): 0.5, ("cache-aware+store", 2): 0.5,
           ("round-robin+store", 3): 0.9, ("cache-aware+store", 3): 0.6}
    calls = []

    def fake_run(tag, policy, store, requests, args):
        key, k = tag.split("#")
        calls.append(tag)
        return routing.RoutedRun(key, {"store": store, "ttft_p50_s": p50[key, int(k)],
                                       "ttft_p95_s": 1.0, "engine_hit_rate": 0.5,
                                       "store_hit_rate": 0.2, "router_overhead_ms": 1.0,
                                       "num_failed": 0, "requests_per_engine": [2, 2],
                                       "router_overhead_sum_s": 0.004,
                                       "router_overhead_count": 4})
    monkeypatch.setattr(routing, "run_routed", fake_run)
    args = resolve_defaults(build_parser().parse_args(
        ["--engines", "2", "--store", "with", "--repeat", "3", "--json",
         str(tmp_path / "r.json")]))
    rep = routing.run_routing([], args, {})
    assert calls == ["round-robin+store#1", "cache-aware+store#1", "cache-aware+store#2",
                     "round-robin+store#2", "round-robin+store#3", "cache-aware+store#3"]
    assert list(rep["routers"]) == ["round-robin+store", "cache-aware+store"]
    assert rep["routers"]["round-robin+store"]["ttft_p50_s"] == 0.6
    paired = rep["paired"]["ttft_p50_speedup_store"]
    assert paired["per_repeat"] == [pytest.approx(1.5), pytest.approx(1.0), pytest.approx(1.5)]
    assert paired["median"] == pytest.approx(1.5)
    assert rep["paired"]["ttft_p50_speedup"] == {"per_repeat": [None] * 3, "median": None}
    assert rep["router_overhead_ms"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "r.json").read_text())["paired"] == json.loads(
        json.dumps(rep["paired"]))
