"""The router end to end on the real SmolLM2-135M model: two in-process engines
(``ServerThread``) and one ``python -m engine_min serve`` subprocess (so it can be SIGKILLed),
all shared by the module; routers are in-process apps.

Narrated scenarios: the router's token ids equal an engine's own ``/tokenize`` (an engine in
another process, which loaded its own tokenizer); two users' chats start on different engines
and each later round goes back to the engine holding its history, with the index's predicted
hit tokens equal to the engine's reported ``cached_tokens`` request by request; a stream through
the router is byte-identical to what the engine sent (recorded by a TCP relay between them) and
its text equals a direct greedy request's; malformed input reaches the engine's own error, no
healthy engine is a 503 error object, a bad ``--engines`` is an error message; an engine that
goes away is taken out (index dropped) and put back with its index rebuilt from its snapshot;
an engine SIGKILLed while requests flow costs no failed request.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_min.cli import main as cli_main
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.router.cli import check_tokenizer
from engine_min.router.policy import make_policy
from engine_min.router.prompt import PromptEncoder, prompt_token_ids
from engine_min.router.proxy import ROUTER_KEY, create_router_app
from engine_min.serve.protocol import parse_messages
from engine_min.serve.server import ServerThread, create_app

ROOT = Path(__file__).resolve().parents[3]
MODEL = "smollm2-test"
BS = 16
MAX_MODEL_LEN = 512
KV_BYTES = 24 * 2**20   # 34 blocks of 16 tokens: a few short chats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def spare():
    """An engine in its own process (started first: it loads while the others do)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "serve", "--port", str(port), "--served-model-name",
         MODEL, "--kv-cache-bytes", str(KV_BYTES), "--block-size", str(BS), "--max-model-len",
         str(MAX_MODEL_LEN), "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    proc.stderr.close()


def _wait_health(url: str, proc=None, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@pytest.fixture(scope="module")
def engines(spare):
    out = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(kv_cache_bytes=KV_BYTES, block_size=BS,
                                        max_model_len=MAX_MODEL_LEN, max_num_seqs=8))
        srv = ServerThread(create_app(engine, MODEL)).start()
        srv.engine = engine
        out.append(srv)
    yield out
    for srv in out:
        srv.stop()


def _start_router(urls, tokenizer, policy="cache-aware", health_interval_s=0.2
                  ) -> ServerThread:
    app = create_router_app(urls, tokenizer, make_policy(policy),
                            health_interval_s=health_interval_s, poll_timeout_s=2.0)
    srv = ServerThread(app).start()
    srv.router = app[ROUTER_KEY]
    return srv


@pytest.fixture(scope="module")
def router(engines):
    srv = _start_router([e.url for e in engines], engines[0].engine.tokenizer)
    _settle(srv, engines)
    yield srv
    srv.stop()


# ---- helpers -------------------------------------------------------------------------------

def _request(url: str, path: str, body: bytes | None = None, timeout: float = 120
             ) -> tuple[int, dict, bytes]:
    """(status, headers, body bytes) of a GET (body None) or POST, error statuses included."""
    req = urllib.request.Request(url + path, data=body,
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _post_json(url: str, path: str, obj: dict) -> dict:
    status, _, body = _request(url, path, json.dumps(obj).encode())
    assert status == 200, body
    return json.loads(body)


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in _request(url, "/metrics")[2].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _m(metrics: dict, name: str, **labels) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return metrics.get(f"{name}{{{inner}}}" if inner else name, 0.0)


def _settle(router: ServerThread, engines: list, timeout_s: float = 30.0) -> None:
    """Wait until the router's index of each in-process engine is at the engine's latest
    event batch and no engine reports load."""
    deadline = time.monotonic() + timeout_s
    by_url = {e.url: e.engine for e in engines}
    while time.monotonic() < deadline:
        ok = True
        for e in router.router.engines:
            eng = by_url.get(e.url)
            if eng is None:
                continue
            ok &= (e.healthy and e.index.ready and e.index.epoch == eng.kv_event_log.epoch
                   and e.index.seq == eng.kv_event_log.latest_seq and e.load == 0)
        if ok:
            return
        time.sleep(0.05)
    raise TimeoutError("router index did not catch up")


# ---- scenarios -----------------------------------------------------------------------------

def test_token_ids_equal_an_engine_tokenize(engines, spare):
    proc, url = spare
    _wait_health(url, proc)
    tok = engines[0].engine.tokenizer
    prompt = "Route me: 12345 <|im_start|>  tabs\tand émojis 🚀"
    body = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    ids = prompt_token_ids(tok, body, "completion")
    assert ids == _post_json(url, "/tokenize", {"prompt": prompt})["tokens"]
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Capital of "},
                                             {"type": "text", "text": "France?"}]},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
    ids = prompt_token_ids(tok, json.dumps({"messages": messages}).encode(), "chat")
    expected = _post_json(url, "/tokenize", {"messages": messages})["tokens"]
    assert ids == expected and len(ids) > 30
    assert prompt_token_ids(tok, b'{"prompt": [[5, 6, 7]]}', "completion") == [5, 6, 7]
    # the router's encoder (cached pieces between special tokens) gives the tokenizer's ids
    enc = PromptEncoder(tok, max_cached_chars=40)
    rendered = tok.apply_chat_template(parse_messages({"messages": messages}))
    for text in (rendered, rendered, prompt, "a<|im_start|>b<|im_end|>", " <|im_end|> 1 2 ",
                 "<|im_start", "", "x" * 50 + "<|endoftext|>\n\n"):
        assert enc.encode(text) == tok.encode(text), text
    assert enc._chars <= 40 and enc._split is not None
    assert prompt_token_ids(tok, json.dumps({"messages": messages}).encode(), "chat",
                            enc) == expected
    # the start-up probe agrees with the engine; a dead engine and another tokenizer are named
    assert check_tokenizer([url], tok) == []
    dead = f"http://127.0.0.1:{_free_port()}"
    (warning,) = check_tokenizer([dead], tok)
    assert warning.startswith(f"{dead}: cannot compare tokenizers")

    class Shifted:  # a tokenizer whose ids differ from the engine's
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text):
            return [t + 1 for t in tok.encode(text)]
    (warning,) = check_tokenizer([url], Shifted())
    assert warning.startswith(f"{url} tokenizes a chat differently from --model")
    # bodies the engine refuses: the router does not tokenize them
    for raw, kind in ((b"{nope", "chat"), (b'{"messages": []}', "chat"),
                      (b'{"prompt": "x", "n": 2}', "completion"), (b"[1]", "completion")):
        assert prompt_token_ids(tok, raw, kind) is None


def _chat_round(router, messages) -> tuple[str, dict]:
    out = _post_json(router.url, "/v1/chat/completions",
                     {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
    return out["choices"][0]["message"]["content"], out["usage"]


def test_chat_rounds_go_to_the_engine_holding_the_history(router, engines):
    urls = [e.url for e in engines]
    users = {"A": [{"role": "user", "content": "Describe the harbour of Marseille, its old "
                                               "port and its fishing boats, in some detail."}],
             "B": [{"role": "user", "content": "List three facts about the planet Jupiter's "
                                               "moons Io and Europa, and their orbits."}]}
    placed: dict[str, list[tuple[str, str]]] = {"A": [], "B": []}
    prev_prompt_tokens: dict[str, int] = {}
    for rnd in range(3):
        for user, messages in users.items():
            _settle(router, engines)
            before = [_metrics(u) for u in urls]
            rbefore = _metrics(router.url)
            text, usage = _chat_round(router, messages)
            _settle(router, engines)
            rafter = _metrics(router.url)
            after = [_metrics(u) for u in urls]
            (where, reason), = [(u, r) for u in urls for r in ("hit", "load")
                                if _m(rafter, "router_requests_total", engine=u, reason=r)
                                > _m(rbefore, "router_requests_total", engine=u, reason=r)]
            placed[user].append((where, reason))
            predicted = (_m(rafter, "router_predicted_hit_tokens_total", engine=where)
                         - _m(rbefore, "router_predicted_hit_tokens_total", engine=where))
            reported = (_m(rafter, "router_reported_cached_tokens_total", engine=where)
                        - _m(rbefore, "router_reported_cached_tokens_total", engine=where))
            i = urls.index(where)
            engine_hits = (_m(after[i], "engine_prefix_cache_hits_total")
                           - _m(before[i], "engine_prefix_cache_hits_total"))
            # the index predicted exactly what the engine found, and the engine counted it
            assert predicted == reported == usage["prompt_tokens_details"]["cached_tokens"]
            assert engine_hits == reported
            if rnd > 0:  # a later round: the previous round's whole prompt was held
                assert reported >= prev_prompt_tokens[user] // BS * BS > 0, (usage, rnd)
            prev_prompt_tokens[user] = usage["prompt_tokens"]
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Go on, part {rnd + 2}."}]
    # round 1 of each user: nothing worth a hit (at most a shared system-prompt block), so by
    # load, round-robin: the users start on different engines; rounds 2 and 3 follow by hit
    assert [r for _, r in placed["A"]] == [r for _, r in placed["B"]] == ["load", "hit", "hit"]
    assert placed["A"][0][0] != placed["B"][0][0]
    for user in users:
        assert {w for w, _ in placed[user]} == {placed[user][0][0]}
    m = _metrics(router.url)
    assert m["router_failed_requests_total"] == 0
    for u in urls:
        assert _m(m, "router_engine_healthy", engine=u) == 1
        assert _m(m, "router_index_blocks", engine=u) == len(
            router.router.engines[urls.index(u)].index.blocks) > 0


class _Relay:
    """A TCP relay to an engine that records the bytes each upstream connection sent back;
    ``pause()`` refuses and cuts connections (an engine gone), ``resume()`` listens again on
    the same port."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.recorded: list[bytearray] = []
        self.drop_next_reused_post = False   # armed: see ``_pipe``
        self.num_dropped = 0
        self._socks: list[socket.socket] = []
        self.port = 0
        self.resume()
        self.url = f"http://127.0.0.1:{self.port}"

    def resume(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.sock,), daemon=True).start()

    def pause(self) -> None:
        self.sock.close()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._socks = []

    def _accept(self, sock) -> None:
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            rec = bytearray()
            self.recorded.append(rec)
            self._socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, None, True),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, rec), daemon=True).start()

    def _pipe(self, src, dst, rec, from_client: bool = False) -> None:
        """Copy ``src`` to ``dst``. Armed with ``drop_next_reused_post``, the first POST that
        arrives on a connection that already carried a request is not forwarded: both sockets
        are closed, as a server does with a keep-alive connection it closed while idle."""
        reused = False
        try:
            while data := src.recv(65536):
                if from_client and reused and self.drop_next_reused_post \
                        and data.startswith(b"POST "):
                    self.drop_next_reused_post = False
                    self.num_dropped += 1
                    return
                reused = from_client
                if rec is not None:
                    rec += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def event_stream_body(self) -> bytes:
        """The de-chunked body of the one ``text/event-stream`` response recorded."""
        bodies = []
        for rec in self.recorded:
            data = bytes(rec)
            at = data.find(b"Content-Type: text/event-stream")
            if at < 0:
                continue
            pos, body = data.index(b"\r\n\r\n", at) + 4, b""
            while True:
                eol = data.index(b"\r\n", pos)
                size = int(data[pos:eol], 16)
                if size == 0:
                    break
                body += data[eol + 2:eol + 2 + size]
                pos = eol + 2 + size + 2
            bodies.append(body)
        assert len(bodies) == 1, len(bodies)
        return bodies[0]

    def close(self) -> None:
        self.pause()


def test_stream_is_byte_identical_to_the_engines(engines):
    eng = engines[1]
    relay = _Relay(eng.port)
    srv = _start_router([relay.url], eng.engine.tokenizer, policy="round-robin")
    try:
        _wait_health(srv.url)
        prompt = "The three primary colours are"
        req = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}
        status, headers, got = _request(srv.url, "/v1/completions", json.dumps(req).encode())
        assert status == 200 and headers["Content-Type"] == "text/event-stream"
        assert got == relay.event_stream_body()
        events = [json.loads(line[6:]) for line in got.decode().split("\n\n")
                  if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        direct = _post_json(eng.url, "/v1/completions",
                            {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                             "temperature": 0})
        assert text == direct["choices"][0]["text"] and len(text) > 10
        assert got.endswith(b"data: [DONE]\n\n")
        # the stream's usage chunk was counted (the prompt was new: 0 cached tokens; the
        # direct request then hit the stream's blocks, outside the router)
        usage = events[-1]["usage"]
        m = _metrics(srv.url)
        assert _m(m, "router_reported_cached_tokens_total", engine=relay.url) == \
            usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert _m(m, "router_requests_total", engine=relay.url, reason="round_robin") == 1
    finally:
        srv.stop()
        relay.close()


def test_client_leaving_a_stream_aborts_the_engines_request(router, engines):
    _settle(router, engines)
    before = [_metrics(e.url) for e in engines]
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
    _settle(router, engines)   # the router's in-flight count and the engines' load back to 0
    key = 'engine_request_success_total{finished_reason="abort"}'
    aborted = [_metrics(e.url).get(key, 0.0) - b.get(key, 0.0) for e, b in zip(engines, before)]
    assert sorted(aborted) == [0.0, 1.0]
    generated = sum(_metrics(e.url)["engine_generation_tokens_total"]
                    - b["engine_generation_tokens_total"] for e, b in zip(engines, before))
    assert generated < 300


def test_bad_input_reaches_the_engines_error(router, engines):
    for path, raw in (("/v1/completions", b"{not json"),
                      ("/v1/chat/completions", b'{"messages": "hi"}'),
                      ("/v1/completions", b'{"prompt": "hi", "model": "other"}')):
        status, headers, body = _request(router.url, path, raw)
        direct = _request(engines[0].url, path, raw)
        assert (status, body) == (direct[0], direct[2]) and status in (400, 404)
        assert headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["error"]["message"]
    status, _, body = _request(router.url, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    assert _request(router.url, "/health")[0] == 200


def test_no_healthy_engine_and_bad_engine_urls(engines, capsys):
    dead = f"http://127.0.0.1:{_free_port()}"
    srv = _start_router([dead], engines[0].engine.tokenizer)
    try:
        time.sleep(0.5)
        for path, raw in (("/v1/completions", b'{"prompt": "hi"}'), ("/health", None),
                          ("/v1/models", None)):
            status, _, body = _request(srv.url, path, raw)
            err = json.loads(body)["error"]
            assert status == 503 and err["code"] == "no_healthy_engine"
            assert err["type"] == "server_error" and err["message"]
        m = _metrics(srv.url)
        assert m["router_failed_requests_total"] == 1
        assert _m(m, "router_engine_healthy", engine=dead) == 0
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
    _post_json(eng.url, "/v1/completions", {"model": MODEL, "prompt": "Blocks to hold: " * 16,
                                            "max_tokens": 2})
    relay = _Relay(eng.port)
    relay.engine = eng.engine
    srv = _start_router([relay.url], eng.engine.tokenizer)
    try:
        _settle(srv, [relay])
        e = srv.router.engines[0]
        held = set(e.index.blocks)
        snapshot = json.loads(_request(eng.url, "/v1/kv_events/snapshot")[2])
        assert held == {bytes.fromhex(h) for h in snapshot["block_hashes"]} and len(held) >= 4
        relay.pause()
        deadline = time.monotonic() + 10
        while e.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        m = _metrics(srv.url)
        assert _m(m, "router_engine_healthy", engine=relay.url) == 0
        assert _m(m, "router_index_blocks", engine=relay.url) == 0 and not e.index.ready
        assert _request(srv.url, "/health")[0] == 503
        relay.resume()
        _settle(srv, [relay])
        assert e.index.blocks == held
        m = _metrics(srv.url)
        assert _m(m, "router_engine_healthy", engine=relay.url) == 1
        assert _m(m, "router_index_blocks", engine=relay.url) == len(held)
    finally:
        srv.stop()
        relay.close()


def test_sigkilled_engine_costs_no_request(engines, spare):
    proc, url = spare
    _wait_health(url, proc)
    live = engines[1]
    srv = _start_router([live.url, url], live.engine.tokenizer)
    try:
        _settle(srv, [live])
        dead = srv.router.engines[1]
        _post_json(url, "/v1/completions", {"model": MODEL, "max_tokens": 2,
                                            "prompt": "Something the killed engine held. " * 8})
        held = {bytes.fromhex(h) for h in json.loads(
            _request(url, "/v1/kv_events/snapshot")[2])["block_hashes"]}
        deadline = time.monotonic() + 30
        while dead.index.blocks != held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _m(_metrics(srv.url), "router_index_blocks", engine=url) == len(held) >= 3
        prompts = [f"Request number {i}: write a sentence about the colour of {c}."
                   for i, c in enumerate(["red", "green", "blue", "gold"])]

        def run(p):
            return _request(srv.url, "/v1/completions", json.dumps(
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
            direct = _post_json(live.url, "/v1/completions", {"model": MODEL, "prompt": p,
                                                              "max_tokens": 8, "temperature": 0})
            assert json.loads(body)["choices"][0]["text"] == direct["choices"][0]["text"]
        m = _metrics(srv.url)
        assert m["router_failed_requests_total"] == 0
        assert _m(m, "router_requests_total", engine=live.url, reason="retry") >= 1
        assert _m(m, "router_engine_healthy", engine=url) == 0
        assert _m(m, "router_index_blocks", engine=url) == 0
        assert sum(v for k, v in m.items() if k.startswith("router_requests_total")) == \
            len(prompts) + _m(m, "router_requests_total", engine=live.url, reason="retry")
    finally:
        srv.stop()


def test_connection_closed_by_the_engine_between_requests_costs_nothing(engines):
    """The engine closes a keep-alive connection the router holds in its pool just as the
    router sends the next request on it: the router sends it again on a fresh connection to
    the same engine, which stays in service (with no other engine to fall back to, taking it
    out would have failed the request)."""
    eng = engines[0]
    relay = _Relay(eng.port)
    srv = _start_router([relay.url], eng.engine.tokenizer, health_interval_s=30.0)
    try:
        _wait_health(srv.url)
        req = json.dumps({"model": MODEL, "prompt": "Keep-alive test:", "max_tokens": 3,
                          "temperature": 0}).encode()
        first = _request(srv.url, "/v1/completions", req)
        relay.drop_next_reused_post = True
        second = _request(srv.url, "/v1/completions", req)
        assert first[0] == second[0] == 200 and relay.num_dropped == 1
        assert json.loads(first[2])["choices"] == json.loads(second[2])["choices"]
        m = _metrics(srv.url)
        assert _m(m, "router_stale_connection_retries_total", engine=relay.url) == 1
        assert _m(m, "router_engine_healthy", engine=relay.url) == 1
        assert m["router_failed_requests_total"] == 0
        assert _m(m, "router_requests_total", engine=relay.url, reason="retry") == 0
        assert srv.router.engines[0].healthy
    finally:
        srv.stop()
        relay.close()
