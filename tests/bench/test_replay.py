"""The replay machinery: client measurements and scheduling against a scripted SSE server,
metric parsing, the report, and a tiny end-to-end replay on the real engine server."""
import asyncio
import importlib.util
import json
import time

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import metrics_scrape, report
from bench.client import build_payload
from bench.replay import ConfigRun, drive, parse_configs, routes
from bench.servers import ServerGroup, ServerOptions, free_port
from bench.workloads import LongDocQA, MultiRoundQA, Request

TOKEN_GAP_S = 0.02


class FakeServer:
    """A scripted OpenAI-style streaming app: ``max_tokens`` chunks ``TOKEN_GAP_S`` apart,
    usage with ``cached_tokens = prompt_len // 2``; it records the order and time at which
    requests arrive. ``url`` is set once aiohttp's ``TestServer`` listens."""

    def __init__(self):
        self.seen: list[tuple[str, float, int]] = []
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def completions(self, request):
        body = await request.json()
        prompt = body["prompt"]
        self.seen.append((str(prompt[0]), time.perf_counter(), len(prompt)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(TOKEN_GAP_S)
            fin = "length" if i == body["max_tokens"] - 1 else None
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": fin}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake-model"}]})


@pytest_asyncio.fixture
async def fake():
    """The scripted server on the test's own event loop (the loop ``drive`` runs on)."""
    server = FakeServer()
    async with TestServer(server.app(), host="127.0.0.1") as ts:
        server.url = str(ts.make_url("")).rstrip("/")
        yield server


@pytest.mark.asyncio
async def test_client_measures_stream(fake):
    reqs = [Request("a", 0.0, (1000, 1001, 1002, 1003), 5, "s", 0)]
    (res,) = await drive(reqs, [fake.url])
    assert res.ok and res.error is None
    assert res.num_output_tokens == 5
    assert res.num_prompt_tokens == 4 and res.num_cached_tokens == 2
    assert len(res.itl_s) == 4
    assert all(TOKEN_GAP_S * 0.8 < x < TOKEN_GAP_S * 10 for x in res.itl_s)
    assert TOKEN_GAP_S * 0.8 < res.ttft_s < res.e2e_s
    assert res.tpot_s == pytest.approx((res.e2e_s - res.ttft_s) / 4)


@pytest.mark.asyncio
async def test_drive_honours_after_and_arrivals(fake):
    reqs = MultiRoundQA(num_users=2, num_rounds=2, system_tokens=0, context_tokens=2,
                        question_tokens=1, answer_tokens=3, qps=20.0).requests()
    results = await drive(reqs, [fake.url])
    by_id = {r.request_id: r for r in results}
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    for r in reqs:
        if r.after:  # round 1 is sent only after round 0 of the same user finished
            prev = by_id[r.after]
            assert by_id[r.request_id].send_s >= prev.send_s + prev.e2e_s - 1e-3
        assert by_id[r.request_id].send_s >= r.arrival_s - 1e-3


@pytest.mark.asyncio
async def test_drive_bounds_inflight(fake):
    reqs = LongDocQA(num_docs=2, doc_tokens=4, questions_per_doc=2, question_tokens=1,
                     answer_tokens=3, max_inflight=1).requests()
    results = await drive(reqs, [fake.url], max_inflight=1)
    ordered = sorted(results, key=lambda r: r.send_s)
    for a, b in zip(ordered, ordered[1:]):
        assert b.send_s >= a.send_s + a.e2e_s - 1e-3  # one at a time, in request order
    assert [r.request_id for r in ordered] == [r.request_id for r in reqs]


@pytest.mark.asyncio
async def test_drive_records_errors_without_raising():
    port = free_port()  # nothing listens here
    (res,) = await drive([Request("x", 0.0, (1000,), 1, "s", 0)],
                         [f"http://127.0.0.1:{port}"], model="m", timeout_s=5)
    assert not res.ok and "Error" in res.error


def test_routes_spread_sessions_and_move_them():
    reqs = MultiRoundQA(num_users=2, num_rounds=3, system_tokens=0, context_tokens=1,
                        question_tokens=1, answer_tokens=1).requests()
    # u0-r0 u1-r0 u0-r1 u1-r1 u0-r2 u1-r2
    assert routes(reqs, 2) == [0, 1, 1, 0, 0, 1]
    assert routes(reqs, 1) == [0] * 6


def test_payload_and_config_names():
    body = build_payload(Request("a", 0.0, (5, 6), 3, "s", 0), "m", "completions")
    assert body["prompt"] == [5, 6] and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    with pytest.raises(ValueError, match="text prompts"):
        build_payload(Request("a", 0.0, (5, 6), 3, "s", 0), "m", "chat")
    assert parse_configs("recompute, shared") == ["recompute", "shared"]
    assert len(parse_configs("all")) == 6
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_configs("recompute,turbo")


METRICS_BEFORE = """\
# TYPE engine_prefix_cache_queries counter
engine_prefix_cache_queries_total 100.0
# TYPE engine_prefix_cache_hits counter
engine_prefix_cache_hits_total 10.0
# TYPE engine_external_prefix_cache_hits counter
engine_external_prefix_cache_hits_total 0.0
# TYPE engine_external_prefix_cache_queries counter
engine_external_prefix_cache_queries_total 90.0
"""
METRICS_AFTER = METRICS_BEFORE.replace("100.0", "1100.0").replace("hits_total 10.0",
                                                                   "hits_total 42.0").replace(
    "external_prefix_cache_hits_total 0.0", "external_prefix_cache_hits_total 768.0")
DAEMON_AFTER = """\
# TYPE kvstore_server_sent_bytes counter
kvstore_server_sent_bytes_total 4096.0
# TYPE kvstore_hit_tokens counter
kvstore_hit_tokens_total{tier="cpu"} 512.0
kvstore_hit_tokens_total{tier="disk"} 256.0
"""


def test_metrics_delta_and_summary():
    before = metrics_scrape.parse_metrics(METRICS_BEFORE)
    after = metrics_scrape.parse_metrics(METRICS_AFTER)
    d = metrics_scrape.delta(before, after)
    assert d == {"engine_prefix_cache_queries_total": 1000.0,
                 "engine_prefix_cache_hits_total": 32.0,
                 "engine_external_prefix_cache_hits_total": 768.0}
    s = metrics_scrape.summarize({"engine0": d})
    assert s["hit_tokens_by_tier"] == {"engine": 32.0, "store": 768.0}
    assert s["bytes_loaded"] is None
    daemon = metrics_scrape.delta({}, metrics_scrape.parse_metrics(DAEMON_AFTER))
    s = metrics_scrape.summarize({"engine0": d, "daemon": daemon})
    assert s["hit_tokens_by_tier"] == {"engine": 32.0, "cpu": 512.0, "disk": 256.0}
    assert s["bytes_loaded"] == 4096.0 and s["bytes_saved"] is None


def test_debug_stats_give_tiers_and_bytes():
    before = metrics_scrape.flatten_stats({"kvstore_loaded_bytes": 100, "ok": True,
                                           "kvstore_hit_tokens_by_tier": {"cpu": 64}})
    after = metrics_scrape.flatten_stats({"kvstore_loaded_bytes": 4196, "kvstore_saved_bytes": 7,
                                          "kvstore_hit_tokens_by_tier": {"cpu": 128,
                                                                         "disk": 256},
                                          "name": "x"})
    assert after == {"stats:kvstore_loaded_bytes": 4196.0, "stats:kvstore_saved_bytes": 7.0,
                     'stats:kvstore_hit_tokens_by_tier{tier="cpu"}': 128.0,
                     'stats:kvstore_hit_tokens_by_tier{tier="disk"}': 256.0}
    s = metrics_scrape.summarize({"engine0": metrics_scrape.delta(before, after)})
    assert s["hit_tokens_by_tier"] == {"cpu": 64.0, "disk": 256.0}
    assert (s["bytes_loaded"], s["bytes_saved"]) == (4096.0, 7.0)
    assert s["preemptions"] is None
    # tiers a connector exports at 0 from the start and that served nothing are left out
    zero = metrics_scrape.flatten_stats({"kvstore_hit_tokens_by_tier": {"cpu": 64,
                                                                        "remote:gpu": 0}})
    s = metrics_scrape.summarize({"engine0": metrics_scrape.delta(before, zero)})
    assert s["hit_tokens_by_tier"] == {}
    s = metrics_scrape.summarize({"engine0": metrics_scrape.delta(
        {"stats:num_preemptions": 2.0}, {"stats:num_preemptions": 2.0})})
    assert s["preemptions"] == 0.0


@pytest.mark.asyncio
async def test_report_figures_and_files(fake, tmp_path):
    reqs = LongDocQA(num_docs=1, doc_tokens=6, questions_per_doc=3, question_tokens=2,
                     answer_tokens=4).requests()
    res = await drive(reqs, [fake.url], max_inflight=1)
    run = ConfigRun("kvstore-cpu", res, wall_s=2.0)
    base = ConfigRun("recompute", res, wall_s=4.0)
    rep = report.build_report("long_doc_qa", {"recompute": base, "kvstore-cpu": run}, reqs,
                              {"x": 1}, {"configs": "recompute,kvstore-cpu"})
    f = rep["configs"]["kvstore-cpu"]
    assert f["num_ok"] == 3 and f["output_tokens"] == 12
    assert f["output_tok_s"] == 6.0 and rep["configs"]["recompute"]["output_tok_s"] == 3.0
    assert f["hit_rate"] == 12 / 24  # cached = prompt // 2 = 4 of 8 tokens each
    assert f["by_index"]["0"]["n"] == 1
    assert f["outputs_equal_recompute"] == "3/3" and res[0].text == "t0t1t2t3"
    assert rep["speedups"]["e2e_p50_s"]["kvstore-cpu/recompute"] == 1.0
    assert "kvstore-cpu" in report.format_table(rep)
    report.write_json(rep, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["params"]["x"] == 1
    paths = report.plot_all(rep, str(tmp_path), "long_doc_qa")
    assert [p.name for p in paths] == ["long_doc_qa_ttft_cdf.png", "long_doc_qa_hit_rate.png",
                                       "long_doc_qa_throughput.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_server_group_stops_process_on_failure(tmp_path):
    opts = ServerOptions(startup_timeout_s=2.0, log_dir=str(tmp_path),
                         engine_args=("--no-such-flag-for-the-test",))
    group = ServerGroup("engine-cache", opts)
    with pytest.raises(RuntimeError, match="engine-cache/engine0"):
        group.__enter__()
    assert group.procs == []
    with pytest.raises(ValueError, match="unknown configuration"):
        ServerGroup("turbo").__enter__()


HAS_SERVER = importlib.util.find_spec("engine_min.serve.server") is not None and \
    importlib.util.find_spec("engine_min.engine") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SERVER, reason="engine_min.serve.server / engine_min.engine not built yet")
def test_tiny_end_to_end_replay(tmp_path):
    """Two configurations on the real model, same 4 requests (2 documents of 300 tokens, 2
    questions each, interleaved). The 16 MiB pool (22 blocks of 16 tokens) cannot keep one
    document while the other runs, so the second question of each document is served by the
    store: 4 chunks of 64 tokens of its 308-token prompt and the 2 tail pieces of 16 tokens
    after them that hold only document tokens ([256, 288)). Outputs are identical."""
    from bench import long_doc_qa
    rep = long_doc_qa.main(["--configs", "recompute,kvstore-cpu", "--num-docs", "2",
                            "--doc-tokens", "300", "--questions-per-doc", "2",
                            "--question-tokens", "8", "--answer-tokens", "3",
                            "--kv-cache-bytes", "16MiB", "--kvstore-cpu-bytes", "256MiB",
                            "--kvstore-chunk-size", "64", "--json", str(tmp_path / "e2e.json"),
                            "--no-progress", "--log-dir", str(tmp_path / "logs")])
    rec, kv = rep["configs"]["recompute"], rep["configs"]["kvstore-cpu"]
    assert rec["num_ok"] == kv["num_ok"] == 4
    assert rec["output_tokens"] == kv["output_tokens"] == 12
    assert rec["prompt_tokens"] == kv["prompt_tokens"] == 4 * 308
    assert rec["cached_tokens"] == 0
    assert [r["num_cached_tokens"] for r in rep["requests"]["kvstore-cpu"]] == [0, 0, 288, 288]
    assert kv["outputs_equal_recompute"] == "4/4"
    assert (tmp_path / "long_doc_qa_ttft_cdf.png").exists()
