"""Tenants of ``kvstore serve``: each token is bound to its tenant's salt, ``all`` and other
cross-tenant operations need an admin, and connectors name their tenant's namespaces.

Tenants (``kvstore.daemon.tenants``): alice and bob (role tenant, salts "alice" and "bob"), dash
(reader of alice's salt), ops (admin). Tiny layout: 256-byte chunks of 4 tokens.
"""
from __future__ import annotations

import json
import re
import socket
import time

import pytest
import torch

from connectors.factory import create_connector
from kvstore.daemon.client import KVStoreClient, RemoteError
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from kvstore.daemon.tenants import TenantTable, bind_salt

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS_A = Namespace("tiny-model", LAYOUT, cache_salt="alice")
NS_B = Namespace("tiny-model", LAYOUT, cache_salt="bob")
KA = NS_A.chunk_keys(list(range(12)))   # 3 chained keys of alice
KB = NS_B.chunk_keys(list(range(8)))    # 2 chained keys of bob (same tokens, other salt)
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab",
          "dash": "dash-token-0123456789a", "ops": "ops-token-0123456789abc"}
TENANTS_YAML = f"""
tenants:
  alice: {{token: "{TOKENS['alice']}", role: tenant}}
  bob:   {{token: "{TOKENS['bob']}", role: tenant}}
  dash:  {{token: "{TOKENS['dash']}", role: reader, salt: alice}}
  ops:   {{token: "{TOKENS['ops']}", role: admin}}
"""


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


def ident(client) -> dict:
    """``whoami``'s identity fields (it also names the daemon's socket and instance)."""
    who = client.whoami()
    return {k: who[k] for k in ("tenant", "role", "cache_salt")}


def status_of(fn, *args, **kw) -> int:
    """200 if the call succeeds, else the daemon's error status."""
    try:
        fn(*args, **kw)
    except RemoteError as e:
        return e.status
    return 200


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256))
    srv = ThreadedServer(create_app(store, ServerLimits(tenants=TenantTable.from_file(path))))
    srv.store = store
    srv.clients = {name: KVStoreClient(srv.url, auth_token=tok, timeout_s=10)
                   for name, tok in TOKENS.items()}
    yield srv
    for c in srv.clients.values():
        c.close()
    srv.stop()
    store.close()


@pytest.fixture(autouse=True)
def _clean(daemon):
    daemon.store.clear()
    yield


def _fill(daemon):
    c = daemon.clients
    assert c["alice"].put_chunks(NS_A, KA, [chunk(i) for i in range(3)]) == 3
    assert c["bob"].put_chunks(NS_B, KB, [chunk(10 + i) for i in range(2)]) == 2


# ---- the tenants file -----------------------------------------------------------------------
def test_tenants_file_in_yaml_toml_and_json_reads_the_same(tmp_path):
    yaml_p = tmp_path / "t.yaml"
    yaml_p.write_text(TENANTS_YAML)
    toml_p = tmp_path / "t.toml"
    toml_p.write_text("\n".join(
        [f'[tenants.alice]\ntoken = "{TOKENS["alice"]}"\nrole = "tenant"',
         f'[tenants.bob]\ntoken = "{TOKENS["bob"]}"',  # role defaults to tenant
         f'[tenants.dash]\ntoken = "{TOKENS["dash"]}"\nrole = "reader"\nsalt = "alice"',
         f'[tenants.ops]\ntoken = "{TOKENS["ops"]}"\nrole = "admin"']))
    json_p = tmp_path / "t.json"
    json_p.write_text(json.dumps({"alice": {"token": TOKENS["alice"]},
                                  "bob": {"token": TOKENS["bob"], "role": "tenant"},
                                  "dash": {"token": TOKENS["dash"], "role": "reader",
                                           "salt": "alice"},
                                  "ops": {"token": TOKENS["ops"], "role": "admin"}}))
    want = [("alice", "tenant", "alice"), ("bob", "tenant", "bob"),
            ("dash", "reader", "alice"), ("ops", "admin", None)]
    for p in (yaml_p, toml_p, json_p):
        table = TenantTable.from_file(p)
        assert [(t.name, t.role, t.salt) for t in table.tenants] == want
        assert all(TOKENS[t.name] not in repr(t) for t in table.tenants)  # never in a repr
        assert table.authenticate(f"Bearer {TOKENS['dash']}").name == "dash"
        assert table.authenticate(f"bearer  {TOKENS['ops']} ").name == "ops"
        assert table.authenticate(f"Basic {TOKENS['ops']}") is None
        assert table.authenticate(None) is None
        assert table.authenticate("Bearer caf\u00e9-token-0123456789") is None  # not ASCII


@pytest.mark.parametrize("text, msg", [
    ("tenants: {}", "non-empty mapping"),
    ("tenants:\n  a: {token: short-token, role: tenant}", "tenant 'a' needs a token of 16 to 4096"),
    ("tenants:\n  a: {token: 'has space 0123456789', role: tenant}", "needs a token of 16 to 4096"),
    ("tenants:\n  a: {token: aaaaaaaaaaaaaaaaaaaa, role: owner}", "has role 'owner'"),
    ("tenants:\n  a: {token: aaaaaaaaaaaaaaaaaaaa, salt: 'x/y'}", "salt must be a string without '/'"),
    ("tenants:\n  a: {token: aaaaaaaaaaaaaaaaaaaa, salt: null}", "salt must be a string"),
    ("tenants:\n  a: {token: aaaaaaaaaaaaaaaaaaaa, pass: 1}", "unknown fields ['pass']"),
    ("tenants:\n  'a b': {token: aaaaaaaaaaaaaaaaaaaa}", "tenant name 'a b' must be"),
    ("tenants:\n  a: {token: aaaaaaaaaaaaaaaaaaaa}\n  b: {token: aaaaaaaaaaaaaaaaaaaa}",
     "two tenants share a token"),
    ("tenants: [a, b", "malformed tenants file"),
    # a list where the mapping goes was read as a tenant named 'tenants'
    ("tenants: []", "expected a non-empty mapping 'tenants: {name: {token, role, salt}}' "
                    "(e.g. 'tenants:' then '  alice: {token: ..., role: tenant}' on the next "
                    "line), got list"),
    ("tenants:", "got NoneType"),
    # where the YAML breaks, not just 'ParserError'; never the line's text (it holds a token)
    ("tenants:\n  a: {token: aaaaaaaaaaaaaaaaaaaa, role: tenant\n  b: x",
     "ParserError at line 3, column 4: expected ',' or '}', but got ':'"),
    # a token no HTTP header line can carry (aiohttp: 8190 bytes) could never authenticate
    (f"tenants:\n  a: {{token: {'a' * 4097}}}", "tenant 'a' needs a token of 16 to 4096"),
    # YAML reads unquoted true/null as a bool/None: the tenant was named (and salted) 'True'
    ("tenants:\n  true: {token: aaaaaaaaaaaaaaaaaaaa}", "tenant name True is not a string"),
    ("tenants:\n  null: {token: aaaaaaaaaaaaaaaaaaaa}", "tenant name None is not a string"),
])
def test_bad_tenants_files_are_clear_errors_that_never_show_a_token(tmp_path, text, msg):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=re.escape(msg)) as e:
        TenantTable.from_file(p)
    assert "aaaaaaaaaaaaaaaa" not in str(e.value) and "0123456789" not in str(e.value)


@pytest.mark.parametrize("name, text, msg", [
    ("t.json", '{"tenants": {"a": {"token": "aaaaaaaaaaaaaaaaaaaa",}}}',
     "JSONDecodeError at line 1, column 52: Expecting property name enclosed in double quotes"),
    ("t.toml", '[tenants.a]\ntoken = aaaaaaaaaaaaaaaaaaaa\n',
     "TOMLDecodeError: Invalid value (at line 2, column 9)"),
])
def test_json_and_toml_tenants_errors_give_their_position(tmp_path, name, text, msg):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        TenantTable.from_file(p)
    assert str(e.value) == f"malformed tenants file {p}: {msg}"


def test_the_longest_token_allowed_authenticates_through_the_server():
    longest = "L" * 4096   # MAX_TOKEN_CHARS: fits aiohttp's 8190-byte header line
    table = TenantTable.from_mapping({"big": {"token": longest, "role": "reader"}})
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 16, page_bytes=256))
    srv = ThreadedServer(create_app(store, ServerLimits(tenants=table)))
    try:
        with KVStoreClient(srv.url, auth_token=longest, timeout_s=10) as client:
            assert ident(client) == {"tenant": "big", "role": "reader", "cache_salt": "big"}
    finally:
        srv.stop()
        store.close()


def test_serve_with_a_missing_tenants_file_exits_2_before_listening(tmp_path, capsys):
    from kvstore.daemon import cli
    assert cli.main(["serve", "--port", "0", "--cpu-bytes", "1MiB",
                     "--tenants-file", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read tenants file" in capsys.readouterr().err


def test_bind_salt_puts_a_clients_salt_under_its_tenants():
    assert bind_salt(None, "") == "" and bind_salt(None, "x") == "x"   # unbound: unchanged
    assert bind_salt("alice", "") == "alice" and bind_salt("alice", "alice") == "alice"
    assert bind_salt("alice", "req-7") == "alice/req-7"
    assert bind_salt("alice", "alice/req-7") == "alice/req-7"
    assert bind_salt("alice", "alicex") == "alice/alicex"
    assert bind_salt("", "") == "" and bind_salt("", "x") == "/x"       # the shared salt ""


# ---- the daemon -----------------------------------------------------------------------------
def test_whoami_names_each_tokens_tenant_role_and_salt(daemon):
    c = daemon.clients
    assert ident(c["alice"]) == {"tenant": "alice", "role": "tenant", "cache_salt": "alice"}
    assert ident(c["dash"]) == {"tenant": "dash", "role": "reader", "cache_salt": "alice"}
    assert ident(c["ops"]) == {"tenant": "ops", "role": "admin", "cache_salt": None}


def test_a_tenants_clear_all_is_403_and_the_other_tenants_chunks_stay(daemon):
    _fill(daemon)
    c = daemon.clients
    assert status_of(c["alice"].clear) == 403           # {"all": true}
    assert c["bob"].exists(NS_B, KB) == [True, True]
    assert c["alice"].exists(NS_A, KA) == [True, True, True]
    assert c["alice"].clear(NS_A) == 3                  # its own namespace: allowed
    assert c["bob"].exists(NS_B, KB) == [True, True]
    assert daemon.store.stats()["tiers"]["cpu"]["num_chunks"] == 2


def test_an_admins_clear_all_removes_every_tenants_chunks(daemon):
    _fill(daemon)
    c = daemon.clients
    assert c["ops"].clear() == 5
    assert c["ops"].exists(NS_A, KA) == [False] * 3 and c["ops"].exists(NS_B, KB) == [False] * 2


def test_naming_another_tenants_salt_is_403_on_every_route_and_changes_nothing(daemon):
    _fill(daemon)
    a = daemon.clients["alice"]
    b_new = NS_B.chunk_keys(list(range(12)))[2]
    calls = {"lookup": lambda: a.lookup_keys(NS_B, KB), "exists": lambda: a.exists(NS_B, KB),
             "get": lambda: a.get_chunks(NS_B, KB),
             "put": lambda: a.put_chunks(NS_B, [b_new], [chunk(99)]),
             "remove": lambda: a.remove(NS_B, KB), "pin": lambda: a.pin(NS_B, KB, 60),
             "unpin": lambda: a.unpin(NS_B, KB), "clear": lambda: a.clear(NS_B)}
    assert {name: status_of(fn) for name, fn in calls.items()} == {name: 403 for name in calls}
    # nor the unsalted namespace, nor a salt that merely starts with alice's
    for salt in ("", "alicex", "bob/alice"):
        other = Namespace("tiny-model", LAYOUT, cache_salt=salt)
        assert status_of(a.lookup_keys, other, other.chunk_keys(list(range(4)))) == 403
    # bob's keys named under alice's own namespace: refused as before (400: not its namespace)
    assert status_of(a.get_chunks, NS_A, KB) == 400
    got = daemon.clients["bob"].get_chunks(NS_B, KB)
    assert all(torch.equal(g, chunk(10 + i)) for i, g in enumerate(got))
    # a get's reader pins are dropped once the server's transport has flushed the answer,
    # which may be just after the client has read it
    deadline = time.monotonic() + 5.0
    while daemon.store.stats()["num_pinned_chunks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    st = daemon.store.stats()
    assert (st["tiers"]["cpu"]["num_chunks"], st["num_pinned_chunks"]) == (5, 0)


def test_a_tenants_own_round_trip_and_sub_salts(daemon):
    a = daemon.clients["alice"]
    kvs = [chunk(i) for i in range(3)]
    assert a.put_chunks(NS_A, KA, kvs) == 3
    assert a.lookup_keys(NS_A, KA).num_hit_chunks == 3
    assert all(torch.equal(g, kv) for g, kv in zip(a.get_chunks(NS_A, KA), kvs))
    assert (a.pin(NS_A, KA[:1], 60), a.unpin(NS_A, KA[:1]), a.remove(NS_A, KA[2:])) == (1, 1, 1)
    sub = Namespace("tiny-model", LAYOUT, cache_salt="alice/req-7")
    ks = sub.chunk_keys(list(range(4)))
    assert a.put_chunks(sub, ks, [chunk(7)]) == 1
    assert torch.equal(a.get_chunks(sub, ks)[0], chunk(7))
    assert status_of(daemon.clients["bob"].get_chunks, sub, ks) == 403


def test_a_reader_reads_its_salt_and_cannot_write(daemon):
    _fill(daemon)
    d = daemon.clients["dash"]
    assert d.lookup_keys(NS_A, KA).num_hit_chunks == 3
    assert all(torch.equal(g, chunk(i)) for i, g in enumerate(d.get_chunks(NS_A, KA)))
    writes = {"put": lambda: d.put_chunks(NS_A, KA[:1], [chunk(50)]),
              "remove": lambda: d.remove(NS_A, KA), "pin": lambda: d.pin(NS_A, KA, 60),
              "unpin": lambda: d.unpin(NS_A, KA), "clear": lambda: d.clear(NS_A)}
    assert {n: status_of(fn) for n, fn in writes.items()} == {n: 403 for n in writes}
    assert status_of(d.get_chunks, NS_B, KB) == 403
    assert daemon.clients["alice"].exists(NS_A, KA) == [True] * 3
    assert torch.equal(d.get_chunks(NS_A, KA[:1])[0], chunk(0))  # the put changed nothing


def test_a_token_not_in_the_file_is_401(daemon):
    with KVStoreClient(daemon.url, auth_token="not-a-tenant-token-0123", timeout_s=10) as c:
        assert status_of(c.lookup_keys, NS_A, KA) == 401
        assert status_of(c.whoami) == 401
        assert status_of(c.clear) == 401
    with KVStoreClient(daemon.url, timeout_s=10) as c:  # no token at all
        assert status_of(c.exists, NS_A, KA) == 401
        assert c.healthy()  # /healthz needs none
    # a non-ASCII byte in the header: 401, not 500
    with socket.create_connection((daemon.host, daemon.port), timeout=10) as s:
        s.sendall(b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe"
                  b"token-0123456789\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk_ := s.recv(65536):
            answer += chunk_
    assert answer.startswith(b"HTTP/1.1 401")


def test_stats_and_metrics_need_an_admin(daemon):
    _fill(daemon)
    c = daemon.clients
    assert status_of(c["alice"].stats) == 403 and status_of(c["dash"].metrics_text) == 403
    assert c["ops"].stats()["tiers"]["cpu"]["num_chunks"] == 5
    assert "kvstore_server_requests_total" in c["ops"].metrics_text()


@pytest.mark.parametrize("token", ["caf\u00e9-token", " padded", "padded ", "tab\there",
                                   "L" * 4097])
def test_an_auth_token_no_client_could_send_is_refused_at_start(token):
    # each started a daemon that answered every request 401 (a non-ASCII header matches no
    # token; authenticate strips spaces; aiohttp refuses a header line over 8190 bytes)
    with pytest.raises(ValueError) as e:
        TenantTable.single(token)
    assert str(e.value) == ("--auth-token must be 1 to 4096 printable ASCII characters without "
                            "leading or trailing spaces: no client could send this one")
    assert TenantTable.single("a b").authenticate("Bearer a b").name == "admin"
    assert TenantTable.single("L" * 4096).authenticate("Bearer " + "L" * 4096).name == "admin"


def test_the_single_auth_token_is_one_admin_and_may_join_a_tenants_file(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256))
    with ThreadedServer(create_app(store, ServerLimits(auth_token="tok"))) as srv, \
            KVStoreClient(srv.url, auth_token="tok", timeout_s=10) as c:
        assert ident(c) == {"tenant": "admin", "role": "admin", "cache_salt": None}
        assert c.put_chunks(NS_A, KA, [chunk(i) for i in range(3)]) == 3
        assert c.put_chunks(NS_B, KB, [chunk(i) for i in range(2)]) == 2
        assert c.clear() == 5
    table = TenantTable.from_mapping({"alice": {"token": TOKENS["alice"]}})
    limits = ServerLimits(auth_token="tok", tenants=table)
    with ThreadedServer(create_app(store, limits)) as srv, \
            KVStoreClient(srv.url, auth_token="tok", timeout_s=10) as admin, \
            KVStoreClient(srv.url, auth_token=TOKENS["alice"], timeout_s=10) as a:
        assert a.put_chunks(NS_A, KA, [chunk(i) for i in range(3)]) == 3
        assert status_of(a.clear) == 403 and admin.clear() == 3
    with pytest.raises(ValueError, match="two tenants share a token"):
        create_app(store, ServerLimits(auth_token=TOKENS["alice"], tenants=table))
    store.close()


# ---- connectors -----------------------------------------------------------------------------
def test_engine_connector_with_a_tenant_token_hits_its_own_chunks_only(daemon):
    """engine_min's connector through the factory, on engine_min's real scheduler and block
    manager with a stand-in forward pass (``tests.connectors.fake_engine.FakeEngine``)."""
    from tests.connectors.fake_engine import FakeEngine, kv_value, prompt

    def run(token, toks):
        conn = create_connector(url=daemon.url, auth_token=token, chunk_size=8, deadline_s=5.0)
        eng = FakeEngine(conn)
        seq = eng.add("r", toks)
        eng.run()
        assert conn.wait_for_save(10)
        return conn, eng, seq

    toks = prompt(36)  # 4 full chunks of 8 tokens + 4 (tail pieces of one block, the default)
    conn, _, seq = run(TOKENS["alice"], toks)
    assert conn.ns.cache_salt == "alice" and seq.num_cached_tokens == 0
    assert conn.get_stats()["kvstore_saved_chunks"] == 4
    conn.close()
    conn, eng, seq = run(TOKENS["alice"], toks)  # a second engine of alice: hits
    hit = 36 - 1  # the whole prompt but its last token (always computed)
    assert seq.num_cached_tokens == hit and eng.computed_tokens == 36 - hit
    assert torch.equal(eng.seq_kv(seq, 0, hit), kv_value(toks, 0, hit))
    conn.close()
    conn, eng, seq = run(TOKENS["bob"], toks)    # bob: same tokens, own salt, no hit, no error
    st = conn.get_stats()
    assert conn.ns.cache_salt == "bob" and seq.num_cached_tokens == 0
    assert (st["kvstore_lookup_fallbacks"], st["kvstore_saved_chunks"]) == (0, 4)
    conn.close()
    conn, _, seq = run(TOKENS["dash"], toks)     # alice's reader: reads alice's chunks
    assert conn.ns.cache_salt == "alice" and seq.num_cached_tokens == hit
    assert conn.get_stats()["kvstore_saved_chunks"] == 0  # its saves are refused (403)
    conn.close()
    # 4 chunks + 1 tail piece (4 tokens, one block) of alice, and as many of bob
    assert daemon.store.stats()["tiers"]["cpu"]["num_chunks"] == 10
    conn, _, seq = run("not-a-tenant-token-0123", toks)  # unknown: recomputes, never fails
    assert seq.is_finished and seq.num_cached_tokens == 0
    conn.close()


def test_kvstore_serve_reads_the_tenants_file_and_never_logs_a_token(tmp_path):
    """The real command: ``kvstore serve --auth-token T --tenants-file F`` (T is one more admin)."""
    from tests.kvstore.daemon.test_cli import Daemon
    f = tmp_path / "tenants.yaml"
    f.write_text(TENANTS_YAML)
    d = Daemon(tmp_path / "log", "--cpu-bytes", "1MiB", "--tenants-file", str(f))
    try:
        with KVStoreClient(d.url, auth_token=TOKENS["alice"], timeout_s=10) as a, \
                KVStoreClient(d.url, auth_token="wrong-token-0123456789", timeout_s=10) as w, \
                d.client(timeout_s=10) as admin:
            assert ident(a) == {"tenant": "alice", "role": "tenant", "cache_salt": "alice"}
            assert a.put_chunks(NS_A, KA, [chunk(i) for i in range(3)]) == 3
            assert status_of(a.clear) == 403 and status_of(a.get_chunks, NS_B, KB) == 403
            assert status_of(w.whoami) == 401
            assert ident(admin) == {"tenant": "admin", "role": "admin", "cache_salt": None}
            assert admin.clear() == 3
    finally:
        assert d.stop() == 0
    log = (tmp_path / "log").read_text()
    assert "stopped" in log  # the info-level log of the whole run
    assert all(t not in log for t in TOKENS.values()) and "wrong-token" not in log
