"""The defaults ``--help`` shows are the ones that apply: ``engine_min serve``'s engine flags
(``EngineConfig``'s defaults) and ``kvstore serve --policy`` (``ServeConfig.policy``)."""
from __future__ import annotations

import argparse
import dataclasses

from engine_min.config import EngineConfig
from engine_min.serve.cli import ENGINE_DEFAULTS, add_serve_args
from kvstore.daemon.cli import build_parser
from kvstore.daemon.config import ServeConfig


def test_engine_flags_help_shows_the_engine_config_defaults():
    real = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert ENGINE_DEFAULTS == {k: real[k] for k in ENGINE_DEFAULTS}
    text = " ".join(add_serve_args(argparse.ArgumentParser()).format_help().split())
    for flag, shown in (("--kv-cache-bytes SIZE", f"{real['kv_cache_bytes'] // 2**20}MiB"),
                        ("--block-size BLOCK_SIZE", real["block_size"]),
                        ("--max-num-batched-tokens MAX_NUM_BATCHED_TOKENS",
                         real["max_num_batched_tokens"]),
                        ("--max-num-seqs MAX_NUM_SEQS", real["max_num_seqs"])):
        after = text[text.rindex(flag) + len(flag):]
        assert f"(default {shown})" in after[:90], flag


def test_kvstore_serve_policy_help_names_the_default():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["serve"].format_help().split())
    assert f"{ServeConfig.policy} (default)" in text
