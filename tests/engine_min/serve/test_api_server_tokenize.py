"""``/tokenize``, ``/detokenize`` and the server's error objects, on the real SmolLM2-135M
tokenizer (one in-process server for the module).

Narrated: "Hello world" is the two tokens 19556 ("Hello") and 905 ("Ġworld") and comes back
from /detokenize; a one-message chat is the 31 tokens /v1/chat/completions charges for it (27
without the generation prompt); what `vllm bench serve` sends to align its prompts is answered;
every bad body is a 400 with the offending field, another model's name a 404; unknown routes
(404), wrong methods (405, with Allow), an oversized body (413) and a handler that crashes (500)
all answer OpenAI error objects, and the server keeps serving.
"""
from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request

import pytest

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.serve.server import SERVING_KEY, ServerThread, create_app

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256
HI = [{"role": "user", "content": "Hi"}]
# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging
# Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" (SmolLM2's template adds the system turn)
HI_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
          411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 26843, 2, 198]
GENERATION_PROMPT_IDS = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 * 2**20, block_size=16,
                                    max_model_len=MAX_MODEL_LEN, max_num_seqs=4))
    app = create_app(engine, MODEL)
    with ServerThread(app) as srv:
        srv.engine, srv.app = engine, app
        yield srv


def _call(server, method: str, path: str, body: bytes | dict | None = None
          ) -> tuple[int, dict, dict]:
    """(status, headers, decoded JSON body) for success and error statuses alike."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def _error(status: int, got: dict) -> tuple:
    e = got["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return status, e["type"], e["param"], e["code"]


def test_tokenize_a_prompt_and_detokenize_it_back(server):
    status, _, got = _call(server, "POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200
    assert got == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [19556, 905],
                   "token_strs": None}
    _, _, got = _call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                                   "return_token_strs": True})
    assert got["token_strs"] == ["Hello", "\u0120world"]
    # what `vllm bench serve` sends to check its token counts against the server's
    _, _, got = _call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                                   "add_special_tokens": False})
    assert got["tokens"] == [19556, 905]
    status, _, got = _call(server, "POST", "/detokenize", {"model": MODEL,
                                                          "tokens": [19556, 905]})
    assert (status, got) == (200, {"prompt": "Hello world"})
    assert _call(server, "POST", "/detokenize", {"tokens": []})[2] == {"prompt": ""}


def test_tokenize_counts_what_the_completion_routes_charge(server):
    status, _, got = _call(server, "POST", "/tokenize", {"messages": HI})
    assert status == 200
    assert got["tokens"] == HI_IDS + GENERATION_PROMPT_IDS and got["count"] == 31
    _, _, chat = _call(server, "POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == 31
    _, _, got = _call(server, "POST", "/tokenize",
                      {"messages": HI, "add_generation_prompt": False})
    assert got["tokens"] == HI_IDS and got["count"] == 27
    # special tokens survive the round trip (kept, as vLLM's tokenizer.decode)
    _, _, text = _call(server, "POST", "/detokenize", {"tokens": HI_IDS})
    assert text["prompt"] == server.engine.tokenizer.apply_chat_template(
        HI, add_generation_prompt=False)
    assert text["prompt"].endswith("<|im_start|>user\nHi<|im_end|>\n")
    prompt = "The quick brown fox jumps over the lazy dog"
    _, _, got = _call(server, "POST", "/tokenize", {"prompt": prompt})
    _, _, cmpl = _call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert got["count"] == cmpl["usage"]["prompt_tokens"] == 9


@pytest.mark.parametrize("path,body,param,code", [
    ("/tokenize", b"[1, 2]", None, "invalid_json"),
    ("/tokenize", b"{", None, "invalid_json"),
    ("/tokenize", {}, "prompt", "missing_field"),
    ("/tokenize", {"prompt": "a", "messages": HI}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens",
     "invalid_type"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "invalid_type"),
    ("/tokenize", {"prompt": "a", "model": 7}, "model", "invalid_type"),
    ("/tokenize", {"messages": []}, "messages", "invalid_type"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role",
     "invalid_value"),
    ("/tokenize", {"messages": HI, "continue_final_message": True}, "continue_final_message",
     "invalid_value"),
    ("/tokenize", {"messages": HI, "chat_template": "{{ x }}"}, "chat_template", "unsupported"),
    ("/tokenize", {"messages": HI, "tools": []}, "tools", "unsupported"),
    ("/tokenize", {"prompt": "a" * (MAX_MODEL_LEN * 64 + 1)}, "prompt",
     "context_length_exceeded"),
    ("/detokenize", {}, "tokens", "missing_field"),
    ("/detokenize", {"tokens": "19556"}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [True]}, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [49152]}, "tokens", "invalid_value"),
])
def test_bad_tokenize_bodies_are_400(server, path, body, param, code):
    status, _, got = _call(server, "POST", path, body)
    assert _error(status, got) == (400, "invalid_request_error", param, code)


def test_another_models_name_is_404(server):
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "a"}),
                       ("/detokenize", {"model": "gpt-4", "tokens": [1]})):
        status, _, got = _call(server, "POST", path, body)
        assert _error(status, got) == (404, "invalid_request_error", "model", "model_not_found")
        assert got["error"]["message"] == "The model `gpt-4` does not exist."


def test_unknown_routes_and_methods_answer_openai_errors(server):
    status, headers, got = _call(server, "GET", "/v1/nothing")
    assert _error(status, got) == (404, "invalid_request_error", None, "not_found")
    assert got["error"]["message"] == "Not Found: no route GET /v1/nothing."
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    for method, path, allow in (("GET", "/v1/completions", "POST"),
                                ("GET", "/tokenize", "POST"),
                                ("POST", "/v1/models", "GET, HEAD"),
                                ("DELETE", "/metrics", "GET, HEAD")):
        status, headers, got = _call(server, method, path, b"{}" if method == "POST" else None)
        assert _error(status, got) == (405, "invalid_request_error", None,
                                       "method_not_allowed")
        assert got["error"]["message"] == \
            f"Method Not Allowed: {method} {path} (allowed: {allow})."
        assert headers["Allow"] == allow


def test_an_oversized_body_is_413(server):
    body = b" " * (64 * 2**20 + 1)  # one byte over the app's client_max_size
    status, _, got = _call(server, "POST", "/tokenize", body)
    assert _error(status, got) == (413, "invalid_request_error", None, "request_too_large")
    assert got["error"]["message"] == "Request Entity Too Large: POST /tokenize."


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_body_that_is_not_its_content_encoding_is_a_400_object(server, coding):
    # aiohttp raises RequestPayloadError reading such a body: it was a 500 internal_error
    for path in ("/tokenize", "/v1/completions"):
        req = urllib.request.Request(server.url + path, data=b"not compressed", method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Content-Encoding": coding})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        got = json.loads(err.value.read())
        assert _error(err.value.code, got) == (400, "invalid_request_error", None,
                                               "invalid_body")
        assert got["error"]["message"] == \
            f"Cannot decode the request body: Can not decode content-encoding: {coding}"
    # a body that is what it says is decoded
    req = urllib.request.Request(server.url + "/tokenize", method="POST",
                                 data=gzip.compress(json.dumps({"prompt": "Hello"}).encode()),
                                 headers={"Content-Type": "application/json",
                                          "Content-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["tokens"] == [19556]


def test_a_crashing_handler_is_a_500_object_and_the_server_keeps_serving(server, monkeypatch):
    tokenizer = server.app[SERVING_KEY].tokenizer

    def broken_decode(ids, skip_special_tokens=True):
        raise RuntimeError("decoder exploded")
    monkeypatch.setattr(tokenizer, "decode", broken_decode)
    status, _, got = _call(server, "POST", "/detokenize", {"tokens": [1]})
    assert _error(status, got) == (500, "server_error", None, "internal_error")
    assert got["error"]["message"] == \
        "Internal server error: RuntimeError('decoder exploded')"
    monkeypatch.undo()
    assert _call(server, "POST", "/detokenize", {"tokens": [19556]})[2] == {"prompt": "Hello"}
