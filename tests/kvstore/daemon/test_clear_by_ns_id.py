"""Namespaces a restarted daemon knows from its disk tier only (their ids in the disk keys, not
their fields): ``kvstore stats`` says so, and ``kvstore clear --namespace-id`` clears them,
only with an admin token unless a request of their own tenant named them since the restart.
Real ``kvstore serve`` processes over a real disk tier, restarted."""
import json

import pytest

from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient
from tests.kvstore.daemon.test_cli import TOKEN as ADMIN, Daemon
from tests.kvstore.daemon.test_daemon_tenants import KA, KB, NS_A, NS_B, TOKENS, chunk

TENANTS_YAML = f"""
tenants:
  alice: {{token: "{TOKENS['alice']}", role: tenant}}
  bob:   {{token: "{TOKENS['bob']}", role: tenant}}
  dash:  {{token: "{TOKENS['dash']}", role: reader, salt: alice}}
"""


def _serve_args(tmp_path) -> list[str]:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    return ["--cpu-bytes", "1MiB", "--disk-path", str(tmp_path / "disk"), "--disk-bytes",
            "64MiB", "--tenants-file", str(tenants)]


def _stats(url: str, capsys) -> dict:
    assert cli.main(["stats", url, "--auth-token", ADMIN, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _held(url: str, capsys) -> dict[str, tuple[int, object]]:
    """ns_id hex -> (num_chunks, namespace fields or None) as /v1/stats lists them."""
    return {n["ns_id"]: (n["num_chunks"], n["namespace"])
            for n in _stats(url, capsys)["namespaces"]}


def _clear(url: str, token: str, ns_id: bytes, capsys) -> tuple[int, str, str]:
    rc = cli.main(["clear", url, "--auth-token", token, "--namespace-id", ns_id.hex()])
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err.strip()


def test_after_a_restart_disk_only_namespaces_are_shown_and_cleared_by_id(tmp_path, capsys):
    d1 = Daemon(tmp_path / "log1", *_serve_args(tmp_path))
    try:
        with KVStoreClient(d1.url, auth_token=TOKENS["alice"]) as alice:
            assert alice.put_chunks(NS_A, KA, [chunk(i) for i in range(3)], durable=True) == 3
        with KVStoreClient(d1.url, auth_token=TOKENS["bob"]) as bob:
            assert bob.put_chunks(NS_B, KB, [chunk(10 + i) for i in range(2)], durable=True) == 2
        assert _held(d1.url, capsys) == {NS_A.ns_id.hex(): (3, NS_A.to_dict()),
                                         NS_B.ns_id.hex(): (2, NS_B.to_dict())}
    finally:
        assert d1.stop() == 0
    d = Daemon(tmp_path / "log2", *_serve_args(tmp_path))  # the same disk tier
    try:
        a, b = NS_A.ns_id, NS_B.ns_id
        # known from the disk keys only: ids and counts, no fields
        assert _held(d.url, capsys) == {a.hex(): (3, None), b.hex(): (2, None)}
        assert cli.main(["stats", d.url, "--auth-token", ADMIN]) == 0
        rows = [r.split(None, 1) for r in capsys.readouterr().out.splitlines()]
        shown = [v for k, v in rows if k.startswith("namespaces[") and k.endswith("].namespace")]
        assert sorted(shown) == sorted(
            f"(fields unknown: no request named it lately; clear: --namespace-id {x.hex()})"
            for x in (a, b))
        # no tenant can be told from an id alone: tenants are refused, even its own
        for token in (TOKENS["alice"], TOKENS["bob"], TOKENS["dash"]):
            rc, out, err = _clear(d.url, token, a, capsys)
            assert (rc, out) == (1, ""), err
            assert "403" in err and "needs an admin token" in err
        assert _held(d.url, capsys)[a.hex()] == (3, None)  # nothing removed
        # once alice names her namespace (fields and salt known), she may clear it by id,
        # bob still may not, and a reader of her salt may not write
        with KVStoreClient(d.url, auth_token=TOKENS["alice"]) as alice:
            assert alice.exists(NS_A, KA) == [True] * 3
        assert _held(d.url, capsys)[a.hex()] == (3, NS_A.to_dict())
        for token in (TOKENS["bob"], TOKENS["dash"]):
            rc, _, err = _clear(d.url, token, a, capsys)
            assert rc == 1 and "403" in err, err
        assert _clear(d.url, TOKENS["alice"], a, capsys)[:2] == (0, "removed 3 chunks")
        # bob's namespace, still unattributed: the admin token clears it
        assert _clear(d.url, TOKENS["bob"], b, capsys)[0] == 1
        assert _clear(d.url, ADMIN, b, capsys)[:2] == (0, "removed 2 chunks")
        st = _stats(d.url, capsys)
        assert (st["namespaces"], st["tiers"]["disk"]["num_chunks"]) == ([], 0)
        assert _clear(d.url, ADMIN, b, capsys)[:2] == (0, "removed 0 chunks")
    finally:
        assert d.stop() == 0
    d3 = Daemon(tmp_path / "log3", *_serve_args(tmp_path))  # the removals reached the disk
    try:
        assert _held(d3.url, capsys) == {}
    finally:
        assert d3.stop() == 0


@pytest.mark.parametrize("bad", ["zz" * 16, "ab" * 15, "ab" * 17, 12, None])
def test_a_malformed_namespace_id_is_a_400_naming_the_field(bad):
    from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
    from tests.kvstore.daemon.server_helpers import make_store, post_json
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits()))
    try:
        status, body = post_json(srv, "/v1/clear", {"ns_id": bad}, auth=False)
        assert status == 400 and body["error"].startswith(
            '"ns_id" must be a namespace id of 32 hex digits (as /v1/stats lists it), got ')
    finally:
        srv.stop()
        store.close()


def test_the_store_clears_one_namespace_by_its_id_alone(tmp_path):
    from tests.kvstore.daemon.server_helpers import make_store
    store = make_store(str(tmp_path / "disk"))
    try:
        store.put_chunks(NS_A, KA, [chunk(i) for i in range(3)])
        store.put_chunks(NS_B, KB, [chunk(10 + i) for i in range(2)])
        assert store.clear_namespace_id(NS_A.ns_id) == 3
        assert store.exists(NS_A, KA) == [False] * 3 and store.exists(NS_B, KB) == [True] * 2
        with pytest.raises(ValueError, match="a namespace id is 16 bytes"):
            store.clear_namespace_id(NS_B.ns_id.hex())
    finally:
        store.close()
