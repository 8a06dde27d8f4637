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
            await asyncio.to_thread(srv.stop)
            metrics = RouterMetrics()                      # a lookup fails: down at once
            got = await look.hit_tokens(session, {b"ns": b"{}"}, metrics)
            assert got == {} and look.answering is False
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="engine_min.router"):
        asyncio.run(scenario())
    store.close()
    lines = _lines(caplog)
    assert [lvl for lvl, _ in lines] == ["WARNING", "INFO", "WARNING"], lines
    assert lines[0][1].startswith(f"shared store {url} is not usable (GET /healthz: ")
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
