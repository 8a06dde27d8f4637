"""A client pointed at something that is not a kvstore daemon (another web server, an engine's
port) gets ``NotADaemon`` naming the URL, never a decoding traceback; the daemon names its
protocol on every answer; a proxy's 503 without the header is still retried."""
import asyncio
import http.client
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from kvstore.daemon import protocol as P
from kvstore.daemon.client import KVStoreClient, RemoteError
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.errors import NotADaemon
from tests.kvstore.daemon.server_helpers import KEYS, NS, chunk, make_store


def _foreign_app(calls: dict) -> web.Application:
    """A web server that is not a daemon: an HTML 404 for every path but /v1/stats, which
    answers JSON (as an engine's own routes would) without the protocol header."""
    async def any_path(request):
        calls[request.path] = calls.get(request.path, 0) + 1
        if request.path == "/v1/stats":
            return web.json_response({"object": "list", "data": []})
        if request.path == "/v1/clear":  # as python -m http.server answers a POST
            return web.Response(status=501, text="<html>Unsupported method</html>",
                                content_type="text/html")
        return web.Response(status=404, text="<html>Not Found</html>", content_type="text/html")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    return app


class _AppThread:
    """Any aiohttp app served on a free loopback port from a thread of its own."""

    def __init__(self, app: web.Application):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app)

        async def start():
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]
        self.host = "127.0.0.1"
        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def foreign():
    calls: dict = {}
    srv = _AppThread(_foreign_app(calls))
    srv.calls = calls
    yield srv
    srv.stop()


def test_every_call_to_a_foreign_server_raises_not_a_daemon_naming_the_url(foreign):
    url = f"http://{foreign.host}:{foreign.port}"
    with KVStoreClient(url, timeout_s=3.0) as c:
        for call in (lambda: c.stats(), lambda: c.lookup_keys(NS, KEYS[:2]),
                     lambda: c.get_chunks(NS, KEYS[:1]), lambda: c.exists(NS, KEYS[:1]),
                     lambda: c.put_chunks(NS, KEYS[:1], [chunk(1)]), lambda: c.clear()):
            with pytest.raises(NotADaemon) as e:
                call()
            assert isinstance(e.value, RemoteError)
            assert url in str(e.value) and P.VERSION_HEADER in str(e.value)
        assert "200 (application/json" in _message(c.stats)  # a 200 without the header too
        assert "404 (text/html" in _message(lambda: c.exists(NS, KEYS[:1]))
        assert "501 (text/html" in _message(lambda: c.clear())
        assert c.healthy() is False
    assert foreign.calls["/v1/exists"] == 2  # never retried: one request per call


def _message(call) -> str:
    with pytest.raises(NotADaemon) as e:
        call()
    return str(e.value)


def test_cli_stats_and_clear_at_a_foreign_server_print_one_line_and_exit_1(foreign):
    url = f"http://{foreign.host}:{foreign.port}"
    for cmd in ("stats", "clear"):
        extra = ["--all"] if cmd == "clear" else []
        r = subprocess.run([sys.executable, "-m", "kvstore", cmd, url, "--timeout-s", "5",
                            *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, (cmd, r.stderr)
        assert "Traceback" not in r.stderr and "is not a kvstore daemon" in r.stderr, r.stderr
        assert r.stdout == ""


def test_the_daemon_names_its_protocol_on_every_answer(tmp_path):
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits()))
    try:
        for method, path in (("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/nowhere"),
                             ("POST", "/v1/lookup"), ("GET", "/v1/stats")):
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            resp = conn.getresponse()
            resp.read()
            assert resp.getheader(P.VERSION_HEADER) == str(P.PROTOCOL_VERSION), (path, resp.status)
            conn.close()
    finally:
        srv.stop()
        store.close()


def test_a_proxys_503_without_the_header_is_still_retried():
    """A balancer in front of a restarting daemon answers 503 without our header: transient,
    retried inside the deadline like the daemon's own 503."""
    hits = {"n": 0}
    lock = threading.Lock()

    async def proxy(request):
        with lock:
            hits["n"] += 1
            n = hits["n"]
        if n <= 2:
            return web.Response(status=503, text="upstream restarting")
        return web.Response(status=200, text='{"status": "ok"}', content_type="application/json",
                            headers={P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})
    app = web.Application()
    app.router.add_get("/v1/stats", proxy)
    srv = _AppThread(app)
    try:
        with KVStoreClient(f"http://{srv.host}:{srv.port}", timeout_s=5.0) as c:
            assert c.stats() == {"status": "ok"}
        assert hits["n"] >= 3  # two 503s retried (the socket discovery may ask stats once more)
    finally:
        srv.stop()


def test_a_gateways_502_without_the_header_is_a_remote_error_without_its_page():
    """A proxy's 502 is not taken for another server (the daemon behind it may be down), and
    its HTML page is not pasted into the error."""
    async def gateway(request):
        return web.Response(status=502, text="<html>" + "x" * 2000 + "</html>",
                            content_type="text/html")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", gateway)
    srv = _AppThread(app)
    try:
        with KVStoreClient(f"http://{srv.host}:{srv.port}", timeout_s=3.0) as c:
            with pytest.raises(RemoteError) as e:
                c.remove(NS, KEYS[:1])
            assert not isinstance(e.value, NotADaemon) and e.value.status == 502
            assert "<html>" not in str(e.value) and "a proxy's answer" in str(e.value)
    finally:
        srv.stop()


def test_a_unix_url_naming_no_socket_file_says_so(tmp_path):
    from kvstore.errors import StoreUnavailable
    with KVStoreClient(f"unix://{tmp_path / 'missing.sock'}", timeout_s=3.0) as c:
        with pytest.raises(StoreUnavailable, match=r"no such socket file \(2 tries\); is the "
                                                   "kvstore daemon running"):
            c.stats()
