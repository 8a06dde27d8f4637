"""Every numeric flag of the user-facing bench entry points is checked when the command line
is parsed: a bad value (below its minimum, zero where it must be positive, a chunk size that
is not a multiple of the engine's block size, a byte size of 0) is argparse's one-line error
naming the flag, with exit status 2, before any work (only the parsers are built and run
here). Flags are found in each script's ``build_parser()``, so a flag added later without a
check fails ``test_no_numeric_flag_is_left_unchecked``."""
from __future__ import annotations

import argparse
import importlib
import re

import pytest

from bench.arg_checks import (byte_size, chunk_size_or_zero, float_above, float_at_least,
                              int_list)

SCRIPTS = ("multi_round_qa", "long_doc_qa", "trace_replay", "daemon_load", "engine_speed",
           "miss_cost", "fleet", "prefix_eviction", "policy_reuse", "vllm_compare",
           "client_parity")
#: flags that take any integer
ANY_INT = {"--seed"}


def _bad_value(check) -> str:
    """A value ``check`` (an ``arg_checks`` type) must refuse."""
    name = check.__name__
    m = re.fullmatch(r"(int_at_least|int_list|float_at_least|float_above)_(-?[\d.]+)", name)
    if m:
        kind, bound = m.groups()
        below = float(bound) - 1
        if kind == "float_above":
            return bound  # the bound itself
        return str(int(below)) if kind.startswith("int") else f"{below:g}"
    return {"chunk_size": "24", "chunk_size_or_zero": "-16", "byte_size": "0"}[name]


def _numeric_flags():
    for script in SCRIPTS:
        parser = importlib.import_module(f"bench.{script}").build_parser()
        for action in parser._actions:
            if action.option_strings and action.type is not None \
                    and getattr(action.type, "__module__", "") == "bench.arg_checks":
                yield script, action.option_strings[0], _bad_value(action.type)


CASES = list(_numeric_flags())


def test_every_script_has_checked_flags():
    assert {s for s, _, _ in CASES} == set(SCRIPTS)
    assert len(CASES) >= 90


@pytest.mark.parametrize("script,flag,bad", CASES, ids=[f"{s}{f}={b}" for s, f, b in CASES])
def test_a_bad_numeric_value_is_refused_at_parse_time_naming_the_flag(script, flag, bad, capsys):
    parser = importlib.import_module(f"bench.{script}").build_parser()
    argv = [f"{flag}={bad}"]
    if script == "policy_reuse":
        argv += ["--trace", "mooncake-conv"]   # (required)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in err, err


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_numeric_flag_is_left_unchecked(script):
    parser = importlib.import_module(f"bench.{script}").build_parser()
    bare = [a.option_strings[0] for a in parser._actions
            if a.type in (int, float) and a.option_strings and a.option_strings[0] not in ANY_INT
            and a.help != argparse.SUPPRESS]
    assert bare == []


def test_the_defaults_still_parse():
    for script in SCRIPTS:
        argv = ["--trace", "mooncake-conv"] if script == "policy_reuse" else []
        importlib.import_module(f"bench.{script}").build_parser().parse_args(argv)


def test_the_new_checks_values():
    assert float_above(0)("0.5") == 0.5 and float_at_least(0)("0") == 0.0
    assert chunk_size_or_zero("0") == 0 and chunk_size_or_zero("32") == 32
    assert byte_size("256MiB") == "256MiB" and int_list(1)("1024, 16,") == [1024, 16]
    assert int_list(1)("") == []
    for check, text, why in (
            (float_above(0), "0", "must be > 0, got 0"),
            (float_above(0), "nan", "must be a finite number, got 'nan'"),
            (float_above(0), "inf", "must be a finite number, got 'inf'"),
            (float_at_least(0), "-0.5", "must be >= 0, got -0.5"),
            (float_above(0), "fast", "not a number: 'fast'"),
            (chunk_size_or_zero, "24", "positive multiple of the engine's block size 16"),
            (byte_size, "0", "must be > 0 bytes, got '0'"),
            (byte_size, "12 parsecs", "unknown size unit"),
            (int_list(1), "1024,0", "must be >= 1, got 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            check(text)
