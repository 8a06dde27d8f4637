"""vLLM's sampling fields on ``engine_min serve`` with the real SmolLM2-135M (one in-process
server for the module): ``repetition_penalty``, ``presence_penalty`` / ``frequency_penalty``
and ``min_p`` are implemented, not refused; their ranges are 400s naming the field.

Narrated: a greedy request with ``repetition_penalty`` 1.3 leaves the repetition the model
falls into without it, and equals, token for token, a reference decoded one step at a time by
a second engine with the penalty applied in the test by hand; requests with different penalties
batched in one engine step each get the tokens they get alone; ``min_p`` 1.0 at temperature 1
is greedy. A text prompt far beyond the context is tokenized and cut when
``truncate_prompt_tokens`` is given (refused over a hard cap).
"""
from __future__ import annotations

import pytest
import torch

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from engine_min.serve import protocol as proto
from engine_min.serve.prepare import MAX_CHARS_PER_TOKEN, MAX_TRUNCATED_TEXT_CHARS
from engine_min.serve.server import ServerThread, create_app
from tests.engine_min.serve.http_json import call_json

MODEL = "smollm2-test"
MAX_MODEL_LEN = 256
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The"
N = 16


def _config() -> EngineConfig:
    return EngineConfig(kv_cache_bytes=32 * 2**20, block_size=16, max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=4)


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(_config())
    with ServerThread(create_app(engine, MODEL)) as srv:
        srv.engine = engine
        yield srv


def _tokens(server, **kw) -> list[int]:
    status, got = call_json(server, "/v1/completions",
                            {"prompt": PROMPT, "temperature": 0, "max_tokens": N,
                             "ignore_eos": True, "return_token_ids": True, **kw})
    assert status == 200, got
    return got["choices"][0]["token_ids"]


def _reference(prompt_ids: list[int], penalty: float) -> list[int]:
    """Greedy decoding one token per ``generate`` call of a fresh engine, the logits of each
    step captured and penalized here: every token of the prompt or the output so far has its
    logit divided by ``penalty`` when positive, multiplied by it otherwise."""
    engine = LLMEngine(_config())
    captured = []
    execute = engine.runner.execute

    def spy(sched_out):
        ordered, logits = execute(sched_out)
        captured.append(logits.clone())
        return ordered, logits

    engine.runner.execute = spy
    ids = list(prompt_ids)
    for _ in range(N):
        captured.clear()
        engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        row = captured[-1][0].float()                                   # [vocab]
        seen = torch.tensor(sorted(set(ids)))
        v = row[seen]
        row[seen] = torch.where(v > 0, v / penalty, v * penalty)
        top2 = torch.topk(row, 2).values
        assert top2[0] - top2[1] > 1e-4, "a near tie: the reference would be fragile"
        ids.append(int(row.argmax()))
    return ids[len(prompt_ids):]


def test_greedy_repetition_penalty_equals_a_step_by_step_reference(server):
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    plain = _tokens(server)
    penalized = _tokens(server, repetition_penalty=1.3)
    assert penalized != plain
    # without the penalty the model repeats " cat sat on the mat." once more
    assert server.engine.tokenizer.decode(plain).startswith(" cat sat on the mat.")
    assert penalized == _reference(prompt_ids, 1.3)
    assert _tokens(server, repetition_penalty=1.0) == plain      # the default is a no-op


def test_min_p_one_at_temperature_one_is_greedy(server):
    plain = _tokens(server)
    assert _tokens(server, temperature=1.0, min_p=1.0, seed=11) == plain
    assert _tokens(server, temperature=1.0, min_p=1.0) == plain


def test_differently_penalized_requests_batched_in_one_step_each_get_their_own(server):
    engine = LLMEngine(_config())
    ids = engine.tokenizer.encode(PROMPT)
    params = [SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=N, ignore_eos=True),
              SamplingParams(max_tokens=N, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=0.5),
              SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=0.8)]
    together = [o.output_token_ids for o in engine.generate([ids] * 4, params)]
    alone = [engine.generate([ids], p)[0].output_token_ids for p in params]
    assert together == alone
    assert len({tuple(t) for t in together}) == 4            # four different outputs
    assert together[0] == _tokens(server, repetition_penalty=1.3)
    assert together[2] == _tokens(server, presence_penalty=1.5, frequency_penalty=0.5)


@pytest.mark.parametrize("name,value,code", [
    ("repetition_penalty", 0, "invalid_value"), ("repetition_penalty", -1.0, "invalid_value"),
    ("repetition_penalty", "1.2", "invalid_type"), ("repetition_penalty", True, "invalid_type"),
    ("min_p", -0.1, "invalid_value"), ("min_p", 1.5, "invalid_value"),
    ("presence_penalty", 2.5, "invalid_value"), ("presence_penalty", -2.01, "invalid_value"),
    ("frequency_penalty", 3, "invalid_value"), ("frequency_penalty", [1], "invalid_type"),
])
def test_out_of_range_sampling_fields_are_400_naming_the_field(name, value, code):
    with pytest.raises(proto.ApiError) as exc:
        proto.parse_completion_request({"prompt": "a", name: value})
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, name, code)


def test_sampling_fields_reach_the_sampling_params():
    body = {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.1,
            "min_p": 0.05, "presence_penalty": -2, "frequency_penalty": 2.0}
    got = proto.parse_chat_request(body).sampling
    assert {k: got[k] for k in ("repetition_penalty", "min_p", "presence_penalty",
                                "frequency_penalty")} == {
        "repetition_penalty": 1.1, "min_p": 0.05, "presence_penalty": -2.0,
        "frequency_penalty": 2.0}
    assert "min_p" not in proto.parse_completion_request({"prompt": "a", "min_p": None}).sampling


def test_a_long_text_with_truncate_prompt_tokens_is_tokenized_and_cut(server):
    text = "one two three four five six seven. " * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN // 35 + 9)
    assert len(text) > MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN
    status, got = call_json(server, "/v1/completions", {"prompt": text, "max_tokens": 4})
    assert (status, got["error"]["code"]) == (400, "context_length_exceeded")
    last = server.engine.tokenizer.encode(text)[-8:]
    status, got = call_json(server, "/v1/completions",
                            {"prompt": text, "max_tokens": 4, "temperature": 0,
                             "truncate_prompt_tokens": 8, "return_token_ids": True})
    assert status == 200, got
    assert got["choices"][0]["prompt_token_ids"] == last and got["usage"]["prompt_tokens"] == 8
    assert got["choices"][0]["token_ids"] == _tokens_of(server, last)


def _tokens_of(server, prompt_ids: list[int]) -> list[int]:
    status, got = call_json(server, "/v1/completions",
                            {"prompt": prompt_ids, "max_tokens": 4, "temperature": 0,
                             "return_token_ids": True})
    assert status == 200, got
    return got["choices"][0]["token_ids"]


def test_text_over_the_hard_cap_is_refused_before_tokenizing(server, monkeypatch):
    encoded = []
    real_encode = server.engine.tokenizer.encode
    monkeypatch.setattr(server.engine.tokenizer, "encode",
                        lambda text: encoded.append(len(text)) or real_encode(text))
    n = MAX_TRUNCATED_TEXT_CHARS + 1
    for path, body, param, verb in (
            ("/v1/completions", {"prompt": "a" * n}, "prompt", "has"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * n}]},
             "messages", "have")):
        status, got = call_json(server, path, {**body, "truncate_prompt_tokens": 8})
        assert (status, got["error"]["param"], got["error"]["code"]) == \
            (400, param, "invalid_value")
        assert got["error"]["message"] == (
            f"Your {param} {verb} {n} characters; with truncate_prompt_tokens at most "
            f"{MAX_TRUNCATED_TEXT_CHARS} characters are tokenized.")
    assert encoded == []
