"""The remote tier over TLS (``rediss://``) against a real ``redis-server`` that speaks TLS
only, with test certificates from a private CA given as ``?ssl_ca_certs=``: chunks shared
bit-exact; a server certificate the client cannot verify, a plain ``redis://`` to the TLS
port and a missing client certificate (``tls-auth-clients yes``) each fail at start with a
clear error."""
import pytest

from bench.redis_servers import RedisServer
from kvstore.tiers.redis_nodes import RemoteConfigError
from tests.kvstore.remote_helpers import NS, count, make_store, prompt, rkey, same
from tests.redis_fixtures import make_tls_files, require_redis, tls_redis_server  # noqa: F401


def test_two_stores_share_chunks_over_tls_bit_exact(tls_redis_server):
    url = tls_redis_server.url
    assert url.startswith("rediss://") and "?ssl_ca_certs=" in url
    a, b = make_store(url), make_store(url)
    try:
        keys, kvs = prompt(NS, 0, 4)
        assert a.put_chunks(NS, keys, kvs) == 4 and a.flush(5.0)
        assert count(a.remote, "writes") == 4
        with tls_redis_server.client() as r:
            assert r.dbsize() == 4 and all(r.exists(rkey(k)) for k in keys)
        assert same(b.get_chunks(NS, keys), kvs)
        assert count(b.remote, "hits") == 4
        stats = a.remote.stats()
        assert stats["url"] == url  # the CA file is part of the address, no secret
    finally:
        a.close()
        b.close()


def test_a_certificate_the_client_cannot_verify_fails_at_start(tls_redis_server):
    files = tls_redis_server.tls_files
    port = tls_redis_server.port
    for url in (f"rediss://127.0.0.1:{port}",  # the system's CAs do not know the test CA
                f"rediss://127.0.0.1:{port}?ssl_ca_certs={files['other_ca']}"):
        with pytest.raises(RemoteConfigError, match=r"cannot reach Redis at rediss://.*"
                                                    r"certificate verify failed"):
            make_store(url)
    # without verification it connects (the operator's choice, said in the URL)
    s = make_store(f"rediss://127.0.0.1:{port}?ssl_cert_reqs=none")
    s.close()
    with pytest.raises(RemoteConfigError, match=r"cannot reach Redis at redis://127\.0\.0\.1"):
        make_store(f"redis://127.0.0.1:{port}")  # plain text to a TLS-only port


def test_a_client_certificate_when_the_server_asks_for_one(tmp_path):
    require_redis()
    files = make_tls_files(tmp_path / "tls")
    with RedisServer(tmp_path, tls=(files["cert"], files["key"], files["ca"]),
                     extra_args=("--tls-auth-clients", "yes")) as srv:
        with pytest.raises(RemoteConfigError, match="cannot reach Redis"):
            make_store(srv.url)  # no client certificate: the handshake is refused
        url = f"{srv.url}&ssl_certfile={files['client_cert']}&ssl_keyfile={files['client_key']}"
        s = make_store(url)
        try:
            keys, kvs = prompt(NS, 1, 2)
            assert s.put_chunks(NS, keys, kvs) == 2 and s.flush(5.0)
            assert count(s.remote, "writes") == 2
        finally:
            s.close()


def test_a_tls_cluster_shares_chunks_across_its_masters(tmp_path):
    from bench.redis_cluster import RedisClusterGroup
    require_redis()
    files = make_tls_files(tmp_path / "tls")
    with RedisClusterGroup(tmp_path, masters=3,
                           tls=(files["cert"], files["key"], files["ca"])) as grp:
        assert grp.url.startswith("rediss://") and grp.url.count(",") == 2
        a, b = make_store(grp.url), make_store(grp.url)
        try:
            assert a.remote.nodes.cluster
            keys, kvs = prompt(NS, 2, 12)
            assert a.put_chunks(NS, keys, kvs) == 12 and a.flush(10.0)
            owners = {grp.node_for_key(rkey(k)) for k in keys}
            assert owners == {0, 1, 2}  # every master holds some
            for i, node in enumerate(grp.nodes):
                with node.client() as r:
                    assert r.dbsize() == sum(grp.node_for_key(rkey(k)) == i for k in keys)
            assert same(b.get_chunks(NS, keys), kvs)
        finally:
            a.close()
            b.close()
