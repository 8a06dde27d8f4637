"""The router says whether its shared kvstore daemon (``--kvstore-url``) answers: at start
(``StoreLookup.watch``'s first probe), when it goes down, and when it answers again, also
while every lookup is skipped; a failing lookup marks it down at once. Real ``kvstore serve``
app (``ThreadedServer``) on a port that first has nothing listening.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp

from engine_min.router.metrics import RouterMetrics
from engine_min.router.store_lookup import StoreLookup
from kvstore.config import StoreConfig
from kvstore.daemon.run import ThreadedServer
from kvstore.daemon.server import create_app as create_daemon_app
from kvstore.store import ChunkStore


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "engine_min.router"]


def test_down_at_start_back_and_down_again_are_logged(caplog):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    look = StoreLookup(url, timeout_s=2.0)
    look.probe_interval_s, look.warn_interval_s = 0.05, 0.0
    store = ChunkStore(StoreConfig(cpu_bytes="16MiB"))

    async def scenario():
        async with aiohttp.ClientSession() as session:
            watch = asyncio.create_task(look.watch(session))
            await asyncio.sleep(0.3)                       # many probes, one warning
            assert look.answering is False
            srv = await asyncio.to_thread(ThreadedServer, create_daemon_app(store),
                                          port=port)
            for _ in range(100):
                if look.answering:
                    break
                await asyncio.sleep(0.05)
            assert look.answering is True
            watch.cancel()  # (else its next probe may see the stop first, 0.05 s apart)
            await asyncio.gather(watch, return_exceptions=True)
            await asyncio.to_thread(srv.stop)
            metrics = RouterMetrics()                      # a lookup fails: down at once
            got = await look.hit_tokens(session, {b"ns": b"{}"}, metrics)
            assert got == {} and look.answering is False

    with caplog.at_level(logging.INFO, logger="engine_min.router"):
        asyncio.run(scenario())
    store.close()
    lines = _lines(caplog)
    assert [lvl for lvl, _ in lines] == ["WARNING", "INFO", "WARNING"], lines
    assert lines[0][1].startswith(f"shared store {url} is not usable (GET /v1/whoami: ")
    assert "routed on the engines' own hits until it answers" in lines[0][1]
    assert lines[1][1] == f"shared store {url} answers again; store lookups resume"
    assert lines[2][1].startswith(f"shared store {url} is not usable (lookup: ")


def test_warnings_of_a_flapping_store_are_rate_limited(caplog):
    look = StoreLookup("http://127.0.0.1:9", timeout_s=1.0)   # default 30 s between warnings
    with caplog.at_level(logging.INFO, logger="engine_min.router"):
        for _ in range(5):
            look._mark(False, "refused")
            look._mark(True)
        look._mark(False, "refused")              # stays down past the interval: logged
        look._warned_at -= look.warn_interval_s
        look._mark(False, "refused again")
        look._mark(False, "refused again")
    down = ("WARNING", "shared store http://127.0.0.1:9 is not usable (%s): requests are "
            "routed on the engines' own hits until it answers")
    assert _lines(caplog) == [
        (down[0], down[1] % "refused"),
        ("INFO", "shared store http://127.0.0.1:9 answers again; store lookups resume"),
        (down[0], down[1] % "refused again")]


TENANTS = {"alice": "alice-token-0123456789", "ops": "ops-token-0123456789abc"}


def test_a_refused_token_runs_the_router_without_the_store(tmp_path, caplog, capsys):
    """Daemon with a tenants file: a wrong or missing token is refused by ``/v1/whoami`` at
    start (one warning; the router goes on without the store, as ``engine_min serve`` does);
    a tenant's token is accepted; the probe counts a refused token as down."""
    from engine_min.cli import main as cli_main
    from kvstore.daemon.server import ServerLimits
    from kvstore.daemon.tenants import TenantTable
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(
        f'  {name}: {{token: "{tok}", role: {"admin" if name == "ops" else "tenant"}}}\n'
        for name, tok in TENANTS.items()))
    store = ChunkStore(StoreConfig(cpu_bytes="16MiB"))
    srv = ThreadedServer(create_daemon_app(store, ServerLimits(
        tenants=TenantTable.from_file(path))), port=_free_port())
    url = srv.url
    try:
        assert StoreLookup(url, auth_token="wrong-token-0123456789").check_token() == \
            "GET /v1/whoami: HTTP 401: wrong token"
        assert StoreLookup(url).check_token() == "GET /v1/whoami: HTTP 401: no token given"
        for tok in TENANTS.values():
            assert StoreLookup(url, auth_token=tok).check_token() is None
        assert StoreLookup(f"http://127.0.0.1:{_free_port()}").check_token() is None

        async def probes():
            async with aiohttp.ClientSession() as session:
                bad = StoreLookup(url, auth_token="wrong-token-0123456789")
                good = StoreLookup(url, auth_token=TENANTS["alice"])
                return await bad.probe(session), await good.probe(session)
        with caplog.at_level(logging.INFO, logger="engine_min.router"):
            assert asyncio.run(probes()) == (False, True)
        assert any("is not usable (GET /v1/whoami: HTTP 401: wrong token)" in m
                   for _, m in _lines(caplog)), _lines(caplog)
        caplog.clear()
        dead = f"http://127.0.0.1:{_free_port()}"   # the run stops at the engines after
        with caplog.at_level(logging.INFO, logger="engine_min.router"):
            assert cli_main(["route", "--engines", dead, "--kvstore-url", url,
                             "--kvstore-auth-token", "wrong-token-0123456789",
                             "--startup-timeout-s", "0.3"]) == 2
        refusals = [m for lvl, m in _lines(caplog) if "refuses the router" in m]
        assert refusals == [f"shared store {url} refuses the router (GET /v1/whoami: HTTP "
                            f"401: wrong token): routing without the store; give the "
                            f"daemon's token (--kvstore-auth-token, $KVSTORE_AUTH_TOKEN)"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine_min.router"):
            assert cli_main(["route", "--engines", dead, "--kvstore-url", url,
                             "--kvstore-auth-token", TENANTS["alice"],
                             "--startup-timeout-s", "0.3"]) == 2
        assert not [m for _, m in _lines(caplog) if "refuses" in m]
        assert "not answering /health" in capsys.readouterr().err
    finally:
        srv.stop()
        store.close()
