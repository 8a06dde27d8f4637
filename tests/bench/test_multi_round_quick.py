"""``bench.multi_round_qa --quick`` exercises the store: its workload does not fit the engines'
pool (the quick defaults fitted in it, so ``kvstore-cpu`` loaded nothing: ``bytes loaded=None``),
each store configuration's bytes loaded is checked at the end, and every finished run prints
one line as it goes (also with ``--no-progress``)."""
from bench.client import RequestResult
from bench.multi_round_qa import (build_parser, resolve_defaults, store_use_lines,
                                  workload_from_args)
from bench.replay import ConfigRun
from bench.report import run_line
from kvstore.units import parse_size

#: bytes of one token's KV in engine_min's pool for SmolLM2-135M: 30 layers x K,V x 3 heads
#: x 64 x fp32
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4


def test_the_quick_workload_evicts_each_history_from_the_engine_pool():
    args = resolve_defaults(build_parser().parse_args(["--quick"]))
    wl = workload_from_args(args)
    pool_tokens = parse_size(args.kv_cache_bytes) // TOKEN_BYTES
    history = wl.context_tokens + wl.num_rounds * (wl.question_tokens + wl.answer_tokens)
    # the other users' histories, sent between a user's two rounds, fill the pool on their own
    assert (wl.num_users - 1) * history > pool_tokens, (history, pool_tokens)
    # and the longest prompt still fits one request's share of the pool
    longest = max(len(r.prompt) + r.max_tokens for r in wl.requests())
    assert longest < pool_tokens and wl.num_rounds >= 2


def _run(name: str, loaded) -> ConfigRun:
    return ConfigRun(name, [], 1.0, metrics={"bytes_loaded": loaded})


def test_store_use_lines_flag_a_store_that_loaded_nothing():
    lines, ok = store_use_lines({"recompute": _run("recompute", None),
                                 "kvstore-cpu": _run("kvstore-cpu", 42024960.0)})
    assert ok and lines == ["store check [kvstore-cpu]: bytes loaded 42,024,960 > 0: the store "
                            "was used"]
    lines, ok = store_use_lines({"engine-cache": _run("engine-cache", None),
                                 "kvstore-cpu": _run("kvstore-cpu", None),
                                 "kvstore-disk": _run("kvstore-disk", 1024.0)})
    assert not ok and len(lines) == 2
    assert lines[0].startswith("store check [kvstore-cpu]: bytes loaded 0 (none): the store "
                               "was NOT used")
    assert store_use_lines({"recompute": _run("recompute", None)}) == ([], True)


def test_run_line_names_the_config_requests_failures_and_ttft_p50():
    res = [RequestResult(f"r{i}", "u0", i, "http://e0", ok=True, ttft_s=t)
           for i, t in enumerate((0.3, 0.1, 0.2))]
    res.append(RequestResult("r3", "u0", 3, "http://e0", ok=False))
    assert run_line("kvstore-cpu", res) == ("[kvstore-cpu] done: 4 requests (1 failed), "
                                            "TTFT p50 0.200 s")
    assert run_line("cache-aware+store", [], "x") == ("[cache-aware+store] done: 0 requests "
                                                      "(0 failed), TTFT p50 -; x")
