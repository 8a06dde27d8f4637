"""A second SIGTERM/SIGINT while ``kvstore serve`` stops exits at once (status 130, as
``engine_min serve``) with one line saying what was not persisted, instead of dying silently
mid-persist; the disk tier keeps a consistent prefix (what its writer committed), as after a
crash. Real ``kvstore serve`` processes over one disk tier; 1 MiB chunks, so that persisting
them takes long enough for the second signal to land during it."""
from __future__ import annotations

import re
import signal
import socket
import time

import pytest
import torch

from kvstore.api import chain_parents
from kvstore.daemon.protocol import BINARY_CONTENT_TYPE
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.kvstore.daemon.server_helpers import NS as SMALL_NS, chunk, put_body
from tests.kvstore.daemon.test_cli import TOKEN, Daemon

# [4 layers, k/v, 128 tokens, 4 heads, 128] fp16: 1 MiB a chunk
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, dtype="float16", chunk_size=128)
NS = Namespace("big-model", BIG)
N = 160
KEYS = NS.chunk_keys(list(range(128 * N)))
SMALL_KEYS = SMALL_NS.chunk_keys(list(range(4)))


def big(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BIG.shape(), generator=g).to(torch.float16)


def serve(tmp_path, run: int, *extra: str) -> Daemon:
    return Daemon(tmp_path / f"log{run}", "--cpu-bytes", "256MiB", "--disk-path",
                  str(tmp_path / "disk"), "--disk-bytes", "1GiB", "--disk-codec",
                  "shuffle-lz4", *extra)


def wait_for(path, text: str, within_s: float) -> None:
    t0 = time.monotonic()
    while text not in path.read_text():
        assert time.monotonic() - t0 < within_s, path.read_text()[-2000:]
        time.sleep(0.005)


def _put_and_signal_twice(d: Daemon, log) -> None:
    """Put ``N`` chunks (one chain), SIGTERM, and SIGTERM again 0.3 s into the persist pass;
    the daemon exits with status 130."""
    with d.client(timeout_s=60) as c:
        for i in range(0, N, 16):
            parents = chain_parents(KEYS[i:i + 16], KEYS[i - 1] if i else None)
            assert c.put_chunks(NS, KEYS[i:i + 16], [big(j) for j in range(i, i + 16)],
                                parents) == 16
    d.proc.send_signal(signal.SIGTERM)
    wait_for(log, "persisting the memory tiers for up to", 60)
    time.sleep(0.3)  # into the pass (it takes about 1.2 s here, unloaded)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 130


def test_second_sigterm_while_persisting_exits_at_once_saying_what_was_left(tmp_path):
    d = serve(tmp_path, 1)
    try:
        _put_and_signal_twice(d, tmp_path / "log1")
    finally:
        if d.proc.poll() is None:
            d.proc.kill()  # (a failed check: no daemon left behind)
            d.proc.wait(10)
    d.log.close()
    text = (tmp_path / "log1").read_text()
    assert "persist on close: wrote" not in text, "the persist pass ended before the signal"
    got = re.findall(r"SIGTERM again: exiting now, while closing the store \((\d+) of (\d+) "
                     r"chunks of the memory tiers not persisted\)", text)
    assert len(got) == 1, text[-2000:]
    left, todo = map(int, got[0])
    assert todo == N and 0 < left <= N

    d = serve(tmp_path, 2, "--persist-on-shutdown-s", "0")
    try:
        with d.client(timeout_s=60) as c:
            # one chain, written root first: what was committed is a prefix of it
            found = c.lookup_keys(NS, KEYS).num_hit_chunks
            assert N - left <= found < N  # at least what the line counted as persisted
            st = c.stats()
            assert st["unreachable_bytes"] == 0 and st["tiers"]["disk"]["num_chunks"] == found
            got = c.get_chunks(NS, KEYS[:found])
            assert all(torch.equal(g, big(j)) for j, g in enumerate(got))  # bit exact
    finally:
        assert d.stop() == 0


def test_second_sigint_while_draining_an_upload_exits_at_once(tmp_path):
    """An upload in flight holds the drain (up to ``--shutdown-timeout-s``); Ctrl-C again
    exits at once with one line naming the request dropped, status 130."""
    d = serve(tmp_path, 1, "--shutdown-timeout-s", "60")
    try:
        host, port = d.url.rsplit("/", 1)[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            body = put_body(SMALL_KEYS, [chunk(0)])
            s.sendall(f"POST /v1/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Content-Type: {BINARY_CONTENT_TYPE}\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n"
                      .encode() + body[:-100])  # the rest never comes
            time.sleep(0.5)
            s.settimeout(0.5)
            with pytest.raises(TimeoutError):
                s.recv(1)  # no answer: the upload is in flight
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGINT)
            log = tmp_path / "log1"
            wait_for(log, "signal received: draining", 30)
            d.proc.send_signal(signal.SIGINT)
            assert d.proc.wait(30) == 130 and time.monotonic() - t0 < 20  # not the 60 s drain
    finally:
        if d.proc.poll() is None:
            d.proc.kill()  # (a failed check: no daemon left behind)
            d.proc.wait(10)
    d.log.close()
    text = (tmp_path / "log1").read_text()
    assert text.count("again: exiting now") == 1, text[-2000:]
    assert ("SIGINT again: exiting now, while draining (1 requests in flight dropped; the "
            "memory tiers not persisted)") in text, text[-2000:]
