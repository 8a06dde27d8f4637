"""The same-host client (``ShmKVStoreClient``, ``KVStoreClient("unix://...")`` and an HTTP
``KVStoreClient`` discovering the daemon's socket) against a real daemon serving the socket:
bit-exact gets (arena runs and inline lower-tier chunks) and puts, out buffers, lookup tiers,
auth errors, a read-only arena, a killed or stopped daemon within the deadline, and the HTTP
fallback. Tiny layout: 256-byte chunks of 4 tokens (``server_helpers``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from connectors.stores import StoreSpec, http_url, open_store
from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient, RemoteError, StoreUnavailable
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_conn import Arena
from kvstore.daemon.tenants import TenantTable
from kvstore.keys import Namespace
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import LAYOUT, NS, chunk

KEYS = NS.chunk_keys(list(range(4 * 12)))  # 12 chained chunk keys
TOKEN = "shm-admin-token-0123"
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
NS_A = Namespace("tiny-model", LAYOUT, cache_salt="alice")
NS_B = Namespace("tiny-model", LAYOUT, cache_salt="bob")
ROOT = Path(__file__).resolve().parents[3]


def shared_store(cpu_bytes: int, disk_path: str | None = None) -> ChunkStore:
    return ChunkStore(StoreConfig(cpu_bytes=cpu_bytes, cpu_shared=True, page_bytes=256,
                                  disk_path=disk_path, disk_bytes=(64 << 20) if disk_path else 0))


def serve(store: ChunkStore, sock: Path, **limits) -> ThreadedServer:
    srv = ThreadedServer(create_app(store, ServerLimits(max_lease_s=5.0, **limits)),
                         unix_socket=str(sock))
    srv.store, srv.sock = store, str(sock)
    return srv


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """Admin token ``TOKEN`` plus tenants alice and bob; 1 MiB shared CPU arena, disk below."""
    d = tmp_path_factory.mktemp("shm")
    tenants = d / "tenants.yaml"
    tenants.write_text(f'tenants:\n  alice: {{token: "{ALICE}", role: tenant}}\n'
                       f'  bob: {{token: "{BOB}", role: tenant}}\n')
    store = shared_store(1 << 20, str(d / "disk"))
    srv = serve(store, d / "kv.sock", auth_token=TOKEN, tenants=TenantTable.from_file(tenants))
    yield srv
    srv.stop()
    store.close()


@pytest.fixture
def client(daemon):
    daemon.store.clear()
    with ShmKVStoreClient(daemon.sock, auth_token=TOKEN, timeout_s=5.0) as c:
        yield c


def count_copies(monkeypatch) -> list:
    """Record each ``Arena.copy_runs`` call's runs (gets served from the arena, not inline)."""
    calls, orig = [], Arena.copy_runs

    def spy(self, runs, dst):
        calls.append(runs)
        return orig(self, runs, dst)
    monkeypatch.setattr(Arena, "copy_runs", spy)
    return calls


def test_gets_copy_from_the_read_only_arena_bit_exact(client, daemon, monkeypatch):
    kvs = [chunk(i) for i in range(4)]
    assert client.put_chunks(NS, KEYS[:4], kvs) == 4
    assert client.put_chunks(NS, KEYS[:4], kvs) == 0  # stored already
    hello = client.hello()
    assert hello["arena_bytes"] == 1 << 20 and hello["page_bytes"] == 256
    w = client.whoami()
    assert w == {"tenant": "admin", "role": "admin", "cache_salt": None,
                 "instance": client.hello()["instance"], "unix_socket": client.path,
                 "tier_codecs": hello["tier_codecs"], "wire_codecs": hello["wire_codecs"]}
    assert len(w["instance"]) > 8
    calls = count_copies(monkeypatch)
    got = client.get_chunks(NS, KEYS[:5])
    assert [torch.equal(g, kv) for g, kv in zip(got[:4], kvs)] == [True] * 4 and got[4] is None
    assert got[0].shape == (2, 2, 4, 1, 8) and got[0].dtype == torch.float16
    assert len(calls) == 4 and all(sum(n for _, n in runs) == 256 for runs in calls)
    assert client.get_chunks(NS, KEYS[4:6]) == [None, None]
    assert client.get_chunks(NS, []) == []
    # every borrow was released: nothing is reader-pinned in the daemon's store
    assert daemon.store.remove(NS, KEYS[:4]) == 4 and client.exists(NS, KEYS[:4]) == [False] * 4


def test_out_buffers_receive_the_chunks(client):
    kvs = [chunk(10 + i) for i in range(3)]
    client.put_chunks(NS, KEYS[:3], kvs)
    out = [torch.full(LAYOUT.shape(), 7.0, dtype=torch.float16) for _ in range(4)]
    got = client.get_chunks(NS, KEYS[:4], out)
    assert [g is o for g, o in zip(got[:3], out)] == [True] * 3 and got[3] is None
    assert all(torch.equal(o, kv) for o, kv in zip(out, kvs))
    assert torch.equal(out[3], torch.full(LAYOUT.shape(), 7.0, dtype=torch.float16))
    with pytest.raises(ValueError, match="3 keys but 2 out tensors"):
        client.get_chunks(NS, KEYS[:3], out[:2])
    with pytest.raises(ValueError, match="contiguous CPU float16 tensor of shape"):
        client.get_chunks(NS, KEYS[:1], [out[0].float()])
    with pytest.raises(ValueError, match="contiguous"):
        client.get_chunks(NS, KEYS[:1], [out[0].transpose(0, 1)])


def test_lower_tier_chunks_come_inline_and_lookups_name_tiers(tmp_path, monkeypatch):
    """A 2 KiB CPU tier holds 8 chunks: 12 puts spill the oldest to disk."""
    store = shared_store(2048, str(tmp_path / "disk"))
    srv = serve(store, tmp_path / "kv.sock")
    try:
        with ShmKVStoreClient(srv.sock, timeout_s=5.0) as c:
            kvs = [chunk(20 + i) for i in range(12)]
            assert c.put_chunks(NS, KEYS, kvs) == 12
            res = c.lookup_keys(NS, KEYS)
            assert res == store.lookup_keys(NS, KEYS)
            assert res.num_hit_chunks == 12 and res.hits_by_tier == {"cpu": 8, "disk": 4}
            calls = count_copies(monkeypatch)
            got = c.get_chunks(NS, KEYS)
            assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))
            assert 0 < len(calls) < 12  # the disk chunks came inline
    finally:
        srv.stop()
        store.close()


def test_puts_are_checked_locally_and_errors_carry_http_statuses(client, daemon):
    with pytest.raises(ValueError, match="KV dtype mismatch"):
        client.put_chunks(NS, KEYS[:1], [chunk(0).float()])
    with pytest.raises(ValueError, match="1 keys but 2 tensors"):
        client.put_chunks(NS, KEYS[:1], [chunk(0), chunk(1)])
    with pytest.raises(ValueError, match="2 keys but 1 parents"):
        client.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)], parents=[None])
    assert client.exists(NS, KEYS[:1]) == [False]  # nothing was stored
    with ShmKVStoreClient(daemon.sock, auth_token="wrong-token-000000", timeout_s=2) as bad:
        with pytest.raises(RemoteError) as e:
            bad.lookup_keys(NS, KEYS)
        assert e.value.status == 401
    with ShmKVStoreClient(daemon.sock, auth_token=ALICE, timeout_s=2) as alice:
        assert alice.whoami()["cache_salt"] == "alice"
        assert alice.put_chunks(NS_A, NS_A.chunk_keys(list(range(4))), [chunk(1)]) == 1
        kb = NS_B.chunk_keys(list(range(4)))
        for call in (lambda: alice.lookup_keys(NS_B, kb), lambda: alice.get_chunks(NS_B, kb),
                     lambda: alice.put_chunks(NS_B, kb, [chunk(2)]), lambda: alice.stats()):
            with pytest.raises(RemoteError) as e:
                call()
            assert e.value.status == 403
        assert alice.lookup_keys(NS_A, NS_A.chunk_keys(list(range(4)))).num_hit_chunks == 1
    assert daemon.store.exists(NS_B, NS_B.chunk_keys(list(range(4)))) == [False]


def test_pins_clear_and_stats_over_the_socket(client, daemon):
    client.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)])
    assert client.pin(NS, KEYS[:2], lease_s=1.0) == 2
    assert client.unpin(NS, KEYS[:2]) == 2
    assert client.remove(NS, KEYS[2:4]) == 1
    stats = client.stats()
    assert stats["unix_socket"] == daemon.sock and isinstance(stats["instance"], str)
    assert client.clear(NS) == 2
    assert client.exists(NS, KEYS[:3]) == [False] * 3


def test_the_client_mapping_is_read_only(client):
    """The arena is mapped PROT_READ: numpy refuses, and a raw write kills the writer."""
    client.put_chunks(NS, KEYS[:1], [chunk(0)])
    client.get_chunks(NS, KEYS[:1])
    arena = client._arenas["current"]
    assert arena.nbytes == 1 << 20 and not arena.array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        arena.array[0] = 1
    code = ("import ctypes, sys\n"
            "from kvstore.daemon.shm_client import ShmKVStoreClient\n"
            f"c = ShmKVStoreClient({client.path!r}, auth_token={TOKEN!r})\n"
            "c.hello()\n"
            "a = c._arenas['current'].array\n"
            "print('mapped', a.size, flush=True)\n"
            "ctypes.memset(a.ctypes.data, 0, 1)\n"
            "print('wrote', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.decode() == f"mapped {1 << 20}\n" and p.returncode == -signal.SIGSEGV
    assert torch.equal(client.get_chunks(NS, KEYS[:1])[0], chunk(0))  # the arena is intact


def test_http_client_discovers_the_socket_and_falls_back_when_it_is_absent(daemon):
    daemon.store.clear()
    with KVStoreClient(daemon.url, auth_token=TOKEN, timeout_s=5.0) as c:
        assert c.transport == "http"  # nothing asked yet
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        assert c.transport == "unix"
        assert torch.equal(c.get_chunks(NS, KEYS[:1])[0], chunk(0))
        assert "kvstore_server_requests_total" in c.metrics_text()  # /metrics: over HTTP
    with KVStoreClient(daemon.url, auth_token=TOKEN, same_host=False) as c:
        assert c.lookup_keys(NS, KEYS).num_hit_chunks == 2 and c.transport == "http"
    moved = daemon.sock + ".moved"
    os.rename(daemon.sock, moved)  # the announced socket file is absent: HTTP stays
    try:
        with KVStoreClient(daemon.url, auth_token=TOKEN, timeout_s=5.0) as c:
            assert c.lookup_keys(NS, KEYS).num_hit_chunks == 2 and c.transport == "http"
    finally:
        os.rename(moved, daemon.sock)


def test_http_client_stays_on_http_for_a_daemon_without_a_socket(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256))
    srv = ThreadedServer(create_app(store))
    try:
        with KVStoreClient(srv.url, timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(3)]) == 1 and c.transport == "http"
            assert torch.equal(c.get_chunks(NS, KEYS[:1])[0], chunk(3))
    finally:
        srv.stop()
        store.close()


def test_unix_urls_are_taken_wherever_a_daemon_url_is(daemon):
    url = "unix://" + daemon.sock
    assert http_url(url) == url and StoreSpec(url=url).url == url
    for bad in ("unix://relative/sock", "unix://", "unix:///a\0b"):
        with pytest.raises(ValueError, match="unix:///ABSOLUTE/PATH"):
            http_url(bad)
    opened = open_store(StoreSpec(url=url, auth_token=ALICE, timeout_s=5.0))
    try:
        assert opened.store.transport == "unix" and opened.tenant_salt == "alice"
    finally:
        opened.store.close()
    with KVStoreClient(url, auth_token=TOKEN, timeout_s=5.0) as c:
        assert c.transport == "unix" and c.url == url
        assert c.capabilities.get_into_buffers and c.capabilities.remote
        with pytest.raises(RemoteError) as e:
            c.metrics_text()
        assert e.value.status == 404


def _serve_proc(tmp_path: Path) -> tuple[subprocess.Popen, str, str]:
    sock = str(tmp_path / "d.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", "4MiB",
         "--page-bytes", "256", "--log-level", "warning", "--unix-socket", sock],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline().decode()
    assert "listening on" in line, line
    return proc, line.strip().rsplit(" ", 1)[-1], sock


def test_kvstore_serve_unix_socket_then_killed_or_stopped(tmp_path):
    """A ``kvstore serve --unix-socket`` process: bit-exact traffic, then SIGSTOP (hung: the
    deadline) and SIGKILL (gone: refused at once)."""
    proc, url, sock = _serve_proc(tmp_path)
    try:
        with KVStoreClient("unix://" + sock, timeout_s=0.5) as c, \
                KVStoreClient(url, timeout_s=5.0) as h:
            kvs = [chunk(30 + i) for i in range(3)]
            assert c.put_chunks(NS, KEYS[:3], kvs) == 3
            assert all(torch.equal(g, kv) for g, kv in zip(h.get_chunks(NS, KEYS[:3]), kvs))
            assert h.transport == "unix" and h.stats()["unix_socket"] == sock
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="no answer within 0.5 s"):
                c.get_chunks(NS, KEYS[:3])
            assert time.monotonic() - t0 < 1.0
            proc.send_signal(signal.SIGKILL)
            proc.send_signal(signal.SIGCONT)
            proc.wait(10)
            for call in (lambda: c.lookup_keys(NS, KEYS), lambda: c.pin(NS, KEYS[:1], 1.0)):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    call()
                assert time.monotonic() - t0 < 0.5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
