"""A daemon URL whose host name fails to resolve: a name that does not exist fails at once
(``test_cli_light``), but a temporary failure of the resolver (``EAI_AGAIN``: the DNS server
did not answer in time, a cluster's resolver restarting) is retried until the call's deadline,
as other connection errors are, so a real host's transient DNS hiccup does not fail the call.
A real daemon; the resolver's answers are scripted (``socket.getaddrinfo``)."""
import asyncio
import socket
import time

import pytest

from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.transport import Transport
from kvstore.errors import StoreUnavailable
from tests.kvstore.daemon.server_helpers import make_store

HOST = "kvstore-daemon.flaky-dns.test"


@pytest.fixture()
def daemon():
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits()))
    yield srv
    srv.stop()
    store.close()


def scripted_resolver(monkeypatch, failures: int, code: int) -> list[float]:
    """``HOST`` fails to resolve (``gaierror(code)``) ``failures`` times, then resolves to
    127.0.0.1; other names resolve as usual. Returns the times of HOST's look-ups."""
    real = socket.getaddrinfo
    calls: list[float] = []

    def getaddrinfo(host, port, *a, **kw):
        if host != HOST:
            return real(host, port, *a, **kw)
        calls.append(time.monotonic())
        if len(calls) <= failures:
            raise socket.gaierror(code, "Temporary failure in name resolution"
                                  if code == socket.EAI_AGAIN else "Name or service not known")
        return real("127.0.0.1", port, *a, **kw)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


def readyz(url: str, timeout_s: float) -> int:
    async def run():
        http = Transport(url, timeout_s=timeout_s)
        try:
            async def handle(resp):
                return resp.status
            return await http.call("GET", "/readyz", handle, idempotent=True, timeout_s=None)
        finally:
            await http.close()
    return asyncio.run(run())


def test_a_temporary_dns_failure_is_retried_until_the_host_resolves(daemon, monkeypatch):
    calls = scripted_resolver(monkeypatch, failures=4, code=socket.EAI_AGAIN)
    url = f"http://{HOST}:{daemon.url.rsplit(':', 1)[1]}"
    assert readyz(url, timeout_s=10.0) == 200  # the 5th look-up answers
    assert len(calls) == 5


def test_a_temporary_dns_failure_that_lasts_fails_at_the_deadline(daemon, monkeypatch):
    scripted_resolver(monkeypatch, failures=10**6, code=socket.EAI_AGAIN)
    url = f"http://{HOST}:{daemon.url.rsplit(':', 1)[1]}"
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no answer within 1.0 s .*Temporary failure"):
        readyz(url, timeout_s=1.0)
    assert 0.9 < time.monotonic() - t0 < 5.0


def test_a_name_that_does_not_exist_still_fails_fast(daemon, monkeypatch):
    calls = scripted_resolver(monkeypatch, failures=10**6, code=socket.EAI_NONAME)
    url = f"http://{HOST}:{daemon.url.rsplit(':', 1)[1]}"
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"cannot resolve host '{HOST}'.*2 tries"):
        readyz(url, timeout_s=30.0)
    assert time.monotonic() - t0 < 5.0 and len(calls) == 2
