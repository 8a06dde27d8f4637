"""The vLLM connector's ``kv_connector_extra_config`` checks (``connectors.vllm.options``): an
unknown key, a daemon-only key without a daemon, a value of the wrong kind and a bad byte size
are refused with an error naming the key; every key the project's own code, docs, tests and
benches pass is still accepted; an in-process store under an executor whose worker is another
process is refused at start (``check_store_reach``). Runs without vLLM."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from connectors.stores import StoreSpec
from connectors.vllm.options import (KNOWN_KEYS, ConnectorOptions, check_store_reach,
                                     executor_name)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("extra, message", [
    ({"kvstore_ulr": "http://127.0.0.1:8500"},
     "unknown key 'kvstore_ulr' (did you mean 'kvstore_url'?); known keys: auth_token, "),
    ({"chunk_sise": 64}, "unknown key 'chunk_sise' (did you mean 'chunk_size'?)"),
    ({"zzz": 1}, "unknown key 'zzz'; known keys: auth_token, chunk_size, cpu_bytes"),
    ({"auth_token": "t0ken"}, "'auth_token' needs 'kvstore_url' (only a kvstore daemon reads it)"),
    ({"weights_fingerprint": 123},
     "'weights_fingerprint' must be 'auto', 'off' or a fingerprint string, got 123"),
    ({"weights_fingerprint": True}, "'weights_fingerprint' must be 'auto', 'off'"),
    ({"model_id": ["m"]}, "'model_id' must be text, got ['m']"),
    ({"kvstore_url": 8500}, "'kvstore_url' must be text, got 8500"),
    ({"store_name": 3}, "'store_name' must be text, got 3"),
    ({"cpu_bytes": "lots"}, "cpu_bytes: not a byte size: 'lots'"),
    ({"disk_bytes": -1, "disk_path": "/tmp/kv"}, "disk_bytes: byte size must be >= 0, got -1"),
])
def test_bad_keys_and_values_are_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError) as e:
        ConnectorOptions.from_extra(extra, block_size=16)
    assert message in str(e.value)


def test_the_keys_the_docs_and_the_bench_pass_are_accepted():
    # every key the connector's docstring lists as ``key``: is known, and the known keys are
    # exactly those (a key read but not documented, or documented but refused, fails here)
    doc = (ROOT / "connectors" / "vllm" / "__init__.py").read_text()
    section = doc.split("``kv_connector_extra_config`` keys")[1].split("What moves:")[0]
    documented = set(re.findall(r"``([a-z_]+)``", section)) & KNOWN_KEYS
    assert documented == KNOWN_KEYS, KNOWN_KEYS - documented
    full = {"model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main",
            "weights_fingerprint": "off", "hash_algo": "sha256", "chunk_size": "256",
            "tail_chunk_size": 128, "timeout_s": 1.5, "save_queue_bytes": "64MiB",
            "pin_lease_s": 0, "layerwise_load": "auto", "cpu_bytes": 1 << 20,
            "disk_bytes": "8MiB", "disk_path": "/tmp/kv", "store_name": "s1"}
    opts = ConnectorOptions.from_extra(full, block_size=128)
    assert (opts.chunk_size, opts.tail_chunk_size, opts.save_queue_bytes) == (256, 128, 64 << 20)
    assert opts.store == StoreSpec(cpu_bytes=str(1 << 20), disk_bytes="8MiB",
                                   disk_path="/tmp/kv", name="s1")
    daemon = ConnectorOptions.from_extra({"kvstore_url": "http://127.0.0.1:8500",
                                          "auth_token": "t0ken", "chunk_size": 256}, 128)
    assert (daemon.store.url, daemon.store.auth_token) == ("http://127.0.0.1:8500", "t0ken")
    # an empty token without a daemon (an unset variable) is not a daemon key given
    assert ConnectorOptions.from_extra({"auth_token": ""}, 128).store.url is None


def test_an_in_process_store_is_refused_under_an_executor_of_other_processes(caplog):
    local = StoreSpec(cpu_bytes="1GiB")
    for backend in ("mp", "ray"):
        with pytest.raises(ValueError) as e:
            check_store_reach(local, backend)
        text = str(e.value)
        assert f"vLLM's executor {backend!r} runs the worker in another process" in text
        assert "set 'kvstore_url'" in text and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in text
    # the worker in the scheduler's process, a daemon, or Redis shared by both: let through
    check_store_reach(local, "uni")
    check_store_reach(local, "external_launcher")
    check_store_reach(StoreSpec(url="http://127.0.0.1:8500"), "mp")
    with caplog.at_level("WARNING", logger="kvstore.connectors.vllm"):
        check_store_reach(StoreSpec(cpu_bytes="1GiB", remote_url="redis://h:1"), "mp")
    assert "lookups hit in the remote tier only" in caplog.text

    class UniProcExecutor:   # vLLM's class name; a subclass of it is the same executor
        pass

    class MyExecutor(UniProcExecutor):
        pass

    class RayLike:
        pass

    assert executor_name(MyExecutor) == "uni" and executor_name(RayLike) == "RayLike"
    check_store_reach(local, MyExecutor)
    with pytest.raises(ValueError, match="executor 'RayLike' runs the worker"):
        check_store_reach(local, RayLike)
