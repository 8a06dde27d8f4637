"""Numeric command-line values of the bench scripts, checked when the command line is parsed,
before any work: a benchmark must not load a model and run for minutes before a bad value
ends it in a traceback.

Each function is (or returns) an argparse ``type=`` function: a bad value is argparse's
one-line error (``argument --max-tokens: ...``) and exit status 2.
"""
from __future__ import annotations

import argparse
from typing import Callable

# engine_min.config.EngineConfig.block_size's default (not imported here: torch is slow to
# import, and a bad flag must be refused at once); tests/bench checks the two agree.
ENGINE_BLOCK_SIZE = 16


def _int(text: str) -> int:
    """``text`` as an int. Raises argparse.ArgumentTypeError: not an integer."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type accepting integers >= ``minimum``.

    Returns:
        a function str -> int that raises argparse.ArgumentTypeError for a non-integer or a
        value below ``minimum``.
    """
    def check(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    check.__name__ = f"int_at_least_{minimum}"
    return check


def chunk_size(text: str) -> int:
    """An argparse type: a store chunk size in tokens, a positive multiple of the engine's
    block size (``ENGINE_BLOCK_SIZE`` = 16 tokens).

    Raises:
        argparse.ArgumentTypeError: not an integer, <= 0, or not a multiple of 16.
    """
    value = _int(text)
    if value <= 0 or value % ENGINE_BLOCK_SIZE:
        raise argparse.ArgumentTypeError(
            f"must be a positive multiple of the engine's block size {ENGINE_BLOCK_SIZE} "
            f"tokens, got {value}")
    return value
