"""Store construction shared by the connectors (``connectors.stores``): which store a spec
opens, refused specs, and the refcounted registry the vLLM connector's two roles share."""
from __future__ import annotations

import pytest

from connectors.stores import (DEFAULT_DISK_BYTES, BreakerTimes, StoreRegistry, StoreSpec,
                               http_url, open_store)
from connectors.vllm.options import ConnectorOptions, store_spec
from kvstore.keys import Namespace
from kvstore.layered import CircuitBreakerStore, LayeredStore
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.units import parse_size


def test_a_cpu_spec_opens_an_in_process_store():
    opened = open_store(StoreSpec(cpu_bytes="1MiB"))
    try:
        assert isinstance(opened.store, ChunkStore)
        assert (opened.tenant_salt, opened.remote) == (None, False)
        assert opened.store.config.cpu_bytes == 1 << 20 and opened.store.config.disk_bytes == 0
    finally:
        opened.store.close()


def test_disk_path_alone_gets_the_default_disk_tier(tmp_path):
    opened = open_store(StoreSpec(disk_path=str(tmp_path / "lmdb")))
    try:
        cfg = opened.store.config
        assert (cfg.cpu_bytes, cfg.disk_bytes) == (0, parse_size(DEFAULT_DISK_BYTES))
    finally:
        opened.store.close()


def test_a_url_opens_the_client_bare_or_behind_a_breaker_and_layers_local_tiers():
    bare = open_store(StoreSpec(url="tcp://127.0.0.1:1", timeout_s=0.1))
    assert bare.remote and bare.store.url == "http://127.0.0.1:1"
    bare.store.close()
    times = BreakerTimes(put_timeout_s=30.0, get_timeout_s_per_chunk=0.05, get_timeout_s_base=0.1)
    both = open_store(StoreSpec(cpu_bytes="1MiB", url="http://127.0.0.1:1", breaker=times))
    try:
        assert not both.remote and isinstance(both.store, LayeredStore)
        assert isinstance(both.store.local, ChunkStore)
        assert isinstance(both.store.remote, CircuitBreakerStore)
    finally:
        both.store.close()


@pytest.mark.parametrize("spec, message", [
    (StoreSpec(), "no store: give cpu_bytes, disk_path or url"),
    (StoreSpec(cpu_bytes="1MiB", disk_bytes="1GiB"), "disk_bytes needs disk_path"),
    (StoreSpec(url="ftp://h:1"), "malformed kvstore URL 'ftp://h:1': expected http://HOST:PORT"),
])
def test_bad_specs_are_refused_before_anything_opens(spec, message):
    with pytest.raises(ValueError) as e:
        open_store(spec)
    assert str(e.value) == message


def test_http_url_names_a_bad_port():
    with pytest.raises(ValueError, match="http://h:99999"):
        http_url("http://h:99999")


def test_the_registry_shares_one_store_per_spec_and_closes_it_with_the_last_release():
    reg = StoreRegistry()
    spec = StoreSpec(cpu_bytes="1MiB", name="a")
    a, b = reg.acquire(spec), reg.acquire(spec)
    other = reg.acquire(StoreSpec(cpu_bytes="1MiB", name="b"))
    assert a.store is b.store and other.store is not a.store
    assert reg.refs(spec) == 2
    reg.release(a)
    ns = Namespace("m", KVLayout(1, 1, 4, "float32", 16))
    keys = ns.chunk_keys(list(range(16)))
    assert reg.refs(spec) == 1 and a.store.exists(ns, keys) == [False]   # still open
    reg.release(b)
    assert reg.refs(spec) == 0
    with pytest.raises(RuntimeError, match="store is closed"):
        a.store.exists(ns, keys)
    reg.release(b)                        # a release too many is ignored
    assert reg.acquire(spec).store is not a.store   # reopened fresh
    reg.release(other)
    assert reg.refs(StoreSpec(cpu_bytes="1MiB", name="b")) == 0


def test_a_holder_releasing_twice_does_not_close_the_store_under_another_holder():
    reg = StoreRegistry()
    spec = StoreSpec(cpu_bytes="1MiB")
    a, b = reg.acquire(spec), reg.acquire(spec)
    reg.release(a)
    reg.release(a)                        # the second release of ``a`` holds nothing
    ns = Namespace("m", KVLayout(1, 1, 4, "float32", 16))
    keys = ns.chunk_keys(list(range(16)))
    assert reg.refs(spec) == 1 and b.store.exists(ns, keys) == [False]   # b's store is open
    reg.release(spec)                     # not a handle: ignored
    assert reg.refs(spec) == 1
    reg.release(b)
    assert reg.refs(spec) == 0
    with pytest.raises(RuntimeError, match="store is closed"):
        b.store.exists(ns, keys)


def test_vllm_options_read_the_extra_config():
    opts = ConnectorOptions.from_extra({"chunk_size": 256}, block_size=128)
    assert (opts.chunk_size, opts.tail_chunk_size, opts.timeout_s, opts.pin_lease_s) == \
        (256, 128, 2.0, 30.0)
    assert opts.store == StoreSpec(cpu_bytes="1GiB")
    # tail pieces default to vLLM's block size when it is smaller than the chunk, else off
    assert ConnectorOptions.from_extra({"chunk_size": 256}, block_size=256).tail_chunk_size == 0
    assert ConnectorOptions.from_extra({"save_queue_bytes": "1GiB", "chunk_size": "512"},
                                       block_size=16).save_queue_bytes == 1 << 30
    with pytest.raises(ValueError, match="tail_chunk_size 100 must divide chunk_size 256"):
        ConnectorOptions.from_extra({"tail_chunk_size": 100}, block_size=128)
    # layer-wise loads: auto (None: decided by the caches' device) unless set
    assert opts.layerwise_load is None
    for value, want in (("auto", None), ("true", True), (False, False), (1, True)):
        assert ConnectorOptions.from_extra({"layerwise_load": value},
                                           block_size=16).layerwise_load is want
    with pytest.raises(ValueError, match="'layerwise_load' must be true or false"):
        ConnectorOptions.from_extra({"layerwise_load": "sometimes"}, block_size=16)
    remote = store_spec({"kvstore_url": "http://h:1", "auth_token": "t", "cpu_bytes": "1GiB"},
                        timeout_s=2.0)
    # the daemon behind the same breaker as engine_min's: lookups 2 s, loads 2 s + 0.05 s a
    # chunk, saves 30 s
    assert remote == StoreSpec(url="http://h:1", auth_token="t", timeout_s=2.0,
                               breaker=BreakerTimes(30.0, 0.05, 2.0))


@pytest.mark.parametrize("extra, message", [
    ({"chunk_size": 0}, "'chunk_size' must be an integer >= 1, got 0"),
    ({"chunk_size": -1}, "'chunk_size' must be an integer >= 1, got -1"),
    ({"chunk_size": "abc"}, "'chunk_size' must be an integer >= 1, got 'abc'"),
    ({"chunk_size": 2.7}, "'chunk_size' must be an integer >= 1, got 2.7"),
    ({"chunk_size": True}, "'chunk_size' must be an integer >= 1, got True"),
    ({"chunk_size": 100}, "chunk_size=100 must be a multiple of the engine's block_size=16"),
    ({"chunk_size": 256, "tail_chunk_size": -16}, "'tail_chunk_size' must be an integer >= 0"),
    ({"chunk_size": 256, "tail_chunk_size": 8},
     "tail_chunk_size=8 must be a multiple of the engine's block_size=16"),
    ({"save_queue_bytes": "lots"}, "'save_queue_bytes': not a byte size: 'lots'"),
    ({"save_queue_bytes": -5}, "'save_queue_bytes': byte size must be >= 0, got -5"),
    ({"timeout_s": "abc"}, "'timeout_s' must be a number of seconds > 0, got 'abc'"),
    ({"timeout_s": 0}, "'timeout_s' must be a number of seconds > 0, got 0"),
    ({"timeout_s": float("nan")}, "'timeout_s' must be a number of seconds > 0, got nan"),
    ({"pin_lease_s": -1}, "'pin_lease_s' must be a number of seconds >= 0, got -1"),
])
def test_vllm_options_refuse_bad_values_naming_the_key_before_a_store_opens(extra, message):
    with pytest.raises(ValueError) as e:
        ConnectorOptions.from_extra(extra, block_size=16)
    assert message in str(e.value)


def test_vllm_options_warn_about_keys_they_ignore(caplog):
    with caplog.at_level("WARNING", logger="kvstore.connectors.vllm"):
        opts = ConnectorOptions.from_extra({"save_queue": 4}, block_size=16)
        spec = store_spec({"kvstore_url": "http://h:1", "cpu_bytes": "1GiB",
                           "disk_path": "/tmp/kv"}, timeout_s=2.0)
    assert opts.save_queue_bytes == 512 << 20       # the old count is not read as bytes
    assert spec == StoreSpec(url="http://h:1", timeout_s=2.0,
                             breaker=BreakerTimes.for_connector(2.0))
    text = caplog.text
    assert "'save_queue' (a count of saves) is replaced by 'save_queue_bytes'; ignored" in text
    assert "'cpu_bytes', 'disk_path' ignored: with 'kvstore_url'" in text


def test_a_failed_open_leaves_the_disk_path_free(tmp_path, monkeypatch):
    """A store that fails after its in-process tiers opened closes them: the disk path's lock
    is released, so the next open of the same path succeeds."""
    import connectors.stores as stores

    def no_daemon(client, timeout_s, token=True):
        raise RuntimeError("daemon exploded")
    monkeypatch.setattr(stores, "daemon_whoami", no_daemon)
    path = str(tmp_path / "lmdb")
    with pytest.raises(RuntimeError, match="daemon exploded"):
        open_store(StoreSpec(cpu_bytes="1MiB", disk_path=path, disk_bytes="16MiB",
                             url="http://127.0.0.1:1", auth_token="t" * 16))
    again = open_store(StoreSpec(disk_path=path, disk_bytes="16MiB"))
    again.store.close()


@pytest.mark.parametrize("bad", [{"chunk_size": 0}, {"chunk_size": "abc"},
                                 {"tail_chunk_size": 7}, {"deadline_s": 0}])
def test_create_connector_refusing_an_option_closes_the_store_it_opened(tmp_path, bad):
    from connectors.factory import create_connector
    path = str(tmp_path / "lmdb")
    with pytest.raises(ValueError):
        create_connector(cpu_bytes="1MiB", disk_path=path, disk_bytes="16MiB", **bad)
    c = create_connector(cpu_bytes="1MiB", disk_path=path, disk_bytes="16MiB")  # path free
    c.close()


def test_a_daemon_that_refuses_or_does_not_answer_is_named_at_start(caplog):
    """Opening a store on a daemon asks ``/v1/whoami`` once, also without a token: a daemon
    that wants a token, one given a wrong token, and one not listening each give one WARNING
    at start saying so (the engine still starts and recomputes); a daemon that accepts gives
    none."""
    import logging
    from kvstore.config import StoreConfig
    from kvstore.daemon.run import ThreadedServer
    from kvstore.daemon.server import ServerLimits, create_app
    from bench.servers import free_port
    store = ChunkStore(StoreConfig(cpu_bytes="8MiB"))
    token = "admin-token-0123456789"
    with ThreadedServer(create_app(store, ServerLimits(auth_token=token))) as srv:
        cases = [(None, "refuses this engine (401: no token given)"),
                 ("wrong-token-0123456789", "refuses this engine (401: wrong token)"),
                 (token, None)]
        for given, warning in cases:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvstore.connectors.stores"):
                opened = open_store(StoreSpec(url=srv.url, auth_token=given, timeout_s=2.0))
            opened.store.close()
            msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            if warning is None:
                assert msgs == [], msgs
            else:
                assert len(msgs) == 1 and warning in msgs[0] and srv.url in msgs[0], msgs
    store.close()
    caplog.clear()
    url = f"http://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors.stores"):
        open_store(StoreSpec(url=url, timeout_s=0.5)).store.close()
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(msgs) == 1 and f"kvstore daemon {url} is not answering" in msgs[0], msgs
