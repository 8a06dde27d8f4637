"""The remote tier through an engine's ``--kvstore-remote-*`` flags: flags -> ``StoreSpec`` ->
the in-process ``ChunkStore`` with a remote tier on a real Redis (CPU only, no model)."""
from __future__ import annotations

import argparse

import pytest

from bench.redis_servers import RedisServer
from connectors.engine_min import EngineMinConnector
from connectors.flags import (STORE_FLAGS, StoreFlagError, add_store_args, connector_from_args,
                              remote_options)
from connectors.stores import DEFAULT_CPU_BYTES, StoreSpec, open_store
from kvstore.store import ChunkStore
from kvstore.units import parse_size
from tests.kvstore.remote_helpers import CB, LAY, NS, prompt, rkey, same
from tests.redis_fixtures import redis_server, require_redis  # noqa: F401

PASSWORD = "pw-41d7e2-not-for-logs"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    return parser.parse_args(list(argv))


# ---- flags -> StoreSpec fields (no Redis needed) -------------------------------------------------
def test_remote_flags_become_store_spec_fields():
    args = parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-remote-url", "redis://h1:7000,h2:7000",
                 "--kvstore-remote-key-prefix", "prod", "--kvstore-remote-ttl-s", "3600",
                 "--kvstore-remote-timeout-s", "0.1")
    assert remote_options(args) == {"remote_url": "redis://h1:7000,h2:7000",
                                    "remote_key_prefix": "prod", "remote_ttl_s": 3600.0,
                                    "remote_timeout_s": 0.1}
    assert remote_options(parse("--kvstore-cpu-bytes", "8MiB")) == {}
    assert "kvstore_remote_url" in STORE_FLAGS
    assert parse().kvstore_remote_url is None
    # defaults are the store's
    cfg = StoreSpec(cpu_bytes="8MiB", remote_url="redis://h:1").store_config()
    assert (cfg.remote_url, cfg.remote_key_prefix, cfg.remote_ttl_s, cfg.remote_timeout_s,
            cfg.cpu_bytes) == ("redis://h:1", "kvstore", 0.0, 0.25, 8 << 20)


def test_a_remote_url_alone_brings_the_default_cpu_tier():
    spec = StoreSpec(remote_url="redis://h:1")
    spec.check()
    assert spec.local
    cfg = spec.store_config()
    assert (cfg.cpu_bytes, cfg.disk_bytes, cfg.tiers) == (parse_size(DEFAULT_CPU_BYTES), 0,
                                                          ("cpu",))
    assert cfg.cpu_bytes == 1 << 30
    # with a disk tier given, no CPU tier is added
    cfg = StoreSpec(disk_path="/tmp/x", remote_url="redis://h:1").store_config()
    assert cfg.tiers == ("disk",) and cfg.remote_url == "redis://h:1"


def test_a_url_password_leaves_the_url_and_never_shows():
    spec = StoreSpec(cpu_bytes="1MiB", remote_url=f"redis://app:{PASSWORD}@h:7000")
    assert spec.remote_url == "redis://app@h:7000"
    assert spec.remote_password == PASSWORD
    assert PASSWORD not in repr(spec)
    cfg = spec.store_config()
    assert cfg.remote_password == PASSWORD and PASSWORD not in repr(cfg)
    assert spec == StoreSpec(cpu_bytes="1MiB", remote_url=f"redis://app:{PASSWORD}@h:7000")
    assert spec != StoreSpec(cpu_bytes="1MiB", remote_url="redis://app:other@h:7000")


@pytest.mark.parametrize("argv, msg", [
    (("--kvstore-url", "http://127.0.0.1:8500", "--kvstore-remote-url", "redis://h:1"),
     "start the daemon with kvstore serve --remote-url instead"),
    (("--kvstore-cpu-bytes", "1MiB", "--kvstore-remote-ttl-s", "60"),
     "--kvstore-remote-ttl-s needs --kvstore-remote-url"),
    (("--kvstore-remote-key-prefix", "p", "--kvstore-remote-timeout-s", "1"),
     "--kvstore-remote-key-prefix, --kvstore-remote-timeout-s needs --kvstore-remote-url"),
    (("--kvstore-remote-url", f"http://:{PASSWORD}@h:1"),
     "--kvstore-remote-url: remote URL scheme must be redis:// or rediss://"),
    (("--kvstore-remote-url", f"redis://:{PASSWORD}@h:port"),
     "--kvstore-remote-url: remote URL port must be a number"),
    (("--kvstore-remote-url", "redis://h:1", "--kvstore-remote-ttl-s", "-1"),
     "--kvstore-remote-ttl-s must be >= 0"),
    (("--kvstore-remote-url", "redis://h:1", "--kvstore-remote-timeout-s", "0"),
     "--kvstore-remote-timeout-s a positive number"),
])
def test_bad_remote_flags_are_refused_before_any_store_opens(argv, msg):
    with pytest.raises(StoreFlagError) as e:
        connector_from_args(parse(*argv))
    assert msg in str(e.value)
    assert PASSWORD not in str(e.value)


def test_the_engine_server_exits_on_bad_remote_flags_before_the_model_loads():
    from engine_min.serve.cli import build_connector
    with pytest.raises(SystemExit) as e:  # build_connector runs before build_engine
        build_connector(parse("--kvstore-url", "http://127.0.0.1:1",
                              "--kvstore-remote-url", "redis://h:1"))
    assert "kvstore serve --remote-url" in str(e.value)


def test_a_daemon_with_local_tiers_may_also_have_a_remote_tier_spec():
    spec = StoreSpec(cpu_bytes="1MiB", url="http://127.0.0.1:1", remote_url="redis://h:1")
    spec.check()  # the in-process tiers (with their remote tier) in front of the daemon
    with pytest.raises(ValueError, match="kvstore serve --remote-url"):
        StoreSpec(url="http://127.0.0.1:1", remote_url="redis://h:1").check()


# ---- on a real Redis ---------------------------------------------------------------------------
def test_two_in_process_stores_share_chunks_through_redis(redis_server):  # noqa: F811
    url = redis_server.url
    spec = dict(cpu_bytes=64 * CB, remote_url=url, remote_key_prefix="eng", remote_ttl_s=300)
    a = open_store(StoreSpec(name="a", **spec)).store
    b = open_store(StoreSpec(name="b", **spec)).store
    try:
        assert isinstance(a, ChunkStore) and a.remote is not None
        assert (a.remote.key_prefix, a.remote.ttl_s, a.remote.timeout_s) == ("eng", 300.0, 0.25)
        for s in (a, b):
            s.register(NS)
        keys, kvs = prompt(NS, 0, 4)
        assert a.put_chunks(NS, keys, kvs) == 4
        assert a.flush(5.0)
        with redis_server.client() as r:
            assert sorted(r.keys(b"*")) == sorted(rkey(k, "eng") for k in keys)
            assert 290 <= r.ttl(rkey(keys[0], "eng")) <= 300
        found = b.lookup_keys(NS, keys)
        assert (found.num_hit_chunks, found.tiers) == (4, ("remote",) * 4)
        assert same(b.get_chunks(NS, keys), kvs)
        assert b.lookup_keys(NS, keys).tiers == ("cpu",) * 4  # promoted
    finally:
        a.close()
        b.close()


def test_connector_from_flags_alone_opens_a_cpu_tier_over_redis(redis_server):  # noqa: F811
    c = connector_from_args(parse("--kvstore-remote-url", redis_server.url,
                                  "--kvstore-remote-timeout-s", "0.5",
                                  "--kvstore-chunk-size", str(LAY.chunk_size)))
    try:
        assert isinstance(c, EngineMinConnector)
        st = c.store
        assert isinstance(st, ChunkStore)
        assert [t.name for t in st.tiers] == ["cpu"]
        assert st.tiers[0].capacity_bytes == 1 << 30
        assert st.remote.timeout_s == 0.5 and st.remote.key_prefix == "kvstore"
    finally:
        c.close()


@pytest.fixture
def redis_with_password(tmp_path):
    require_redis()
    with RedisServer(tmp_path / "redis", password=PASSWORD) as srv:
        yield srv


def test_a_refused_password_stops_the_engine_server_at_start(redis_with_password, monkeypatch):
    from engine_min.serve.cli import build_connector
    port = redis_with_password.port
    monkeypatch.setenv("KVSTORE_REMOTE_PASSWORD", "wrong-" + PASSWORD)
    with pytest.raises(SystemExit) as e:
        build_connector(parse("--kvstore-cpu-bytes", "1MiB",
                              "--kvstore-remote-url", f"redis://127.0.0.1:{port}"))
    assert f"Redis at 127.0.0.1:{port} refused the credentials (AUTH failed)" in str(e.value)
    assert PASSWORD not in str(e.value)
    # the right one from the environment opens it
    monkeypatch.setenv("KVSTORE_REMOTE_PASSWORD", PASSWORD)
    c = build_connector(parse("--kvstore-cpu-bytes", "1MiB",
                              "--kvstore-remote-url", f"redis://127.0.0.1:{port}"))
    try:
        assert c.store.remote.endpoint.password == PASSWORD
    finally:
        c.close()
