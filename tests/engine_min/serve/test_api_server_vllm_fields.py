"""vLLM's request fields on ``engine_min serve``, on the real SmolLM2-135M (one in-process
server for the module), and the fields refused because the engine would ignore them.

Narrated: ``min_tokens`` keeps EOS and the stop strings away until that many tokens came;
``include_stop_str_in_output`` keeps a stop string, streamed too; a stop token's text is left
out and ``stop_reason`` names the string or token id (null for EOS and length);
``truncate_prompt_tokens`` runs and charges the prompt's last k tokens;
``continuous_usage_stats`` puts the usage so far on every chunk; chat
``add_generation_prompt`` / ``continue_final_message`` render exactly what ``/tokenize``
counts; ``/version`` and ``/v1/models/{id}`` answer; each unimplemented vLLM field with a value
that changes the output is a 400 ``unsupported`` naming it, its default is accepted.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.serve import protocol as proto
from engine_min.serve.server import ServerThread, create_app
from engine_min.serve.vllm_fields import REFUSED, REFUSED_CHAT, render_chat
from tests.engine_min.serve.http_json import call_json

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256
PROMPT = "Once upon a time, there was a"
SAY_HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 * 2**20, block_size=16,
                                    max_model_len=MAX_MODEL_LEN, max_num_seqs=4))
    with ServerThread(create_app(engine, MODEL)) as srv:
        srv.engine = engine
        yield srv


def _ok(server, path: str, body: dict) -> dict:
    status, got = call_json(server, path, body)
    assert status == 200, got
    return got


def _chunks(server, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True})
                                 .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = resp.read().decode().split("\n\n")
    assert lines[-2] == "data: [DONE]"
    return [json.loads(x.removeprefix("data: ")) for x in lines[:-2]]


def _complete(server, **kw) -> dict:
    return _ok(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0,
                                           "return_token_ids": True, **kw})


# ---------------------------------------------------------------- refused fields (protocol)

REFUSED_VALUES = {"length_penalty": 0.5,
                  "use_beam_search": True, "allowed_token_ids": [1, 2], "bad_words": ["x"],
                  "logits_processors": ["m.f"], "prompt_logprobs": 0, "prompt_embeds": "AAAA",
                  "guided_json": {"type": "object"}, "guided_regex": "a+",
                  "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'",
                  "structured_outputs": {"choice": ["a"]}, "skip_special_tokens": False,
                  "spaces_between_special_tokens": False, "priority": 1,
                  "vllm_xargs": {"k": 1}}
CHAT_REFUSED_VALUES = {"echo": True, "chat_template": "{{ x }}",
                       "chat_template_kwargs": {"enable_thinking": True}, "documents": [{}]}


def test_every_refused_field_has_a_value_under_test():
    assert set(REFUSED_VALUES) == set(REFUSED) and set(CHAT_REFUSED_VALUES) == set(REFUSED_CHAT)


@pytest.mark.parametrize("name,value", [*REFUSED_VALUES.items(), ("length_penalty", True)])
def test_unimplemented_vllm_fields_are_400_unsupported(name, value):
    with pytest.raises(proto.ApiError) as exc:
        proto.parse_completion_request({"prompt": "a", name: value})
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, name, "unsupported")


@pytest.mark.parametrize("name,value", CHAT_REFUSED_VALUES.items())
def test_unimplemented_chat_fields_are_400_unsupported(name, value):
    with pytest.raises(proto.ApiError) as exc:
        proto.parse_chat_request({"messages": SAY_HI, name: value})
    assert (exc.value.param, exc.value.code) == (name, "unsupported")


def test_vllm_defaults_are_accepted():
    defaults = {"repetition_penalty": 1.0, "min_p": 0, "length_penalty": 1,
                "use_beam_search": False, "allowed_token_ids": None, "bad_words": [],
                "prompt_logprobs": None, "skip_special_tokens": True,
                "spaces_between_special_tokens": True, "priority": 0, "min_tokens": 0,
                "include_stop_str_in_output": False, "cache_salt": "s", "user": "u"}
    req = proto.parse_chat_request({"messages": SAY_HI, "echo": False,
                                    "add_generation_prompt": True, **defaults})
    assert req.sampling["min_tokens"] == 0 and req.add_generation_prompt
    assert not req.continue_final_message and req.truncate_prompt_tokens is None


@pytest.mark.parametrize("body,param,code", [
    ({"min_tokens": -1}, "min_tokens", "invalid_value"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "invalid_value"),
    ({"min_tokens": "3"}, "min_tokens", "invalid_type"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "invalid_type"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "invalid_value"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "invalid_value"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens", "invalid_type"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "continuous_usage_stats", "invalid_type"),
])
def test_bad_vllm_field_values_are_400(body, param, code):
    with pytest.raises(proto.ApiError) as exc:
        proto.parse_completion_request({"prompt": "a", **body})
    assert (exc.value.param, exc.value.code) == (param, code)


# ---------------------------------------------------------------- on the real model

def test_min_tokens_holds_off_eos_and_stop_strings(server):
    eos = server.engine.eos_token_id
    free = _ok(server, "/v1/chat/completions", {"messages": SAY_HI, "temperature": 0,
                                                "max_tokens": 60, "return_token_ids": True})
    choice = free["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == eos
    n = len(choice["token_ids"])
    held = _ok(server, "/v1/chat/completions", {"messages": SAY_HI, "temperature": 0,
                                                "max_tokens": n + 20, "min_tokens": n + 8,
                                                "return_token_ids": True})
    ids = held["choices"][0]["token_ids"]
    assert len(ids) >= n + 8 and eos not in ids[:n + 8]
    assert held["usage"]["completion_tokens"] == len(ids)
    # a stop string in the first min_tokens tokens' text is never matched
    base = _complete(server, max_tokens=12)["choices"][0]
    word = base["text"].split()[0]
    early = _complete(server, max_tokens=12, stop=[word])["choices"][0]
    assert early["text"] == base["text"][:base["text"].index(word)]
    late = _complete(server, max_tokens=12, stop=[word], min_tokens=3)["choices"][0]
    assert late["token_ids"] == base["token_ids"] and late["finish_reason"] == "length"


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    text = _complete(server, max_tokens=12)["choices"][0]["text"]
    word = text.split()[2]
    cut = text.index(word)
    got = _complete(server, max_tokens=12, stop=[word], include_stop_str_in_output=True)
    choice = got["choices"][0]
    assert choice["text"] == text[:cut + len(word)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", word)
    assert _complete(server, max_tokens=12, stop=[word])["choices"][0]["text"] == text[:cut]
    chunks = _chunks(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0,
                                                 "max_tokens": 12, "stop": [word],
                                                 "include_stop_str_in_output": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:cut + len(word)]
    assert chunks[-1]["choices"][0]["stop_reason"] == word
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])


def test_a_stop_token_is_left_out_of_the_text_and_named_in_stop_reason(server):
    tok = server.engine.tokenizer
    base = _complete(server, max_tokens=12)["choices"][0]
    stop_id = base["token_ids"][3]
    got = _complete(server, max_tokens=12, stop_token_ids=[stop_id])["choices"][0]
    assert got["token_ids"] == base["token_ids"][:4]        # the stop token is generated
    assert got["text"] == tok.decode(base["token_ids"][:3])  # and its text left out
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", stop_id)
    kept = _complete(server, max_tokens=12, stop_token_ids=[stop_id],
                     include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == tok.decode(base["token_ids"][:4])
    assert base["stop_reason"] is None                      # length: null
    chat = _ok(server, "/v1/chat/completions", {"messages": SAY_HI, "temperature": 0,
                                                "max_tokens": 60})
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["stop_reason"] is None        # EOS: null
    chunks = _chunks(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0,
                                                 "max_tokens": 12, "stop_token_ids": [stop_id]})
    assert "".join(c["choices"][0]["text"] for c in chunks) == got["text"]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop_id


def test_truncate_prompt_tokens_keeps_the_last_k_tokens(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    whole = _complete(server, max_tokens=6)
    assert whole["usage"]["prompt_tokens"] == len(ids)
    cut = _complete(server, max_tokens=6, truncate_prompt_tokens=3)
    direct = _ok(server, "/v1/completions", {"prompt": ids[-3:], "temperature": 0,
                                             "max_tokens": 6})
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["prompt_token_ids"] == ids[-3:]
    assert cut["choices"][0]["text"] == direct["choices"][0]["text"]
    assert cut["choices"][0]["text"] != whole["choices"][0]["text"]
    for k in (len(ids), len(ids) + 50, -1):
        got = _complete(server, max_tokens=6, truncate_prompt_tokens=k)
        assert got["usage"]["prompt_tokens"] == len(ids)
    chat = _ok(server, "/v1/chat/completions", {"messages": SAY_HI, "max_tokens": 2,
                                                "truncate_prompt_tokens": 5})
    assert chat["usage"]["prompt_tokens"] == 5
    status, err = call_json(server, "/v1/completions", {"prompt": PROMPT,
                                                    "truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert (status, err["error"]["param"]) == (400, "truncate_prompt_tokens")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": SAY_HI}),
])
def test_continuous_usage_stats_put_usage_on_every_chunk(server, path, body):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(server, path, {**body, "temperature": 0, "max_tokens": 5,
                                    "ignore_eos": True, "stream_options": opts})
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    assert choice_chunks and all(c["usage"] is not None for c in choice_chunks)
    counts = [c["usage"]["completion_tokens"] for c in choice_chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
               for c, n in zip(choice_chunks, counts))
    plain = _chunks(server, path, {**body, "temperature": 0, "max_tokens": 5,
                                   "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])


@pytest.mark.parametrize("flags", [{}, {"add_generation_prompt": False},
                                   {"add_generation_prompt": False,
                                    "continue_final_message": True}])
def test_chat_template_flags_match_tokenize(server, flags):
    messages = SAY_HI + [{"role": "assistant", "content": "Hello! How"}]
    counted = _ok(server, "/tokenize", {"messages": messages, **flags})
    got = _ok(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                               "temperature": 0, "return_token_ids": True,
                                               **flags})
    assert got["usage"]["prompt_tokens"] == counted["count"]
    assert got["prompt_token_ids"] == counted["tokens"]
    text = server.engine.tokenizer.decode(counted["tokens"], skip_special_tokens=False)
    assert text.endswith("Hello! How") == bool(flags.get("continue_final_message"))
    assert text.endswith("<|im_start|>assistant\n") == (flags == {})


def test_continue_final_message_with_generation_prompt_is_400(server):
    for path in ("/v1/chat/completions", "/tokenize"):
        status, err = call_json(server, path, {"messages": SAY_HI, "continue_final_message": True})
        assert (status, err["error"]["param"]) == (400, "continue_final_message")


def test_render_chat_continue_final_message_cuts_the_end_of_turn(server):
    tok = server.engine.tokenizer
    msgs = SAY_HI + [{"role": "assistant", "content": "Sure "}]
    closed = render_chat(tok, msgs, False, False)
    open_ = render_chat(tok, msgs, False, True)
    assert closed.startswith(open_) and open_.endswith("Sure ") and closed != open_


def test_version_and_one_model(server):
    status, got = call_json(server, "/version")
    assert status == 200 and isinstance(got["version"], str) and got["version"]
    status, got = call_json(server, f"/v1/models/{MODEL}")
    assert status == 200 and (got["id"], got["object"]) == (MODEL, "model")
    assert got["max_model_len"] == MAX_MODEL_LEN
    status, got = call_json(server, "/v1/models/other/model")
    assert status == 404
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["code"] == "model_not_found"
