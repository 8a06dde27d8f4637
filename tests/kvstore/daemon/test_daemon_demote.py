"""``demote`` through the daemon: the HTTP route (round trip, bad requests), the clients (HTTP,
same-host socket, and a ``LayeredStore`` with the daemon as its remote part), and tenants (a
tenant cannot demote another tenant's chunks; a reader cannot demote at all). Tiny layout:
256-byte chunks of 4 tokens (``server_helpers``)."""
from __future__ import annotations

import pytest

from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient, RemoteError
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.tenants import TenantTable
from kvstore.keys import Namespace
from kvstore.layered import LayeredStore
from kvstore.store import ChunkStore

from tests.kvstore.daemon.server_helpers import (
    KEYS, LAYOUT, NS, OTHER, TOKEN, chunk, do_put, post_json, put_body,
)
from tests.kvstore.daemon.server_helpers import _clean, server  # noqa: F401  (fixtures)

ALICE, BOB, DASH = "alice-token-0123456789", "bob-token-0123456789ab", "dash-token-0123456789a"
NS_A = Namespace("tiny-model", LAYOUT, cache_salt="alice")
NS_B = Namespace("tiny-model", LAYOUT, cache_salt="bob")
KA, KB = NS_A.chunk_keys(list(range(8))), NS_B.chunk_keys(list(range(8)))


def body(keys, ns=NS):
    return {"namespace": ns.to_dict(), "keys": [k.hex() if hasattr(k, "hex") else k
                                                for k in keys]}


def status_of(fn, *args) -> int:
    try:
        fn(*args)
    except RemoteError as e:
        return e.status
    return 200


def test_the_route_demotes_stored_keys_and_counts_them(server):
    assert do_put(server, put_body(KEYS[:3], [chunk(i) for i in range(3)]))[0] == 200
    cpu = server.store.tiers[0]
    before = server.store.stats()["demoted_chunks"]
    assert post_json(server, "/v1/demote", body([KEYS[2], KEYS[1], KEYS[5]])) \
        == (200, {"demoted": 2})                  # KEYS[5] is not stored
    assert [cpu.is_demoted(k) for k in KEYS[:3]] == [False, True, True]
    assert post_json(server, "/v1/demote", body([])) == (200, {"demoted": 0})
    assert server.store.stats()["demoted_chunks"] == before + 2


def test_bad_demote_requests_are_refused_and_change_nothing(server):
    assert do_put(server, put_body(KEYS[:2], [chunk(0), chunk(1)]))[0] == 200
    before = server.store.stats()["demoted_chunks"]   # (the store serves the whole module)
    bad_hex = "zz" * (len(KEYS[0].hex()) // 2)
    cases = {
        "malformed key": body([KEYS[0].hex(), bad_hex]),
        "short key": body([KEYS[0].hex()[:-2]]),
        "keys not a list": {"namespace": NS.to_dict(), "keys": KEYS[0].hex()},
        "key of another namespace": body([OTHER.chunk_keys(list(range(4)))[0]]),
        "no namespace": {"keys": [KEYS[0].hex()]},
    }
    for what, b in cases.items():
        status, ans = post_json(server, "/v1/demote", b)
        assert status == 400, (what, ans)
        assert ans["status"] == 400 and ans["error"], what
    status, ans = post_json(server, "/v1/demote", body(KEYS[:1] * 9))   # max_batch_keys 8
    assert status == 413
    assert post_json(server, "/v1/demote", body(KEYS[:1]), auth=False)[0] == 401
    assert not any(server.store.tiers[0].is_demoted(k) for k in KEYS[:2])
    assert server.store.stats()["demoted_chunks"] == before


@pytest.fixture(scope="module")
def tenants_daemon(tmp_path_factory):
    """Tenants alice and bob, dash (reader of alice's salt), the admin ``TOKEN``; a shared CPU
    arena and a Unix socket (the same-host path)."""
    d = tmp_path_factory.mktemp("demote")
    (d / "t.yaml").write_text(
        f'tenants:\n  alice: {{token: "{ALICE}", role: tenant}}\n'
        f'  bob: {{token: "{BOB}", role: tenant}}\n'
        f'  dash: {{token: "{DASH}", role: reader, salt: alice}}\n')
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, cpu_shared=True, page_bytes=256))
    limits = ServerLimits(auth_token=TOKEN, tenants=TenantTable.from_file(d / "t.yaml"))
    srv = ThreadedServer(create_app(store, limits), unix_socket=str(d / "kv.sock"))
    srv.store, srv.sock = store, str(d / "kv.sock")
    yield srv
    srv.stop()
    store.close()


@pytest.fixture
def filled(tenants_daemon):
    s = tenants_daemon.store
    s.clear()
    assert s.put_chunks(NS_A, KA, [chunk(0), chunk(1)]) == 2
    assert s.put_chunks(NS_B, KB, [chunk(2), chunk(3)]) == 2
    return tenants_daemon


@pytest.mark.parametrize("path", ["http", "unix"])
def test_a_tenant_demotes_its_own_chunks_and_not_another_tenants(filled, path):
    def client(token):
        if path == "unix":
            return ShmKVStoreClient(filled.sock, auth_token=token, timeout_s=5.0)
        return KVStoreClient(filled.url, auth_token=token, timeout_s=5.0, same_host=False)
    cpu = filled.store.tiers[0]
    with client(ALICE) as alice, client(DASH) as dash:
        assert status_of(alice.demote, NS_B, KB) == 403      # bob's salt
        assert status_of(dash.demote, NS_A, KA) == 403       # a reader may not write
        assert not any(cpu.is_demoted(k) for k in KA + KB)
        assert alice.demote(NS_A, KA[1:]) == 1
    assert [cpu.is_demoted(k) for k in KA + KB] == [False, True, False, False]


def test_a_layered_store_demotes_locally_and_in_the_daemon(filled):
    local = ChunkStore(StoreConfig(cpu_bytes=1 << 16, page_bytes=256))
    assert local.put_chunks(NS_A, KA[:1], [chunk(0)]) == 1
    remote = KVStoreClient(filled.url, auth_token=ALICE, timeout_s=5.0)
    with LayeredStore(local, remote) as layered:
        assert layered.demote(NS_A, KA) == 2                 # the daemon holds both
        assert local.tiers[0].is_demoted(KA[0])
        assert [filled.store.tiers[0].is_demoted(k) for k in KA] == [True, True]
