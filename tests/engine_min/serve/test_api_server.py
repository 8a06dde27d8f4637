"""engine_min.serve.server end to end on the real SmolLM2-135M model, through the real `openai`
client: one in-process server (aiohttp in a background thread) for the whole module.

Narrated scenarios: a chat completion; a streamed completion whose text equals the
non-streamed one (greedy); 8 concurrent streams equal their sequential runs; a client that
disconnects mid-stream (or before a non-streamed answer) gets its request aborted and its KV
blocks freed; a repeated prompt reports its reused prefix as cached tokens; the metrics count
exactly the tokens served; bad requests get 400 (404 for an unknown model) with an OpenAI
error object, and the server keeps serving.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.serve.server import ServerThread, create_app

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20, block_size=BLOCK_SIZE,
                                    max_model_len=MAX_MODEL_LEN, max_num_seqs=16))
    with ServerThread(create_app(engine, MODEL)) as srv:
        srv.engine = engine  # read only from the test thread: tokenizer, max_model_len
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _get(server, path: str) -> bytes:
    with urllib.request.urlopen(server.url + path, timeout=30) as resp:
        return resp.read()


def _post(server, path: str, body: bytes) -> tuple[int, dict]:
    """POST raw bytes; (status, decoded JSON body) for success and error statuses alike."""
    req = urllib.request.Request(server.url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _stats(server) -> dict:
    return json.loads(_get(server, "/debug/stats"))


def _metrics(server) -> dict[str, float]:
    """Samples by full name with labels, e.g. ``engine_prompt_tokens_total``."""
    out = {}
    for line in _get(server, "/metrics").decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait_idle(server, timeout_s: float = 20.0) -> dict:
    """Poll until no request runs or waits and no KV block is referenced."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _stats(server)
        if (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0):
            return stats
        assert time.monotonic() < deadline, f"server never went idle: {stats}"
        time.sleep(0.05)


def _stream(client, **kw) -> tuple[str, list]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(_get(server, "/health")) == {"status": "ok"}


def test_chat_completion_uses_the_chat_template(server, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16)
    tok = server.engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"  # EOS (<|im_end|>) before 16 tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 8)
    assert r.usage.total_tokens == len(prompt_ids) + 8
    # the same tokens sent as a completion give the same answer
    c = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=16)
    assert c.choices[0].text == "The capital of France is Paris."
    # streamed chat: a role chunk, content deltas, a final chunk with the finish reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
        "The capital of France is Paris."
    assert [ch.choices[0].finish_reason for ch in chunks][-2:] == [None, "stop"]


def test_streamed_text_equals_non_streamed_text(client):
    kw = {"prompt": "The quick brown fox", "max_tokens": 12,
          "extra_body": {"ignore_eos": True}}
    r = client.completions.create(model=MODEL, **kw)
    text, chunks = _stream(client, stream_options={"include_usage": True}, **kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert text == r.choices[0].text and len(text) > 12
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == \
        (r.usage.prompt_tokens, 12)
    # a stop string that arrives over several tokens is never streamed in part
    stop = r.choices[0].text.split()[-2]  # a word late in the greedy answer
    r2 = client.completions.create(model=MODEL, stop=[stop], **kw)
    text2, chunks2 = _stream(client, stop=[stop], **kw)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].text == r.choices[0].text[:r.choices[0].text.index(stop)]
    assert text2 == r2.choices[0].text
    assert chunks2[-1].choices[0].finish_reason == "stop"


PROMPTS = [f"Question {i}: name a {thing} and describe it." for i, thing in enumerate(
    ["fruit", "river", "planet", "color", "bird", "city", "metal", "tree"])]


def test_8_concurrent_streams_equal_sequential_runs(server, client):
    kw = {"max_tokens": 10, "extra_body": {"ignore_eos": True}}
    sequential = [client.completions.create(model=MODEL, prompt=p, **kw).choices[0].text
                  for p in PROMPTS]

    def run(prompt):
        t0 = time.monotonic()
        text, chunks = _stream(client, prompt=prompt, **kw)
        return text, len(chunks), t0, time.monotonic()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS))
    assert [r[0] for r in results] == sequential
    assert all(r[1] >= 2 for r in results)
    assert max(r[2] for r in results) < min(r[3] for r in results)  # all in flight at once
    _wait_idle(server)


def _open_stream(server, body: dict) -> socket.socket:
    """Send a POST by hand and return the socket without reading the answer."""
    data = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_client_is_aborted_and_frees_its_blocks(server, stream):
    base = _wait_idle(server)
    before = _metrics(server)
    sock = _open_stream(server, {"model": MODEL, "prompt": "Tell me a long story about a "
                                 "dragon.", "max_tokens": 200, "ignore_eos": True,
                                 "stream": stream})
    if stream:
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(65536)
    else:
        while _stats(server)["num_generated_tokens"] < base["num_generated_tokens"] + 3:
            time.sleep(0.02)
    busy = _stats(server)
    assert busy["num_running"] == 1 and busy["kv_blocks_used"] >= 1
    sock.close()
    idle = _wait_idle(server)
    assert idle["kv_usage"] == base["kv_usage"] == 0.0
    assert idle["num_generated_tokens"] - base["num_generated_tokens"] < 200
    after = _metrics(server)
    key = 'engine_request_success_total{finished_reason="abort"}'
    assert after[key] - before.get(key, 0.0) == 1
    assert after["engine_kv_cache_usage_perc"] == 0.0
    assert after["engine_num_requests_running"] == 0.0


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = ("You are a careful assistant. Summarize the following note in one line: the "
              "meeting moved to Thursday at noon, bring the quarterly figures and the draft "
              "of the budget, and tell the new team members where the room is.")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    n = first.usage.prompt_tokens
    assert n % BLOCK_SIZE != 0 and n > 2 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == n // BLOCK_SIZE * BLOCK_SIZE
    assert again.choices[0].text == first.choices[0].text
    _, chunks = _stream(client, prompt=prompt, max_tokens=2,
                        stream_options={"include_usage": True})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n // BLOCK_SIZE * BLOCK_SIZE


def test_metrics_count_the_served_tokens(server, client):
    _wait_idle(server)
    before = _metrics(server)
    prompt = "Metrics test: count these words please, one by one."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                  extra_body={"ignore_eos": True})
    _wait_idle(server)
    after = _metrics(server)

    def delta(name):
        return after[name] - before.get(name, 0.0)

    n = r.usage.prompt_tokens
    assert delta("engine_prompt_tokens_total") == n
    assert delta("engine_generation_tokens_total") == 5
    assert delta("engine_time_to_first_token_seconds_count") == 1
    assert delta("engine_inter_token_latency_seconds_count") == 4
    assert delta('engine_request_success_total{finished_reason="length"}') == 1
    assert delta("engine_prefix_cache_queries_total") == n
    assert delta("engine_prefix_cache_hits_total") == 0


BAD = [  # (path, body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", b'{"prompt": 42}', 400, "prompt", "invalid_type"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens",
     "invalid_type"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens",
     "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 256}', 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", json.dumps({"prompt": [1] * MAX_MODEL_LEN}).encode(), 400, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", b'{"prompt": [49152]}', 400, "prompt", "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n", "unsupported"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature",
     "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model",
     "model_not_found"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", "invalid_type"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400,
     "messages[0].content", "invalid_type"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', 400,
     "messages[0].content", "invalid_type"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"28": 100}}', 400, "logit_bias",
     "unsupported"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999999": 100}}', 400,
     "logit_bias", "unsupported"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"logit_bias": {"28": -100}}', 400, "logit_bias", "unsupported"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"response_format": {"type": "json_object"}}', 400, "response_format", "unsupported"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"tools": [{"type": "function", "function": {"name": "f"}}]}', 400, "tools",
     "unsupported"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    for path, body, status, param, code in BAD:
        got_status, got = _post(server, path, body)
        assert (got_status, got["error"]["param"], got["error"]["code"]) == \
            (status, param, code), (path, body, got)
        assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert info.value.code == "context_length_exceeded"
    assert json.loads(_get(server, "/health")) == {"status": "ok"}
    status, ok = _post(server, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3}).encode())
    assert status == 200 and ok["usage"]["completion_tokens"] == 3
    _wait_idle(server)


def test_seeded_sampling_is_reproducible(client):
    kw = {"model": MODEL, "prompt": "Write a word:", "max_tokens": 8, "temperature": 0.9,
          "top_p": 0.95, "seed": 1234, "extra_body": {"top_k": 50, "ignore_eos": True}}
    a = client.completions.create(**kw).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert a == b and a != ""


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(server, monkeypatch):
    from engine_min.serve.server import MAX_CHARS_PER_TOKEN
    limit = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN
    encoded = []
    real_encode = server.engine.tokenizer.encode
    monkeypatch.setattr(server.engine.tokenizer, "encode",
                        lambda text: encoded.append(len(text)) or real_encode(text))
    for path, body, param in (
            ("/v1/completions", {"prompt": "a" * (limit + 1)}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "system", "content": "a" * limit},
                                                   {"role": "user", "content": "b"}]},
             "messages")):
        status, got = _post(server, path, json.dumps(body).encode())
        assert (status, got["error"]["param"], got["error"]["code"]) == \
            (400, param, "context_length_exceeded")
        assert got["error"]["message"] == (
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
            f"{param} {'have' if param == 'messages' else 'has'} {limit + 1} characters, "
            f"more than the {limit} characters that context can hold.")
    assert encoded == []  # refused before the tokenizer ran
    status, got = _post(server, "/v1/completions", json.dumps({"prompt": "a" * limit}).encode())
    assert (status, got["error"]["code"]) == (400, "context_length_exceeded")  # by token count
    assert encoded == [limit] and "tokens" in got["error"]["message"]


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    import threading
    real_encode = server.engine.tokenizer.encode
    entered = threading.Event()

    def slow_encode(text):  # stands in for a long prompt: 1.5 s in the tokenizer
        entered.set()
        time.sleep(1.5)
        return real_encode(text)
    monkeypatch.setattr(server.engine.tokenizer, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_post, server, "/v1/completions",
                          json.dumps({"prompt": "Hello", "max_tokens": 2}).encode())
        assert entered.wait(30)
        t0 = time.monotonic()
        assert json.loads(_get(server, "/health")) == {"status": "ok"}
        assert time.monotonic() - t0 < 0.5   # was held for the whole encode
        status, got = fut.result(60)
    assert status == 200 and got["usage"]["completion_tokens"] == 2
    _wait_idle(server)


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    """POST a streamed request; its SSE chunks, decoded ([DONE] left out)."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_return_token_ids_gives_the_prompt_and_output_ids(server):
    tok = server.engine.tokenizer
    prompt_ids = tok.encode("The capital of France is")
    base = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    # completions: both lists in the choice; the output ids decode to the text
    status, body = _post(server, "/v1/completions", json.dumps(
        {**base, "prompt": prompt_ids, "return_token_ids": True}).encode())
    assert status == 200
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 8
    assert tok.decode(choice["token_ids"]) == choice["text"]
    # streamed: the first chunk carries the prompt's ids, the chunks' ids add up to the same
    chunks = _stream_chunks(server, "/v1/completions",
                            {**base, "prompt": prompt_ids, "stream": True,
                             "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    # chat: prompt_token_ids at the top level (the templated prompt), token ids in the choice
    status, chat = _post(server, "/v1/chat/completions", json.dumps(
        {**base, "messages": CHAT, "return_token_ids": True}).encode())
    assert status == 200
    templated = chat["prompt_token_ids"]
    assert len(templated) == chat["usage"]["prompt_tokens"] > len(tok.encode(CHAT[0]["content"]))
    ids = chat["choices"][0]["token_ids"]
    assert tok.decode(ids) == chat["choices"][0]["message"]["content"] and len(ids) == 8
    chunks = _stream_chunks(server, "/v1/chat/completions",
                            {**base, "messages": CHAT, "stream": True, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == templated
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["choices"][0]["token_ids"] == []
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
    # without the flag nothing is added; a non-boolean is refused
    status, plain = _post(server, "/v1/completions", json.dumps(
        {**base, "prompt": prompt_ids}).encode())
    assert status == 200 and not {"token_ids", "prompt_token_ids"} & set(plain["choices"][0])
    status, err = _post(server, "/v1/completions", json.dumps(
        {**base, "prompt": prompt_ids, "return_token_ids": "yes"}).encode())
    assert status == 400 and err["error"]["param"] == "return_token_ids"
