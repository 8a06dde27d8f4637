"""Proxying through the router, end to end: a stream is byte-identical to what the engine
sent (recorded by a TCP relay between them) and its text equals a direct greedy request's; a
client leaving a stream aborts the engine's request; malformed input reaches the engine's own
error."""
from __future__ import annotations

import json
import socket
from tests.engine_min.router.served import (MODEL, Relay, metric, metrics, post_json, request,
                                            settle, start_router, wait_health)


def test_stream_is_byte_identical_to_the_engines(engines):
    eng = engines[1]
    relay = Relay(eng.port)
    srv = start_router([relay.url], eng.engine.tokenizer, policy="round-robin")
    try:
        wait_health(srv.url)
        prompt = "The three primary colours are"
        req = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
        status, headers, got = request(srv.url, "/v1/completions", json.dumps(req).encode())
        assert status == 200 and headers["Content-Type"] == "text/event-stream"
        assert got == relay.event_stream_body()
        events = [json.loads(line[6:]) for line in got.decode().split("\n\n")
                  if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        direct = post_json(eng.url, "/v1/completions",
                            {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                             "temperature": 0})
        assert text == direct["choices"][0]["text"] and len(text) > 10
        assert got.endswith(b"data: [DONE]\n\n")
        # the stream's usage chunk was counted (the prompt was new: 0 cached tokens; the
        # direct request then hit the stream's blocks, outside the router)
        usage = events[-1]["usage"]
        m = metrics(srv.url)
        assert metric(m, "router_reported_cached_tokens_total", engine=relay.url) == \
            usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(m, "router_requests_total", engine=relay.url, reason="round_robin") == 1
    finally:
        srv.stop()
        relay.close()


def test_client_leaving_a_stream_aborts_the_engines_request(router, engines):
    settle(router, engines)
    before = [metrics(e.url) for e in engines]
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story about a dragon.",
                       "max_tokens": 300, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", router.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    settle(router, engines)   # the router's in-flight count and the engines' load back to 0
    key = 'engine_request_success_total{finished_reason="abort"}'
    aborted = [metrics(e.url).get(key, 0.0) - b.get(key, 0.0) for e, b in zip(engines, before)]
    assert sorted(aborted) == [0.0, 1.0]
    generated = sum(metrics(e.url)["engine_generation_tokens_total"]
                    - b["engine_generation_tokens_total"] for e, b in zip(engines, before))
    assert generated < 300


def test_bad_input_reaches_the_engines_error(router, engines):
    for path, raw in (("/v1/completions", b"{not json"),
                      ("/v1/chat/completions", b'{"messages": "hi"}'),
                      ("/v1/completions", b'{"prompt": "hi", "model": "other"}')):
        status, headers, body = request(router.url, path, raw)
        direct = request(engines[0].url, path, raw)
        assert (status, body) == (direct[0], direct[2]) and status in (400, 404)
        assert headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["error"]["message"]
    status, _, body = request(router.url, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    assert request(router.url, "/health")[0] == 200
