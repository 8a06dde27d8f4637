"""The lossy codec's flags: ``--kvstore-lossy-codec`` puts the codec in the engine connector's
namespace (keys of their own), ``kvstore serve --disk-codec/--remote-codec`` configure the
daemon's tiers (``KVSTORE_DISK_CODEC`` too); bad values are refused."""
import argparse
import dataclasses

import pytest
import torch

from connectors.flags import StoreFlagError, add_store_args, connector_from_args
from kvstore.daemon import config as serve_config
from kvstore.daemon.cli import build_parser


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    return parser.parse_args(list(argv))


def bound_namespace(*argv):
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                                  *argv))
    try:
        c.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)
        return c.ns, c.tail_ns
    finally:
        c.close()


def test_lossy_codec_flag_names_the_codec_in_the_namespace_and_its_keys():
    exact, _ = bound_namespace()
    lossy, lossy_tail = bound_namespace("--kvstore-lossy-codec", "int8")
    assert exact.lossy_codec == "" and lossy.lossy_codec == lossy_tail.lossy_codec == "int8"
    assert lossy == dataclasses.replace(exact, lossy_codec="int8")     # nothing else differs
    assert not set(exact.chunk_keys(range(64))) & set(lossy.chunk_keys(range(64)))


def test_lossy_codec_flag_is_refused_without_a_store_or_with_an_unknown_codec(capsys):
    with pytest.raises(StoreFlagError, match="--kvstore-lossy-codec needs a store"):
        connector_from_args(parse("--kvstore-lossy-codec", "fp8"))
    with pytest.raises(SystemExit):
        parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-lossy-codec", "int4")
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_serve_codec_flags_and_environment_reach_the_store_config(monkeypatch):
    args = build_parser().parse_args(["serve", "--disk-path", "/tmp/kv", "--disk-bytes", "1GiB",
                                      "--disk-codec", "int8", "--remote-codec", "fp8",
                                      "--remote-url", "redis://127.0.0.1:1"])
    flags = {k: v for k, v in vars(args).items() if k in serve_config.FIELDS}
    kw = serve_config.resolve(flags, config_file=None).store_config_kwargs()
    assert (kw["disk_codec"], kw["remote_codec"]) == ("int8", "fp8")
    monkeypatch.setenv("KVSTORE_DISK_CODEC", "fp8")
    cfg = serve_config.resolve({"disk_path": "/tmp/kv", "disk_bytes": "1GiB"}, config_file=None)
    assert cfg.store_config_kwargs()["disk_codec"] == "fp8"
    assert serve_config.ServeConfig().store_config_kwargs()["disk_codec"] == "auto"
    with pytest.raises(ValueError, match="unknown disk_codec 'int4'"):
        serve_config.ServeConfig(disk_codec="int4")


def test_lossy_codec_flag_sets_the_in_process_disk_tier_codec(tmp_path):
    """In process, --kvstore-lossy-codec also makes the store's disk tier write this engine's
    chunks with the codec (a daemon's tiers are configured on the daemon); another
    namespace's chunk in the same store stays lossless."""
    from kvstore.disk_inspect import inspect_disk
    disk = str(tmp_path / "kv")
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                                  "--kvstore-disk-path", disk, "--kvstore-disk-bytes", "64MiB",
                                  "--kvstore-lossy-codec", "int8"))
    try:
        c.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)
        store, ns = c.store, c.ns
        assert store.config.disk_codec == "int8"
        exact = dataclasses.replace(ns, lossy_codec="")
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(ns.layout.shape(), generator=g).to(ns.layout.torch_dtype)
        lossy_key, exact_key = ns.chunk_keys(range(32))[0], exact.chunk_keys(range(32))[0]
        assert store.persist(ns, [lossy_key], [kv], timeout=10.0) == 1
        assert store.persist(exact, [exact_key], [kv], timeout=10.0) == 1
    finally:
        c.close()
    rep = inspect_disk(disk, limit=10)
    codecs = {ch["key"]: ch["codec"] for ch in rep["chunks"]}
    assert codecs[lossy_key.hex()] == "int8" and codecs[exact_key.hex()] != "int8"
