"""Helpers of the router's end-to-end tests: the engines' sizes, requests and metrics over
HTTP, waiting for a router's index to catch up, and a TCP relay that records, cuts or drops an
engine's connections."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine_min.router.policy import make_policy
from engine_min.router.proxy import ROUTER_KEY, create_router_app
from engine_min.serve.server import ServerThread

ROOT = Path(__file__).resolve().parents[3]
MODEL = "smollm2-test"
BS = 16
MAX_MODEL_LEN = 512
KV_BYTES = 24 * 2**20   # 34 blocks of 16 tokens: a few short chats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc=None, timeout_s: float = 240.0) -> None:
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


def start_router(urls, tokenizer, policy="cache-aware", health_interval_s=0.2, store=None
                 ) -> ServerThread:
    """A router app on its own thread (``srv.router`` is its ``Router``)."""
    app = create_router_app(urls, tokenizer, make_policy(policy),
                            health_interval_s=health_interval_s, poll_timeout_s=2.0,
                            store=store)
    srv = ServerThread(app).start()
    srv.router = app[ROUTER_KEY]
    return srv


def request(url: str, path: str, body: bytes | None = None, timeout: float = 120
             ) -> tuple[int, dict, bytes]:
    """(status, headers, body bytes) of a GET (body None) or POST, error statuses included."""
    req = urllib.request.Request(url + path, data=body,
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def post_stream(port: int, prompt: str, max_tokens: int) -> socket.socket:
    """A socket on which a streamed greedy ``/v1/completions`` request (``max_tokens`` tokens,
    EOS ignored) was sent to ``127.0.0.1:port``; read its answer with ``read_until``."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def read_until(sock: socket.socket, marker: bytes, got: bytes = b"") -> bytes:
    """``got`` and what ``sock`` sends until ``marker`` is in it (or the peer closes)."""
    while marker not in got:
        data = sock.recv(65536)
        if not data:
            break
        got += data
    return got


def stream_choices(raw: bytes) -> list[dict]:
    """The first choice of each JSON event in a raw (chunked) HTTP stream answer."""
    return [json.loads(line[6:])["choices"][0]
            for line in raw.decode(errors="replace").split("\n")
            if line.startswith("data: {") and '"choices":[{' in line]


#: the end of a chunked stream answer: its last event and the terminating chunk
STREAM_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"


def post_json(url: str, path: str, obj: dict) -> dict:
    status, _, body = request(url, path, json.dumps(obj).encode())
    assert status == 200, body
    return json.loads(body)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in request(url, "/metrics")[2].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(metrics: dict, name: str, **labels) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return metrics.get(f"{name}{{{inner}}}" if inner else name, 0.0)


def settle(router: ServerThread, engines: list, timeout_s: float = 30.0) -> None:
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


class Relay:
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
