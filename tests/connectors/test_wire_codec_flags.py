"""``--kvstore-wire-codec``: an engine whose chunks a lossy codec may store
(``--kvstore-lossy-codec``) can also send them to and from its daemon encoded with it; the flag
is refused without a daemon or with another codec than the lossy one."""
import argparse
import re

import pytest
import torch

from connectors.flags import StoreFlagError, add_store_args, connector_from_args
from kvstore import kv_codec
from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import request


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def daemon():
    store = ChunkStore(StoreConfig(cpu_bytes=16 << 20))
    srv = ThreadedServer(create_app(store, ServerLimits()))
    yield srv
    srv.stop()
    store.close()


def received_bytes(daemon) -> float:
    status, text, _ = request(daemon, "GET", "/metrics", auth=False)
    assert status == 200
    return float(re.search(r"^kvstore_server_received_bytes_total ([0-9.e+]+)$",
                           text.decode(), re.M).group(1))


def test_wire_codec_flag_is_refused_without_a_daemon_or_with_another_codec(capsys):
    with pytest.raises(StoreFlagError, match="--kvstore-wire-codec needs a store"):
        connector_from_args(parse("--kvstore-wire-codec", "int8"))
    with pytest.raises(StoreFlagError, match="needs --kvstore-url"):
        connector_from_args(parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-lossy-codec", "int8",
                                  "--kvstore-wire-codec", "int8"))
    with pytest.raises(StoreFlagError, match="needs --kvstore-lossy-codec kivi .got int8"):
        connector_from_args(parse("--kvstore-url", "http://127.0.0.1:1", "--kvstore-lossy-codec",
                                  "int8", "--kvstore-wire-codec", "kivi"))
    with pytest.raises(StoreFlagError, match=r"got none"):
        connector_from_args(parse("--kvstore-url", "http://127.0.0.1:1",
                                  "--kvstore-wire-codec", "int8"))
    with pytest.raises(SystemExit):
        parse("--kvstore-url", "http://127.0.0.1:1", "--kvstore-wire-codec", "zstd")
    assert "invalid choice: 'zstd'" in capsys.readouterr().err


@pytest.mark.parametrize("wire", [None, "int8"])
def test_the_connectors_saves_travel_encoded_only_with_the_flag(daemon, wire):
    """The same int8-accepting engine saves one chunk to the daemon: raw bytes without the
    flag, the int8 payload with it; the daemon then holds the decoded values."""
    argv = ["--kvstore-url", daemon.url, "--kvstore-chunk-size", "32",
            "--kvstore-lossy-codec", "int8"] + (["--kvstore-wire-codec", wire] if wire else [])
    c = connector_from_args(parse(*argv))
    try:
        c.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)
        ns = c.ns
        g = torch.Generator().manual_seed(3)
        kv = torch.randn(ns.layout.shape(), generator=g).to(ns.layout.torch_dtype)
        key = ns.chunk_keys(range(32 * (2 if wire else 1)))[-1:]  # a key of each run's own
        before = received_bytes(daemon)
        assert c.store.put_chunks(ns, key, [kv]) == 1
        sent = received_bytes(daemon) - before
    finally:
        c.close()
    with KVStoreClient(daemon.url, same_host=False) as raw:
        held = raw.get_chunks(ns, key)[0]
    if wire is None:
        assert sent == ns.layout.chunk_bytes and torch.equal(held, kv)
    else:
        assert sent == kv_codec.payload_nbytes("int8", tuple(ns.layout.shape()))
        want = kv_codec.decode(kv_codec.encode(kv, "int8"), "int8", kv.dtype, tuple(kv.shape))
        assert torch.equal(held, want) and not torch.equal(held, kv)
