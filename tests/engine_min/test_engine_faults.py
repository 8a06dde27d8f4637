"""One bad request fails alone, on the real SmolLM2-135M model (one engine for the module).

Narrated scenarios:
- the issue's input through the real HTTP server: ``{"prompt": "Hello", "max_tokens": 8,
  "temperature": 1e-40}`` (and 1e-38, 1e-45, 0.0) sent while an unrelated greedy request
  (``temperature 0, max_tokens 40, ignore_eos``) is generating: all get 200, each tiny
  temperature answers the greedy text, and the greedy request's text equals its run alone
  (before: both got 500 "probability tensor contains either inf, nan or element < 0");
- a fault injected into one request at each stage (admission, forward, sampling, stop check,
  detokenizing) while another runs: the faulty request finishes with finish reason "error" and
  its own message, the other's tokens equal its run alone, every block is freed
  (``check_integrity``), and the engine serves the next request as before;
- the same through HTTP: the faulty request gets its own 500 OpenAI error (code
  ``request_failed``), the other 200;
- a forward that fails for every sequence, and a step that raises outside any sequence: every
  request in flight fails with its own error and the engine keeps serving.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from engine_min.serve.server import ServerThread, create_app
from tests.engine_min.null_connector import NullConnector

MODEL = "smollm2-faults"
GOOD, BAD, NEXT = "The capital of France is", "Once upon a time, there was a", "Water boils at"
GREEDY_40 = {"prompt": "My favourite animal is the", "temperature": 0, "max_tokens": 40,
             "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(block_size=16, kv_cache_bytes=48 * 2**20, max_model_len=256,
                                  max_num_seqs=8))


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy outputs of GOOD (24 tokens) and NEXT (8 tokens), each run alone."""
    return {p: engine.generate([p], greedy(n))[0].output_token_ids
            for p, n in ((GOOD, 24), (NEXT, 8))}


def run_all(engine, max_steps=500) -> dict:
    """Step until idle; the final output of every request by id."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        final.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("engine did not finish")


# ---- the input through the HTTP server -------------------------------------------------
def post(url: str, body: dict | bytes) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def stream_events(url: str, body: dict) -> list:
    """The decoded ``data:`` events of a streamed completion (``[DONE]`` as a str)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        text = resp.read().decode()
    data = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/debug/stats", timeout=30) as resp:
        return json.loads(resp.read())


def failed_metric(url: str) -> float:
    """``engine_request_success_total{finished_reason="error"}`` (0 before the first)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith('engine_request_success_total{finished_reason="error"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(cond, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def server(engine):
    """A server over the module's engine for one test (the engine thread stops after it)."""
    with ServerThread(create_app(engine, MODEL)) as srv:
        yield srv
    engine.block_manager.check_integrity()


def test_tiny_temperatures_are_greedy_and_fail_nobody(server):
    status, want_greedy = post(server.url, GREEDY_40)
    assert status == 200 and want_greedy["usage"]["completion_tokens"] == 40
    status, want_hello = post(server.url, {"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert status == 200
    with ThreadPoolExecutor(5) as pool:
        gen0 = stats(server.url)["num_generated_tokens"]
        greedy_fut = pool.submit(post, server.url, GREEDY_40)
        wait_until(lambda: stats(server.url)["num_generated_tokens"] > gen0)  # it is generating
        tiny = [b'{"prompt": "Hello", "max_tokens": 8, "temperature": 1e-40}'] + [
            f'{{"prompt": "Hello", "max_tokens": 8, "temperature": {t}}}'.encode()
            for t in ("1e-38", "1e-45", "0.0")]
        answers = [f.result() for f in [pool.submit(post, server.url, b) for b in tiny]]
        assert not greedy_fut.done()          # the tiny ones ran alongside it, and ended first
        status, got_greedy = greedy_fut.result()
    for status, body in answers:
        assert status == 200, body
        assert body["choices"][0]["text"] == want_hello["choices"][0]["text"]
        assert body["usage"]["completion_tokens"] == 8
    assert status == 200 and got_greedy["choices"][0]["text"] == want_greedy["choices"][0]["text"]
    wait_until(lambda: stats(server.url)["kv_blocks_used"] == 0)


# ---- injected faults, one stage at a time --------------------------------------------------------
class FaultAt:
    """Raises ``RuntimeError("injected fault")`` at ``stage`` for request "bad" once it has
    ``after`` output tokens (so the fault comes mid-generation, next to "good")."""

    def __init__(self, engine, monkeypatch, stage: str, after: int = 2):
        self.engine, self.stage, self.after = engine, stage, after
        self.batches: list[list[str]] = []   # request ids of each forward run (stage forward)
        getattr(self, f"_{stage}")(monkeypatch)

    def due(self, seq) -> bool:
        return seq.request_id == "bad" and seq.num_output_tokens >= self.after

    def _forward(self, mp):
        # raises after the whole batch's KV is written (in the logits), so the solo re-runs
        # must overwrite what the failed batch left behind
        runner, model, current = self.engine.runner, self.engine.model, []
        execute, logits = runner.execute, model.compute_logits

        def run(sched):
            current[:] = [it.seq for it in sched.scheduled]
            self.batches.append([s.request_id for s in current])
            return execute(sched)

        def compute(hidden):
            if any(self.due(s) for s in current):
                raise RuntimeError("injected fault")
            return logits(hidden)
        mp.setattr(runner, "execute", run)
        mp.setattr(model, "compute_logits", compute)

    def _sample(self, mp):
        sampler = self.engine.sampler
        row = sampler.sample_row
        bad = self.engine._seqs["bad"]

        def sample_row(r, p, gen):
            if p is bad.sampling and self.due(bad):
                raise RuntimeError("injected fault")
            return row(r, p, gen)
        mp.setattr(sampler, "sample_row", sample_row)

    def _stop(self, mp):
        check = self.engine._stop_reason

        def stop_reason(seq, token, *args):
            if self.due(seq):
                raise RuntimeError("injected fault")
            return check(seq, token, *args)
        mp.setattr(self.engine, "_stop_reason", stop_reason)

    def _detokenize(self, mp):
        decode = self.engine._detokenize

        def detokenize(seq):
            if self.due(seq):
                raise RuntimeError("injected fault")
            return decode(seq)
        mp.setattr(self.engine, "_detokenize", detokenize)

    def _admit(self, mp):
        pass  # the connector is attached before the requests are added


class RaisingConnector(NullConnector):
    """A connector with no store whose ``update_state_after_alloc`` raises for "bad"."""

    def update_state_after_alloc(self, seq, block_ids, num_external):
        if seq.request_id == "bad":
            raise RuntimeError("injected fault")


@pytest.mark.parametrize("stage, bad_sampling, bad_tokens", [
    ("admit", greedy(8), 0),
    ("forward", greedy(8), 2),                 # its 3rd token's forward raises
    ("sample", SamplingParams(max_tokens=8, temperature=0.8, seed=7), 2),
    ("stop", greedy(8), 3),                    # its 3rd token is appended, then the check raises
    ("detokenize", greedy(8), 3),
])
def test_a_fault_in_one_sequence_fails_that_request_alone(engine, alone, monkeypatch, stage,
                                                          bad_sampling, bad_tokens):
    bm = engine.block_manager
    free0, failed0 = bm.num_free_blocks, engine.stats()["num_failed_requests"]
    if stage == "admit":
        engine.set_connector(RaisingConnector())
    try:
        engine.add_request(GOOD, greedy(24), request_id="good")
        engine.add_request(BAD, bad_sampling, request_id="bad")
        fault = FaultAt(engine, monkeypatch, stage, after=bad_tokens)
        final = run_all(engine)
    finally:
        for rid in ("good", "bad"):   # leave the module's engine idle whatever happened
            engine.abort(rid)
        engine.step()
        if stage == "admit":
            engine.set_connector(None)
    bad, good = final["bad"], final["good"]
    assert bad.finish_reason == "error" and bad.error == f"{stage}: RuntimeError: injected fault"
    assert len(bad.output_token_ids) == bad_tokens
    assert good.finish_reason == "length" and good.output_token_ids == alone[GOOD]
    if stage == "forward":  # prefill, decode, the failing decode re-run one by one, good alone
        assert fault.batches[:6] == [["good", "bad"]] * 3 + [["good"], ["bad"], ["good"]]
    assert bm.num_free_blocks == free0 and engine.stats()["kv_blocks_used"] == 0
    bm.check_integrity()
    assert engine.stats()["num_failed_requests"] == failed0 + 1
    monkeypatch.undo()
    assert engine.generate([NEXT], greedy(8))[0].output_token_ids == alone[NEXT]


def test_a_forward_failing_for_everyone_fails_each_alone(engine, alone, monkeypatch):
    free0 = engine.block_manager.num_free_blocks

    def broken(hidden):
        raise RuntimeError("broken model")
    monkeypatch.setattr(engine.model, "compute_logits", broken)
    engine.add_request(GOOD, greedy(4), request_id="a")
    engine.add_request(BAD, greedy(4), request_id="b")
    final = run_all(engine)
    assert {r: (o.finish_reason, o.error) for r, o in final.items()} == {
        r: ("error", "forward: RuntimeError: broken model") for r in ("a", "b")}
    assert engine.block_manager.num_free_blocks == free0
    engine.block_manager.check_integrity()
    monkeypatch.undo()
    assert engine.generate([NEXT], greedy(8))[0].output_token_ids == alone[NEXT]


# ---- the same through HTTP -----------------------------------------------------------------------
def test_http_fault_gets_its_own_500_and_the_other_request_200(engine, server, monkeypatch):
    status, want = post(server.url, {"prompt": GOOD, "temperature": 0, "max_tokens": 24,
                                     "ignore_eos": True})
    assert status == 200
    decode, bad_ids = engine._detokenize, engine.tokenizer.encode(BAD)

    def detokenize(seq):  # the "bad" prompt's 3rd token cannot be decoded
        if seq.prompt_token_ids == bad_ids and seq.num_output_tokens >= 3:
            raise RuntimeError("injected fault")
        return decode(seq)
    monkeypatch.setattr(engine, "_detokenize", detokenize)
    failed0 = stats(server.url)["num_failed_requests"]
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(post, server.url, {"prompt": GOOD, "temperature": 0,
                                              "max_tokens": 24, "ignore_eos": True})
        bad = pool.submit(post, server.url, {"prompt": BAD, "temperature": 0, "max_tokens": 8})
        (good_status, good_body), (bad_status, bad_body) = good.result(), bad.result()
    assert bad_status == 500
    assert bad_body == {"error": {
        "message": "The request failed: detokenize: RuntimeError: injected fault",
        "type": "server_error", "param": None, "code": "request_failed"}}
    assert good_status == 200 and good_body["choices"][0]["text"] == want["choices"][0]["text"]
    wait_until(lambda: stats(server.url)["kv_blocks_used"] == 0)  # stats follow each step
    assert stats(server.url)["num_failed_requests"] == failed0 + 1
    assert failed_metric(server.url) == 1.0     # a new server: its first failed request
    events = stream_events(server.url, {"prompt": BAD, "temperature": 0, "max_tokens": 8,
                                        "stream": True})
    assert {"error": {"message": "The request failed: detokenize: RuntimeError: injected fault",
                      "type": "server_error", "param": None, "code": "request_failed"}} in events
    monkeypatch.undo()
    assert post(server.url, {"prompt": NEXT, "max_tokens": 8})[0] == 200


def test_http_step_error_outside_any_sequence_fails_those_in_flight_and_keeps_serving(
        engine, server, monkeypatch):
    schedule, raised = engine.scheduler.schedule, threading.Event()

    def schedule_once():  # the 3rd step of a running request raises in the scheduler
        running = engine.scheduler.running
        if not raised.is_set() and running and running[0].num_output_tokens >= 2:
            raised.set()
            raise RuntimeError("scheduler bug")
        return schedule()
    monkeypatch.setattr(engine.scheduler, "schedule", schedule_once)
    status, body = post(server.url, {"prompt": GOOD, "temperature": 0, "max_tokens": 16})
    assert status == 500 and body["error"]["code"] == "engine_error"
    assert "scheduler bug" in body["error"]["message"]
    wait_until(lambda: stats(server.url)["kv_blocks_used"] == 0)
    assert post(server.url, {"prompt": NEXT, "max_tokens": 8})[0] == 200
