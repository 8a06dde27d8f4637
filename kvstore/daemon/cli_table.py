"""Text tables of the ``kvstore`` command line (``stats``, ``inspect``): a nested dict shown as
two columns, keys flattened to ``a.b``, byte counts also as ``8GiB``."""
from __future__ import annotations

from typing import Any

from kvstore.units import format_size


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"a": {"b": 1}}`` -> ``[("a.b", 1)]`` (lists of scalars stay whole)."""
    if isinstance(obj, dict):
        rows = []
        for k in obj:
            rows += flatten(obj[k], f"{prefix}.{k}" if prefix else str(k))
        return rows
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        rows = []
        for i, x in enumerate(obj):
            rows += flatten(x, f"{prefix}[{i}]")
        return rows
    return [(prefix, obj)]


def _fmt(name: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if name.endswith("bytes") and isinstance(value, int):
        return f"{value:,} ({format_size(value)})" if value >= 1024 else f"{value}"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not name.endswith("pid"):  # a pid is an id: kill/grep it
        return f"{value:,}"
    return str(value)


def _label(name: str, notes: dict[str, str]) -> str:
    """``name`` with its note: ``hits (get: chunks returned)``; ``hits_by_tier.cpu`` takes the
    note of ``hits``."""
    head = name.rpartition(".")[0]
    note = notes.get(name)
    if note is None and head.endswith("_by_tier"):
        note = notes.get(head.removesuffix("_by_tier"))
    return f"{name} ({note})" if note else name


def format_table(obj: dict, notes: dict[str, str] | None = None) -> str:
    """Two-column text table of a nested dict (keys flattened to ``a.b``); byte fields also
    shown as ``8GiB``; a key in ``notes`` (or a ``<counter>_by_tier.<tier>`` key whose
    counter is) gets its note after it, in parentheses."""
    rows = [(_label(k, notes or {}), _fmt(k, v)) for k, v in flatten(obj)]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
