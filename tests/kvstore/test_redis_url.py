"""``parse_redis_url``: the remote tier's address (standalone, cluster nodes, credentials, TLS,
database), its redacted forms, and ``StoreConfig`` keeping a URL's password out of sight."""
import re

import pytest

from kvstore.config import StoreConfig
from kvstore.tiers.redis_url import PASSWORD_ENV, RedisEndpoint, parse_redis_url

NO_ENV: dict = {}


def test_standalone_address_with_and_without_port():
    assert parse_redis_url("redis://cache.local:7000", env=NO_ENV) == RedisEndpoint(
        (("cache.local", 7000),), "", None, False, 0)
    assert parse_redis_url("redis://cache.local", env=NO_ENV).nodes == (("cache.local", 6379),)
    assert parse_redis_url("redis://[::1]:7001", env=NO_ENV).nodes == (("::1", 7001),)


def test_several_nodes_are_cluster_startup_nodes_in_order():
    ep = parse_redis_url("redis://a:7000, b:7001,c:7002,", env=NO_ENV)
    assert ep.nodes == (("a", 7000), ("b", 7001), ("c", 7002))
    assert ep.db == 0 and ep.password is None


def test_user_and_password_are_url_decoded():
    ep = parse_redis_url("redis://alice:p%40ss%3Aw0rd@h:7000", env=NO_ENV)
    assert (ep.username, ep.password, ep.nodes) == ("alice", "p@ss:w0rd", (("h", 7000),))
    ep = parse_redis_url("redis://:only-pw@h:7000", env=NO_ENV)
    assert (ep.username, ep.password) == ("", "only-pw")
    ep = parse_redis_url("redis://bob@h:7000", env=NO_ENV)
    assert (ep.username, ep.password) == ("bob", None)


def test_rediss_means_tls_and_db_is_parsed():
    ep = parse_redis_url("rediss://h:6380/3", env=NO_ENV)
    assert (ep.tls, ep.db, ep.nodes) == (True, 3, (("h", 6380),))
    assert parse_redis_url("redis://h:6380/", env=NO_ENV).db == 0


def test_password_precedence_url_then_argument_then_environment():
    env = {PASSWORD_ENV: "from-env"}
    assert parse_redis_url("redis://h:1", env=env).password == "from-env"
    assert parse_redis_url("redis://h:1", password="from-arg", env=env).password == "from-arg"
    assert parse_redis_url("redis://:from-url@h:1", password="from-arg",
                           env=env).password == "from-url"
    assert parse_redis_url("redis://h:1", env={PASSWORD_ENV: ""}).password is None


def test_environment_password_is_read_from_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "os-env-pw")
    assert parse_redis_url("redis://h:1").password == "os-env-pw"


@pytest.mark.parametrize("url, words", [
    ("http://:hunter2pw@h:1", "scheme"),
    ("hunter2pw@h:1", "must look like"),
    ("redis://:hunter2pw@", "no host"),
    ("redis://:hunter2pw@h:port", "port must be a number"),
    ("redis://:hunter2pw@h:0", "is not host:port"),
    ("redis://:hunter2pw@h:65536", "is not host:port"),
    ("redis://:hunter2pw@:7000", "is not host:port"),
    ("redis://:hunter2pw@a:1,b:2/1", "only database 0"),
    ("redis://:hunter2pw@h:1/x", "database must be a number"),
    ("redis://:hunter2pw@h:1/-2", "database must be >= 0"),
])
def test_bad_urls_raise_value_error_without_the_password(url, words):
    with pytest.raises(ValueError) as e:
        parse_redis_url(url, env=NO_ENV)
    assert words in str(e.value)
    assert "hunter2pw" not in str(e.value)


def test_non_string_url_is_a_value_error():
    with pytest.raises(ValueError, match="must look like"):
        parse_redis_url(None, env=NO_ENV)  # type: ignore[arg-type]


def test_redacted_forms_never_show_the_password():
    ep = parse_redis_url("rediss://alice:s3cr3t@a:1,b:2", env=NO_ENV)
    assert ep.redacted() == "rediss://alice:***@a:1,b:2"
    assert str(ep) == ep.redacted()
    assert ep.without_password() == "rediss://alice@a:1,b:2"
    assert "s3cr3t" not in repr(ep) and "s3cr3t" not in str(ep)
    ep = parse_redis_url("redis://:s3cr3t@h:1/2", env=NO_ENV)
    assert (ep.redacted(), ep.without_password()) == ("redis://:***@h:1/2", "redis://h:1/2")
    assert parse_redis_url("redis://h:1", env=NO_ENV).redacted() == "redis://h:1"
    env_ep = parse_redis_url("redis://h:1", env={PASSWORD_ENV: "s3cr3t"})
    assert env_ep.redacted() == "redis://:***@h:1" and "s3cr3t" not in repr(env_ep)


# ---- StoreConfig -------------------------------------------------------------------------------
def test_store_config_moves_the_url_password_out_of_the_url(monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    cfg = StoreConfig(remote_url="redis://alice:s3cr3t@h:7000,h:7001")
    assert cfg.remote_url == "redis://alice@h:7000,h:7001"
    assert cfg.remote_password == "s3cr3t"
    assert "s3cr3t" not in repr(cfg)
    d = cfg.to_dict()
    assert d["remote_password"] == "***" and d["remote_url"] == "redis://alice@h:7000,h:7001"
    assert "s3cr3t" not in repr(d)
    # the stripped URL plus the moved password is the same endpoint
    ep = parse_redis_url(cfg.remote_url, cfg.remote_password, env=NO_ENV)
    assert (ep.username, ep.password, ep.nodes) == ("alice", "s3cr3t", (("h", 7000), ("h", 7001)))


def test_store_config_explicit_password_is_kept_and_hidden():
    cfg = StoreConfig(remote_url="redis://:from-url@h:1", remote_password="explicit")
    assert (cfg.remote_url, cfg.remote_password) == ("redis://h:1", "explicit")
    cfg = StoreConfig(remote_url="redis://h:1", remote_password="explicit")
    assert "explicit" not in repr(cfg) and cfg.to_dict()["remote_password"] == "***"
    assert StoreConfig(remote_url="redis://h:1").to_dict()["remote_password"] is None


def test_store_config_remote_defaults_and_validation():
    cfg = StoreConfig(remote_url="redis://h:1")
    assert (cfg.remote_key_prefix, cfg.remote_ttl_s, cfg.remote_timeout_s,
            cfg.remote_queue_bytes, cfg.remote_codec) == ("kvstore", 0.0, 0.25, 256 << 20, "raw")
    with pytest.raises(ValueError, match="scheme") as e:
        StoreConfig(remote_url="http://:s3cr3t@h:1")
    assert "s3cr3t" not in str(e.value)
    for bad in (dict(remote_ttl_s=-1), dict(remote_timeout_s=0),
                dict(remote_timeout_s=float("inf"))):
        with pytest.raises(ValueError, match="remote_ttl_s must be >= 0"):
            StoreConfig(remote_url="redis://h:1", **bad)
    with pytest.raises(ValueError, match="remote_queue_bytes must be > 0"):
        StoreConfig(remote_url="redis://h:1", remote_queue_bytes=0)
    with pytest.raises(ValueError, match="unknown remote_codec"):
        StoreConfig(remote_url="redis://h:1", remote_codec="zstd")
    assert StoreConfig(remote_url="redis://h:1", remote_queue_bytes="1MiB").remote_queue_bytes \
        == 1 << 20


def test_ipv6_nodes_need_brackets_and_print_with_them():
    ep = parse_redis_url("redis://u:pw@[::1],[fe80::2]:7001", env={})
    assert ep.nodes == (("::1", 6379), ("fe80::2", 7001))
    assert ep.redacted() == "redis://u:***@[::1]:6379,[fe80::2]:7001"
    assert ep.without_password() == "redis://u@[::1]:6379,[fe80::2]:7001"
    assert parse_redis_url(ep.without_password(), env={}).nodes == ep.nodes
    for bad in ("redis://::1", "redis://[::1", "redis://[::1]x"):
        with pytest.raises(ValueError, match=r"\[addr\]:port"):
            parse_redis_url(bad, env={})


def test_credentials_per_node_are_refused_not_folded_into_a_password():
    with pytest.raises(ValueError, match="one user:password@") as e:
        parse_redis_url("redis://:pw1@h:1,:pw2@h:2", env={})
    assert "pw1" not in str(e.value) and "pw2" not in str(e.value)
    assert parse_redis_url("redis://:p%40ss@h:1,h:2", env={}).password == "p@ss"


def test_store_config_refuses_an_infinite_ttl_and_a_bad_prefix():
    for bad in (dict(remote_ttl_s=float("inf")), dict(remote_key_prefix="a b"),
                dict(remote_key_prefix="a:b"), dict(remote_key_prefix="")):
        with pytest.raises(ValueError, match="remote_ttl_s|remote_key_prefix"):
            StoreConfig(remote_url="redis://h:1", **bad)


def test_tls_parameters_are_checked_and_kept_in_the_redacted_forms(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    key, cert = tmp_path / "c.key", tmp_path / "c.crt"
    key.write_text("x")
    cert.write_text("x")
    ep = parse_redis_url(f"rediss://u:pw@h:1?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    assert ep.tls and ep.tls_options == (("ssl_ca_certs", str(ca)), ("ssl_cert_reqs", "required"))
    assert ep.ssl_kwargs() == {"ssl": True, "ssl_ca_certs": str(ca), "ssl_cert_reqs": "required"}
    assert ep.redacted() == f"rediss://u:***@h:1?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    assert ep.without_password() == f"rediss://u@h:1?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    assert parse_redis_url(ep.without_password()).tls_options == ep.tls_options
    ep = parse_redis_url(f"rediss://h:1,h:2?ssl_certfile={cert}&ssl_keyfile={key}")
    assert len(ep.nodes) == 2 and dict(ep.tls_options) == {"ssl_certfile": str(cert),
                                                           "ssl_keyfile": str(key)}
    assert parse_redis_url("redis://h:1").ssl_kwargs() == {"ssl": False}
    for url, words in [
            (f"redis://h:1?ssl_ca_certs={ca}", "need rediss://"),
            ("rediss://h:1?foo=1", "unknown parameter 'foo'"),
            ("rediss://h:1?ssl_ca_certs=/no/such/ca.crt", "file '/no/such/ca.crt' not found"),
            (f"rediss://h:1?ssl_certfile={cert}", "go together"),
            ("rediss://h:1?ssl_cert_reqs=maybe", "must be one of required, optional, none"),
            (f"rediss://h:1?ssl_ca_certs={ca}&ssl_ca_certs={ca}", "given twice"),
            ("rediss://:secret@h:1?x", "cannot parse the query")]:
        with pytest.raises(ValueError, match=re.escape(words)) as e:
            parse_redis_url(url)
        assert "secret" not in str(e.value)
