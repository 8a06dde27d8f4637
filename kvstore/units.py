"""Byte sizes as text: ``"8GiB"`` -> 8589934592 and back.

Suffixes: ``B``; decimal ``KB MB GB TB`` (powers of 1000); binary ``KiB MiB GiB TiB`` and the
bare letters ``K M G T`` (powers of 1024, as memory tools use them). Case-insensitive, an optional
space between number and unit, and a fractional number is allowed (``"1.5GiB"``).
"""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes named by ``value`` (an int passes through).

    Raises:
        ValueError: negative, not a number, an unknown unit, or a fraction of a byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != int(value):
            raise ValueError(f"byte size must be a whole number >= 0, got {value}")
        return int(value)
    m = _PATTERN.match(str(value))
    if not m:
        raise ValueError(f"not a byte size: {value!r} (examples: 4096, '512MiB', '8GiB', '2GB')")
    number, unit = m.groups()
    mult = _UNITS.get(unit.lower())
    if mult is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use one of "
                         f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T")
    num_bytes = float(number) * mult
    if num_bytes != int(num_bytes):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(num_bytes)


def format_size(num_bytes: int) -> str:
    """Human text for a byte count with binary units: 1536 -> ``"1.5KiB"``, 8 * 2**30 -> ``"8GiB"``."""
    if num_bytes < 0:
        raise ValueError(f"byte size must be >= 0, got {num_bytes}")
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= mult:
            try:
                text = f"{num_bytes / mult:.2f}".rstrip("0").rstrip(".")
            except OverflowError:  # past a float's range (a hostile layout's chunk size)
                text = str(num_bytes // mult)
            return f"{text}{unit}"
    return f"{num_bytes}B"
