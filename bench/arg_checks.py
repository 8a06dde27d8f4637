"""Numeric command-line values of the bench scripts, checked when the command line is parsed,
before any work: a benchmark must not load a model and run for minutes before a bad value
ends it in a traceback.

Each function is (or returns) an argparse ``type=`` function: a bad value is argparse's
one-line error (``argument --max-tokens: ...``) and exit status 2.
"""
from __future__ import annotations

import argparse
import math
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


def chunk_size_or_zero(text: str) -> int:
    """An argparse type: 0 (the server's default chunk size) or a ``chunk_size``.

    Raises:
        argparse.ArgumentTypeError: not an integer, < 0, or not a multiple of 16.
    """
    return 0 if _int(text) == 0 else chunk_size(text)


def _float(text: str) -> float:
    """``text`` as a finite float. Raises argparse.ArgumentTypeError: not a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def float_above(minimum: float) -> Callable[[str], float]:
    """An argparse type accepting finite numbers > ``minimum`` (seconds, rates, factors).

    Returns:
        a function str -> float that raises argparse.ArgumentTypeError for a non-number,
        an infinite or NaN value, or one <= ``minimum``.
    """
    def check(text: str) -> float:
        value = _float(text)
        if not value > minimum:
            raise argparse.ArgumentTypeError(f"must be > {minimum:g}, got {value:g}")
        return value
    check.__name__ = f"float_above_{minimum:g}"
    return check


def byte_size(text: str) -> str:
    """An argparse type: a positive byte size (``"256MiB"``, ``"2GiB"``, ``4096``; see
    ``kvstore.units.parse_size``), returned as given (the scripts pass it on as text).

    Raises:
        argparse.ArgumentTypeError: not a byte size, or 0.
    """
    from kvstore.units import parse_size  # (no torch: kvstore.units imports re only)
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return text


def float_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type accepting finite numbers >= ``minimum`` (a pause that may be 0).

    Returns:
        a function str -> float that raises argparse.ArgumentTypeError for a non-number,
        an infinite or NaN value, or one below ``minimum``.
    """
    def check(text: str) -> float:
        value = _float(text)
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {value:g}")
        return value
    check.__name__ = f"float_at_least_{minimum:g}"
    return check


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of integers >= ``minimum`` (empty: no items).

    Returns:
        a function str -> list[int] that raises argparse.ArgumentTypeError naming the first
        item that is not an integer or is below ``minimum``.
    """
    one = int_at_least(minimum)

    def check(text: str) -> list[int]:
        return [one(x.strip()) for x in text.split(",") if x.strip()]
    check.__name__ = f"int_list_{minimum}"
    return check
