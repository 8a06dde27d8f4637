"""The router's health handling, end to end: no healthy engine is a 503 error object and a
bad ``--engines`` (or a ``--model`` that cannot be read, reported without waiting for the
engines) an error message; an engine that goes away is taken out (index dropped) and put back
with its index rebuilt from its snapshot; an engine SIGKILLed while requests flow costs no
failed request; a keep-alive connection the engine closed is retried on a fresh connection to
the same engine, which stays in service."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from engine_min.cli import main as cli_main
from tests.engine_min.router.served import (MODEL, Relay, free_port, metric, metrics, post_json,
                                            request, settle, start_router, wait_health)


def test_no_healthy_engine_and_bad_engine_urls(engines, capsys):
    dead = f"http://127.0.0.1:{free_port()}"
    srv = start_router([dead], engines[0].engine.tokenizer)
    try:
        time.sleep(0.5)
        for path, raw in (("/v1/completions", b'{"prompt": "hi"}'), ("/health", None),
                          ("/v1/models", None)):
            status, _, body = request(srv.url, path, raw)
            err = json.loads(body)["error"]
            assert status == 503 and err["code"] == "no_healthy_engine"
            assert err["type"] == "server_error" and err["message"]
        m = metrics(srv.url)
        assert m["router_failed_requests_total"] == 1
        assert metric(m, "router_engine_healthy", engine=dead) == 0
    finally:
        srv.stop()
    assert cli_main(["route", "--engines", dead, "--startup-timeout-s", "0.3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: engine(s) not answering /health after 0.3 s: {dead} (")
    assert "refused" in err
    # the tokenizer loads while the engines are waited for: a model that cannot be read is
    # an error at once, not after the engines' 60 s
    t0 = time.monotonic()
    assert cli_main(["route", "--engines", dead, "--model", "/nonexistent/m.gguf",
                     "--startup-timeout-s", "60"]) == 2
    assert time.monotonic() - t0 < 10
    assert capsys.readouterr().err.startswith("error: cannot read GGUF file /nonexistent/m.gguf")
    assert cli_main(["route", "--engines", dead, "--kvstore-url", "unix:///tmp/kv.sock"]) == 2
    assert capsys.readouterr().err == ("error: --kvstore-url: expected http://host:port, got "
                                       "'unix:///tmp/kv.sock'\n")
    for bad, why in (("localhost:8000", "bad URL 'localhost:8000'"),
                     ("http://a:1,http://a:1", "listed twice"), (",", "no engine URL"),
                     ("http://h:1/v1", "bad URL 'http://h:1/v1'")):
        assert cli_main(["route", "--engines", bad]) == 2
        assert why in capsys.readouterr().err


def test_engine_out_and_back_rebuilds_its_index(engines):
    """The engine behind a relay goes away (connections refused and cut) and comes back on
    the same port: taken out with its index dropped, put back with the index rebuilt from the
    snapshot."""
    eng = engines[0]
    post_json(eng.url, "/v1/completions", {"model": MODEL, "prompt": "Blocks to hold: " * 16,
                                            "max_tokens": 2})
    relay = Relay(eng.port)
    relay.engine = eng.engine
    srv = start_router([relay.url], eng.engine.tokenizer)
    try:
        settle(srv, [relay])
        e = srv.router.engines[0]
        held = set(e.index.blocks)
        snapshot = json.loads(request(eng.url, "/v1/kv_events/snapshot")[2])
        assert held == {bytes.fromhex(h) for h in snapshot["block_hashes"]} and len(held) >= 4
        relay.pause()
        deadline = time.monotonic() + 10
        while e.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        m = metrics(srv.url)
        assert metric(m, "router_engine_healthy", engine=relay.url) == 0
        assert metric(m, "router_index_blocks", engine=relay.url) == 0 and not e.index.ready
        assert request(srv.url, "/health")[0] == 503
        relay.resume()
        settle(srv, [relay])
        assert e.index.blocks == held
        m = metrics(srv.url)
        assert metric(m, "router_engine_healthy", engine=relay.url) == 1
        assert metric(m, "router_index_blocks", engine=relay.url) == len(held)
    finally:
        srv.stop()
        relay.close()


def test_sigkilled_engine_costs_no_request(engines, spare):
    proc, url = spare
    wait_health(url, proc)
    live = engines[1]
    srv = start_router([live.url, url], live.engine.tokenizer)
    try:
        settle(srv, [live])
        dead = srv.router.engines[1]
        post_json(url, "/v1/completions", {"model": MODEL, "max_tokens": 2,
                                            "prompt": "Something the killed engine held. " * 8})
        held = {bytes.fromhex(h) for h in json.loads(
            request(url, "/v1/kv_events/snapshot")[2])["block_hashes"]}
        deadline = time.monotonic() + 30
        while dead.index.blocks != held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(metrics(srv.url), "router_index_blocks", engine=url) == len(held) >= 3
        prompts = [f"Request number {i}: write a sentence about the colour of {c}."
                   for i, c in enumerate(["red", "green", "blue", "gold"])]

        def run(p):
            return request(srv.url, "/v1/completions", json.dumps(
                {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0}).encode())

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(run, p) for p in prompts]
            deadline = time.monotonic() + 60
            while dead.inflight == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert dead.inflight > 0
            os.kill(proc.pid, signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
        for p, (status, _, body) in zip(prompts, results):
            assert status == 200, body
            direct = post_json(live.url, "/v1/completions", {"model": MODEL, "prompt": p,
                                                              "max_tokens": 8, "temperature": 0})
            assert json.loads(body)["choices"][0]["text"] == direct["choices"][0]["text"]
        m = metrics(srv.url)
        assert m["router_failed_requests_total"] == 0
        assert metric(m, "router_requests_total", engine=live.url, reason="retry") >= 1
        assert metric(m, "router_engine_healthy", engine=url) == 0
        assert metric(m, "router_index_blocks", engine=url) == 0
        assert sum(v for k, v in m.items() if k.startswith("router_requests_total")) == \
            len(prompts) + metric(m, "router_requests_total", engine=live.url, reason="retry")
    finally:
        srv.stop()


def test_connection_closed_by_the_engine_between_requests_costs_nothing(engines):
    """The engine closes a keep-alive connection the router holds in its pool just as the
    router sends the next request on it: the router sends it again on a fresh connection to
    the same engine, which stays in service (with no other engine to fall back to, taking it
    out would have failed the request)."""
    eng = engines[0]
    relay = Relay(eng.port)
    srv = start_router([relay.url], eng.engine.tokenizer, health_interval_s=30.0)
    try:
        wait_health(srv.url)
        req = json.dumps({"model": MODEL, "prompt": "Keep-alive test:", "max_tokens": 3,
                          "temperature": 0}).encode()
        first = request(srv.url, "/v1/completions", req)
        relay.drop_next_reused_post = True
        second = request(srv.url, "/v1/completions", req)
        assert first[0] == second[0] == 200 and relay.num_dropped == 1
        assert json.loads(first[2])["choices"] == json.loads(second[2])["choices"]
        m = metrics(srv.url)
        assert metric(m, "router_stale_connection_retries_total", engine=relay.url) == 1
        assert metric(m, "router_engine_healthy", engine=relay.url) == 1
        assert m["router_failed_requests_total"] == 0
        assert metric(m, "router_requests_total", engine=relay.url, reason="retry") == 0
        assert srv.router.engines[0].healthy
    finally:
        srv.stop()
        relay.close()
