"""``GET /v1/whoami`` names the daemon's same-host socket and start id (``unix_socket``,
``instance``) as ``/v1/stats`` does, so a tenant token (403 on /v1/stats) still finds the
Unix-socket path of this very daemon; a daemon without one answers ``unix_socket: null``."""
from __future__ import annotations

import urllib.request

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient, RemoteError
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_discovery import daemon_socket
from kvstore.daemon.tenants import TenantTable
from kvstore.keys import Namespace
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import LAYOUT, chunk

ADMIN, ALICE = "whoami-admin-token-01", "whoami-alice-token-01"
NS_A = Namespace("tiny-model", LAYOUT, cache_salt="alice")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("whoami")
    tenants = d / "tenants.yaml"
    tenants.write_text(f'tenants:\n  alice: {{token: "{ALICE}", role: tenant}}\n')
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, cpu_shared=True, page_bytes=256))
    sock = str(d / "kv.sock")
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token=ADMIN,
                                                        tenants=TenantTable.from_file(tenants))),
                         unix_socket=sock)
    srv.sock = sock
    yield srv
    srv.stop()
    store.close()


def test_whoami_gives_the_socket_and_instance_of_stats_and_hello(daemon):
    with KVStoreClient(daemon.url, auth_token=ADMIN, same_host=False) as admin:
        stats, who = admin.stats(), admin.whoami()
    assert who == {"tenant": "admin", "role": "admin", "cache_salt": None,
                   "unix_socket": daemon.sock, "instance": stats["instance"],
                   "tier_codecs": stats["tier_codecs"], "wire_codecs": stats["wire_codecs"]}
    assert stats["unix_socket"] == daemon.sock and len(stats["instance"]) == 16
    with KVStoreClient(daemon.url, auth_token=ALICE, same_host=False) as alice:
        with pytest.raises(RemoteError) as e:
            alice.stats()
        assert e.value.status == 403
        who = alice.whoami()
    assert who == {"tenant": "alice", "role": "tenant", "cache_salt": "alice",
                   "unix_socket": daemon.sock, "instance": stats["instance"],
                   "tier_codecs": {}, "wire_codecs": stats["wire_codecs"]}
    with ShmKVStoreClient(daemon.sock, auth_token=ALICE, timeout_s=5) as shm:
        assert shm.hello()["instance"] == stats["instance"]


def test_a_tenant_token_discovers_the_socket_through_whoami(daemon):
    keys = NS_A.chunk_keys(list(range(4)))
    with KVStoreClient(daemon.url, auth_token=ALICE) as alice:
        assert alice.transport == "http"
        assert alice.put_chunks(NS_A, keys, [chunk(7)]) == 1  # the first call discovers
        assert alice.transport == "unix"
        (got,) = alice.get_chunks(NS_A, keys)
        assert torch.equal(got, chunk(7))


def test_whoami_without_a_socket_says_null():
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20))
    with ThreadedServer(create_app(store)) as srv:
        with KVStoreClient(srv.url, same_host=False) as c:
            who, stats = c.whoami(), c.stats()
    store.close()
    assert who["unix_socket"] is None and stats["unix_socket"] is None
    assert who["instance"] == stats["instance"] and isinstance(who["instance"], str)


def refusals(daemon) -> float:
    """Requests the daemon answered 403, over every route (its Prometheus counter)."""
    text = urllib.request.urlopen(urllib.request.Request(
        daemon.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}), timeout=5
    ).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvstore_server_requests_total{") and 'status="403"' in line)


def test_a_tenant_discovers_without_being_refused(daemon):
    before = refusals(daemon)
    with KVStoreClient(daemon.url, auth_token=ALICE) as alice:
        assert alice.lookup_keys(NS_A, NS_A.chunk_keys(list(range(4)))).num_requested_chunks == 1
        assert alice.transport == "unix"
    assert refusals(daemon) == before  # it asked /v1/whoami, not /v1/stats (was +1)


def test_a_daemon_without_whoami_is_asked_stats():
    asked = []

    def ask(route):
        asked.append(route)
        if route == "whoami":
            raise RemoteError(404, "no route")
        return {"unix_socket": "/x.sock", "instance": "abc"}
    assert daemon_socket(ask) == ("/x.sock", "abc") and asked == ["whoami", "stats"]
    asked.clear()

    def refused(route):
        asked.append(route)
        raise RemoteError(401, "bad token")
    assert daemon_socket(refused) == (None, None) and asked == ["whoami"]
