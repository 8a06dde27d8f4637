"""connectors.flags: the ``--kvstore-*`` flags, their checks and the connector they build."""
import argparse

import pytest
import torch

from connectors.engine_min import EngineMinConnector
from connectors.flags import STORE_FLAGS, StoreFlagError, add_store_args, connector_from_args


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    return parser.parse_args(list(argv))


def test_no_store_flag_is_no_connector_and_defaults_are_the_documented_ones():
    args = parse()
    assert connector_from_args(args) is None
    assert all(getattr(args, f) is None for f in STORE_FLAGS)
    # tail size None: pieces of the engine's block size (resolved when the engine binds)
    assert (args.kvstore_chunk_size, args.kvstore_tail_chunk_size) == (None, None)  # 256


def test_tail_pieces_are_on_by_default_and_zero_turns_them_off():
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32"))
    try:
        assert c.tail_chunk_size is None                     # not bound yet
        c.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)   # block size 4
        assert c.tail_chunk_size == 4 and c.tail_ns.layout.chunk_size == 4
    finally:
        c.close()
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                                  "--kvstore-tail-chunk-size", "0"))
    try:
        c.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)
        assert c.tail_chunk_size == 0 and c.tail_ns is None
    finally:
        c.close()
    # 0 without a store is not an error (it asks for nothing)
    assert connector_from_args(parse("--kvstore-tail-chunk-size", "0")) is None


def test_sizes_parse_as_bytes_and_build_an_in_process_store():
    args = parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                 "--kvstore-tail-chunk-size", "16")
    assert args.kvstore_cpu_bytes == 8 * 2**20
    c = connector_from_args(args)
    try:
        assert isinstance(c, EngineMinConnector)
        assert (c.chunk_size, c.tail_chunk_size) == (32, 16)
    finally:
        c.close()


@pytest.mark.parametrize("argv, msg", [
    (("--kvstore-tail-chunk-size", "16"), "--kvstore-tail-chunk-size needs a store"),
    (("--kvstore-tail-chunk-size", "7"), "--kvstore-tail-chunk-size needs a store"),
    (("--kvstore-chunk-size", "100"), "--kvstore-chunk-size needs a store"),
    (("--kvstore-chunk-size", "0"), "--kvstore-chunk-size needs a store"),
    (("--kvstore-auth-token", "t0k"), "--kvstore-auth-token needs --kvstore-url"),
    (("--kvstore-cpu-bytes", "8MiB", "--kvstore-auth-token", "t0k"),
     "--kvstore-auth-token needs --kvstore-url"),
    (("--kvstore-disk-bytes", "1GiB"), "--kvstore-disk-bytes needs --kvstore-disk-path"),
])
def test_flags_that_do_not_go_together_raise(argv, msg, monkeypatch):
    monkeypatch.delenv("KVSTORE_AUTH_TOKEN", raising=False)
    with pytest.raises(StoreFlagError, match=msg):
        connector_from_args(parse(*argv))


def test_a_token_inherited_from_the_environment_is_not_a_flag(monkeypatch):
    """$KVSTORE_AUTH_TOKEN set for other tools does not stop an engine without a daemon."""
    monkeypatch.setenv("KVSTORE_AUTH_TOKEN", "t0k")
    assert connector_from_args(parse()) is None
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB"))
    assert isinstance(c, EngineMinConnector)
    c.close()


def test_a_bad_size_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse("--kvstore-cpu-bytes", "8 parsecs")
    assert "--kvstore-cpu-bytes" in capsys.readouterr().err


@pytest.mark.parametrize("value, reason", [
    ("8 parsecs", "unknown size unit 'parsecs' in '8 parsecs'"),
    ("lots", "not a byte size: 'lots' (examples: 4096, '512MiB', '8GiB', '2GB')"),
    ("1.5B", "'1.5B' is not a whole number of bytes"),
])
def test_a_bad_size_names_the_flag_and_the_reason(capsys, value, reason):
    with pytest.raises(SystemExit):
        parse("--kvstore-cpu-bytes", value)
    assert f"argument --kvstore-cpu-bytes: {reason}" in capsys.readouterr().err


def test_load_deadlines_are_flags_that_reach_the_connector_and_refuse_bad_values(capsys):
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB", "--kvstore-deadline-s", "2.5",
                                  "--kvstore-deadline-s-per-chunk", "0.2"))
    try:
        assert (c.deadline_s, c.deadline_s_per_chunk) == (2.5, 0.2)
        assert (c._loader.deadline_s, c._loader.deadline_s_per_chunk) == (2.5, 0.2)
    finally:
        c.close()
    c = connector_from_args(parse("--kvstore-cpu-bytes", "8MiB"))
    try:
        assert (c.deadline_s, c.deadline_s_per_chunk) == (0.5, 0.05)  # the documented defaults
    finally:
        c.close()
    for argv, msg in ((("--kvstore-deadline-s", "0"), "seconds > 0"),
                      (("--kvstore-deadline-s", "-1"), "finite number of seconds > 0"),
                      (("--kvstore-deadline-s-per-chunk", "-1"), "finite number of seconds >= 0"),
                      (("--kvstore-deadline-s-per-chunk", "soon"), "is not a number of seconds"),
                      (("--kvstore-deadline-s", "inf"), "finite number")):
        with pytest.raises(SystemExit):
            parse("--kvstore-cpu-bytes", "8MiB", *argv)
        assert msg in capsys.readouterr().err
    with pytest.raises(StoreFlagError, match="--kvstore-deadline-s needs a store"):
        connector_from_args(parse("--kvstore-deadline-s", "2"))
