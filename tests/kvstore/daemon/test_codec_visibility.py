"""A daemon names its lower tiers' value codecs and the wire codecs it accepts: ``/v1/whoami``,
``/v1/stats``, ``kvstore stats``'s table, ``/metrics`` (``kvstore_tier_codec_info``), the
same-host path's ``hello`` and the start log line. Against real in-process daemons over real
``ChunkStore``s: a disk tier with ``int8`` (no remote tier), and memory tiers alone."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import urllib.request

import pytest

from kvstore.config import StoreConfig
from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.wire_codec import WIRE_CODECS
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import TOKEN, make_store


@pytest.fixture
def int8_disk_daemon(tmp_path):
    """``kvstore serve --disk-codec int8`` in this process: a CPU tier and an int8 disk tier,
    with an admin token; yields the ``ThreadedServer``."""
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, disk_bytes=64 << 20,
                                   disk_path=str(tmp_path / "kv"), disk_codec="int8"))
    try:
        with ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN))) as srv:
            yield srv
    finally:
        store.close()


def test_whoami_and_stats_name_the_tier_and_wire_codecs(int8_disk_daemon):
    with KVStoreClient(int8_disk_daemon.url, auth_token=TOKEN) as c:
        who = c.whoami()
        st = c.stats()
    assert who["tier_codecs"] == {"disk": "int8"}   # no remote tier: not listed
    assert who["wire_codecs"] == ["raw", "int8", "fp8", "kivi"] == list(WIRE_CODECS)
    assert st["tier_codecs"] == {"disk": "int8"} and st["wire_codecs"] == list(WIRE_CODECS)


def test_memory_tiers_alone_list_no_codec_and_the_table_says_so(capsys):
    store = make_store()
    try:
        with ThreadedServer(create_app(store)) as srv:
            with KVStoreClient(srv.url) as c:
                assert c.whoami()["tier_codecs"] == {}
            assert cli.main(["stats", srv.url]) == 0
    finally:
        store.close()
    rows = [line for line in capsys.readouterr().out.splitlines() if "codecs" in line]
    assert [r.split(None, 1)[0] for r in rows] == ["tier_codecs", "wire_codecs"]
    assert rows[0].split(None, 1)[1] == "none (memory tiers only)"
    assert rows[1].endswith("raw, int8, fp8, kivi")


def test_stats_table_prints_each_tier_codec(int8_disk_daemon, capsys):
    assert cli.main(["stats", int8_disk_daemon.url, "--auth-token", TOKEN]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        label, value = line.split("  ", 1)
        rows[label.strip()] = value.strip()
    assert rows["tier_codecs.disk (lossy: only namespaces accepting it)"] == "int8"
    assert rows["wire_codecs (X-KVStore-Wire-Codec)"] == "raw, int8, fp8, kivi"
    assert not any(k.startswith("tier_codecs.remote") for k in rows)


def test_metrics_export_one_info_series_per_lower_tier(int8_disk_daemon):
    req = urllib.request.Request(int8_disk_daemon.url + "/metrics",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    series = [line for line in text.splitlines() if line.startswith("kvstore_tier_codec_info{")]
    assert series == ['kvstore_tier_codec_info{codec="int8",tier="disk"} 1.0']


def test_same_host_hello_names_the_codecs_as_whoami(tmp_path):
    """A same-host client's ``whoami`` (from the socket's ``hello``) names the codecs too: an
    engine whose http:// daemon switched it to the socket still learns them."""
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, cpu_shared=True,
                                   disk_bytes=64 << 20, disk_path=str(tmp_path / "kv"),
                                   disk_codec="kivi"))
    sock = str(tmp_path / "kv.sock")
    try:
        with ThreadedServer(create_app(store), unix_socket=sock) as srv:
            with KVStoreClient(srv.unix_url) as c:
                who = c.whoami()
    finally:
        store.close()
    assert who["unix_socket"] == sock
    assert who["tier_codecs"] == {"disk": "kivi"} and who["wire_codecs"] == list(WIRE_CODECS)


def test_codec_text_names_both_tiers_or_none():
    from kvstore.daemon.state import codec_text
    assert codec_text({"disk": "kivi", "remote": "raw"}) == \
        "tier codecs: disk kivi, remote raw; wire codecs accepted: raw, int8, fp8, kivi"
    assert codec_text({}).startswith("tier codecs: none (memory tiers only")
    assert codec_text(None).startswith("tier codecs: unknown")


def test_start_log_line_names_the_tier_codecs(tmp_path, caplog):
    """``serve_until_signal`` (``kvstore serve``'s loop) logs the codecs once listening;
    a SIGTERM sent to this process right after stops it (drain, no request)."""
    from kvstore.daemon.run import serve_until_signal
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, disk_bytes=64 << 20,
                                   disk_path=str(tmp_path / "kv"), disk_codec="fp8"))
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_listen(_bound) -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.daemon.server"):
            asyncio.run(asyncio.wait_for(serve_until_signal(
                create_app(store), "127.0.0.1", 0, shutdown_timeout_s=5,
                on_listen=on_listen), 60))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        store.close()
    lines = [r.getMessage() for r in caplog.records if "tier codecs" in r.getMessage()]
    assert lines == ["tier codecs: disk fp8; wire codecs accepted: raw, int8, fp8, kivi"]
