"""The vLLM connector's remote tier keys in ``kv_connector_extra_config`` (``remote_url``,
``remote_key_prefix``, ``remote_ttl_s``, ``remote_timeout_s``) -> ``StoreSpec`` -> the
in-process store over a real Redis. ``connectors.vllm.options`` imports without vLLM."""
from __future__ import annotations

import pytest

from connectors.stores import StoreRegistry, StoreSpec
from connectors.vllm.options import ConnectorOptions, remote_fields
from kvstore.store import ChunkStore
from tests.kvstore.remote_helpers import NS, prompt, rkey, same
from tests.redis_fixtures import redis_server  # noqa: F401

PASSWORD = "pw-c0ffee-not-for-logs"


def test_remote_keys_become_the_in_process_store_spec():
    opts = ConnectorOptions.from_extra(
        {"cpu_bytes": "64MiB", "remote_url": "redis://h1:7000,h2:7000",
         "remote_key_prefix": "vllm-prod", "remote_ttl_s": "600", "remote_timeout_s": 0.1},
        block_size=16)
    assert opts.store == StoreSpec(cpu_bytes="64MiB", remote_url="redis://h1:7000,h2:7000",
                                   remote_key_prefix="vllm-prod", remote_ttl_s=600.0,
                                   remote_timeout_s=0.1)
    cfg = opts.store.store_config()
    assert (cfg.cpu_bytes, cfg.remote_url, cfg.remote_key_prefix, cfg.remote_ttl_s,
            cfg.remote_timeout_s) == (64 << 20, "redis://h1:7000,h2:7000", "vllm-prod", 600.0,
                                      0.1)
    # only the URL: the store's defaults, and vLLM's default CPU tier
    spec = ConnectorOptions.from_extra({"remote_url": "redis://h:1"}, block_size=16).store
    assert (spec.cpu_bytes, spec.remote_key_prefix, spec.remote_ttl_s,
            spec.remote_timeout_s) == ("1GiB", "kvstore", 0.0, 0.25)
    assert remote_fields({"cpu_bytes": "1GiB"}) == {}
    assert ConnectorOptions.from_extra({}, block_size=16).store.remote_url is None


def test_a_url_password_stays_out_of_the_spec_repr():
    spec = ConnectorOptions.from_extra({"remote_url": f"redis://:{PASSWORD}@h:7000"},
                                       block_size=16).store
    assert spec.remote_url == "redis://h:7000" and spec.remote_password == PASSWORD
    assert PASSWORD not in repr(spec)


@pytest.mark.parametrize("extra, message", [
    ({"kvstore_url": "http://127.0.0.1:8500", "remote_url": "redis://h:1"},
     "'kvstore_url' names a daemon: start the daemon with kvstore serve --remote-url instead"),
    ({"remote_ttl_s": 60}, "'remote_ttl_s' needs 'remote_url'"),
    ({"remote_key_prefix": "p", "remote_timeout_s": 1},
     "'remote_key_prefix', 'remote_timeout_s' needs 'remote_url'"),
    ({"remote_url": f"http://:{PASSWORD}@h:1"},
     "'remote_url': remote URL scheme must be redis:// or rediss://"),
    ({"remote_url": f"redis://:{PASSWORD}@h:x"}, "'remote_url': remote URL port must be a number"),
    ({"remote_url": "redis://h:1", "remote_ttl_s": -5}, "'remote_ttl_s' must be a number of "
                                                        "seconds >= 0, got -5"),
    ({"remote_url": "redis://h:1", "remote_timeout_s": 0}, "'remote_timeout_s' must be a number "
                                                           "of seconds > 0, got 0"),
    ({"remote_url": "redis://h:1", "remote_key_prefix": 7}, "'remote_key_prefix' must be text"),
])
def test_bad_remote_keys_are_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError) as e:
        ConnectorOptions.from_extra(extra, block_size=16)
    assert message in str(e.value)
    assert PASSWORD not in str(e.value)


def test_the_connectors_of_one_process_share_one_store_over_redis(redis_server):  # noqa: F811
    extra = {"cpu_bytes": "1MiB", "remote_url": redis_server.url, "remote_key_prefix": "vllm"}
    spec = ConnectorOptions.from_extra(extra, block_size=4).store
    registry = StoreRegistry()
    scheduler_side, worker_side = registry.acquire(spec), registry.acquire(spec)
    other_host = ChunkStore(StoreSpec(cpu_bytes="1MiB", remote_url=redis_server.url,
                                      remote_key_prefix="vllm").store_config(), [NS])
    try:
        store = worker_side.store
        assert store is scheduler_side.store and isinstance(store, ChunkStore)
        assert store.remote.key_prefix == "vllm"
        store.register(NS)
        keys, kvs = prompt(NS, 3, 2)
        assert store.put_chunks(NS, keys, kvs) == 2
        assert store.flush(5.0)
        with redis_server.client() as r:
            assert sorted(r.keys(b"*")) == sorted(rkey(k, "vllm") for k in keys)
        assert other_host.lookup_keys(NS, keys).tiers == ("remote", "remote")
        assert same(other_host.get_chunks(NS, keys), kvs)
    finally:
        other_host.close()
        registry.release(scheduler_side)
        registry.release(worker_side)
    assert registry.refs(spec) == 0
