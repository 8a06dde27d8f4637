"""An engine's ``--kvstore-lossy-codec`` that no tier or wire uses is warned about at start,
once, naming both sides (``connectors.codec_check``): against a real in-process daemon whose
disk tier is ``int8`` (``kvstore serve --disk-codec int8``), and in-process stores with and
without a disk tier. The flags go through ``connector_from_args`` as ``engine_min serve``'s
do."""
from __future__ import annotations

import argparse
import logging

import pytest

from connectors import codec_check
from connectors.codec_check import lossy_codec_warning
from connectors.flags import add_store_args, connector_from_args
from kvstore.config import StoreConfig
from kvstore.daemon.server import ThreadedServer, create_app
from kvstore.store import ChunkStore

LOGGER = "kvstore.connectors.codec_check"


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(autouse=True)
def fresh_once():
    """Each test starts as a new process would: no line warned yet."""
    codec_check._warned.clear()
    yield
    codec_check._warned.clear()


@pytest.fixture(scope="module")
def int8_daemon(tmp_path_factory):
    """A daemon whose disk tier writes int8 (no remote tier); yields its URL."""
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, disk_bytes=64 << 20,
                                   disk_path=str(tmp_path_factory.mktemp("kv") / "d"),
                                   disk_codec="int8"))
    try:
        with ThreadedServer(create_app(store)) as srv:
            yield srv.url
    finally:
        store.close()


def _warnings(caplog, *argv) -> list[str]:
    """The codec check's WARNING lines while building (and closing) a connector of ``argv``."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        connector_from_args(parse(*argv)).close()
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_daemon_without_the_engines_codec_is_warned_about_once(int8_daemon, caplog):
    lines = _warnings(caplog, "--kvstore-url", int8_daemon, "--kvstore-lossy-codec", "kivi")
    assert len(lines) == 1
    assert lines[0].startswith("--kvstore-lossy-codec kivi: no tier stores this engine's "
                               "chunks with kivi")
    assert f"daemon {int8_daemon} tiers: disk int8; wire: raw" in lines[0]
    assert "--disk-codec kivi" in lines[0]
    # a second connector of the same engine (vLLM's two roles): no second line
    assert _warnings(caplog, "--kvstore-url", int8_daemon, "--kvstore-lossy-codec", "kivi") \
        == []


def test_a_codec_the_daemon_or_the_wire_uses_is_not_warned_about(int8_daemon, caplog):
    assert _warnings(caplog, "--kvstore-url", int8_daemon, "--kvstore-lossy-codec",
                     "int8") == []                                  # the daemon's disk tier
    assert _warnings(caplog, "--kvstore-url", int8_daemon, "--kvstore-lossy-codec", "kivi",
                     "--kvstore-wire-codec", "kivi") == []           # encoded on the wire
    assert _warnings(caplog, "--kvstore-url", int8_daemon) == []     # bit-exact engine


def test_in_process_store_without_a_lower_tier_is_warned_about(tmp_path, caplog):
    lines = _warnings(caplog, "--kvstore-cpu-bytes", "64MiB", "--kvstore-lossy-codec", "kivi")
    assert lines == [
        "--kvstore-lossy-codec kivi: no tier stores this engine's chunks with kivi, yet they "
        "get keys of their own (never shared with bit-exact engines): no byte saved. "
        "In-process store: no disk or remote tier; give it a disk tier (--kvstore-disk-path) "
        "or a remote tier (--kvstore-remote-url), or drop --kvstore-lossy-codec"]
    assert _warnings(caplog, "--kvstore-cpu-bytes", "64MiB", "--kvstore-disk-path",
                     str(tmp_path / "kv"), "--kvstore-disk-bytes", "64MiB",
                     "--kvstore-lossy-codec", "kivi") == []


def test_in_process_disk_tier_in_front_of_the_daemon_uses_the_codec(int8_daemon, tmp_path,
                                                                     caplog):
    assert _warnings(caplog, "--kvstore-url", int8_daemon, "--kvstore-disk-path",
                     str(tmp_path / "kv"), "--kvstore-disk-bytes", "64MiB",
                     "--kvstore-lossy-codec", "kivi") == []
    lines = _warnings(caplog, "--kvstore-url", int8_daemon, "--kvstore-cpu-bytes", "64MiB",
                      "--kvstore-lossy-codec", "fp8")
    assert len(lines) == 1 and "In-process store: none; daemon " in lines[0]


def test_a_daemon_that_names_no_codecs_is_not_judged():
    """An older daemon (no ``tier_codecs``) or one that did not answer (``{}``): unknown."""
    assert lossy_codec_warning("kivi", None, {"role": "admin"}) is None
    assert lossy_codec_warning("kivi", None, {}) is None
    assert lossy_codec_warning("", {}, None) is None
    assert lossy_codec_warning("kivi", {}, {"tier_codecs": {}, "wire_codecs": ["raw"]},
                               wire_codec="kivi") is not None     # the daemon refuses kivi
