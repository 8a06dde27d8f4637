"""The ``KVSTORE_*`` environment variables of ``kvstore serve``: which ones name settings, and
each value parsed to its setting's type, so that a value that cannot be parsed is refused with
the variable's name and value (``KVSTORE_CPU_BYTES='12XB': unknown size unit ...``) instead of
a message that leaves the reader to guess where ``'12XB'`` came from.

Checks that involve more than one setting (a disk capacity without a path, a non-loopback bind
without a token) stay in ``kvstore.daemon.config.ServeConfig``; ``remote_without_url`` names
the remote-tier settings given, by any layer, without a remote URL.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable, Mapping

from kvstore.units import parse_size

ENV_PREFIX = "KVSTORE_"

#: ``KVSTORE_*`` variables that are not ``kvstore serve`` settings but are read elsewhere in
#: this project (the config file's path; the vLLM benchmarks' converted model folder)
OTHER_ENV = frozenset({ENV_PREFIX + "CONFIG", ENV_PREFIX + "VLLM_MODEL_DIR"})


class EnvValueError(ValueError):
    """One or more ``KVSTORE_*`` variables whose value cannot be parsed; the message names each
    variable and its value."""


def to_bool(v: Any) -> bool:
    """``True`` for ``1/true/yes/on``, ``False`` for ``0/false/no/off`` and empty text
    (case-insensitive); a bool passes through.

    Raises:
        ValueError: anything else.
    """
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {v!r} (use 1/0, true/false, yes/no, on/off)")


def _number(typ: type, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return typ(text)
        except ValueError:
            raise ValueError(f"not {what}") from None
    return parse


def _or_auto(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: "auto" if text.strip().lower() == "auto" else parse(text)


def _one_of(choices: Callable[[], Iterable[str]], fold: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        known = list(choices())
        if (text.lower() if fold else text) not in known:
            raise ValueError(f"choose one of {', '.join(known)}")
        return text
    return parse


def _policies() -> Iterable[str]:
    from kvstore.eviction import POLICIES
    return sorted(POLICIES)


def _admissions() -> Iterable[str]:
    from kvstore.eviction import ADMISSIONS
    return ADMISSIONS


def _codecs() -> Iterable[str]:
    from kvstore.config import DISK_CODECS
    return DISK_CODECS


_INT = _number(int, "a whole number")
_FLOAT = _number(float, "a number")

#: how the text of each typed setting's variable is parsed (settings not listed are text)
PARSERS: dict[str, Callable[[str], Any]] = {
    **{name: parse_size for name in ("cpu_bytes", "gpu_bytes", "disk_bytes", "page_bytes",
                                     "max_body_bytes", "remote_queue_bytes")},
    "max_inflight_bytes": _or_auto(parse_size),
    **{name: _INT for name in ("port", "max_batch_keys", "max_namespaces")},
    "max_connections": _or_auto(_INT),
    **{name: _FLOAT for name in ("request_timeout_s", "max_lease_s", "shutdown_timeout_s",
                                 "idle_timeout_s", "remote_ttl_s", "remote_timeout_s",
                                 "remote_restart_check_s", "persist_on_shutdown_s")},
    "insecure": to_bool,
    "disk_shrink": to_bool,
    "policy": _one_of(_policies),
    "admission": _one_of(_admissions),
    "log_level": _one_of(lambda: ("debug", "info", "warning", "error", "critical"), fold=True),
    "http_parser": _one_of(lambda: ("python", "c")),
    "disk_codec": _one_of(_codecs),
    "remote_codec": _one_of(_codecs),
}


def env_name(field_name: str) -> str:
    """The variable of a setting: ``cpu_bytes`` -> ``KVSTORE_CPU_BYTES``."""
    return ENV_PREFIX + field_name.upper()


def from_env(env: Mapping[str, str], field_names: Iterable[str]) -> dict:
    """Settings given by ``KVSTORE_<FIELD>`` variables (``KVSTORE_CONFIG`` excluded), each
    parsed to its type (``"8GiB"`` -> 8589934592, ``"8501"`` -> 8501; text settings as given).

    Raises:
        EnvValueError: a value that cannot be parsed, naming the variable and the value, e.g.
            ``KVSTORE_CPU_BYTES='12XB': unknown size unit 'XB' ...``; every bad variable is
            named, in name order, joined by `` | ``.
    """
    out, errors = {}, []
    for name in sorted(field_names):
        var = env_name(name)
        if var not in env:
            continue
        text = env[var]
        try:
            out[name] = PARSERS.get(name, str)(text)
        except ValueError as e:
            errors.append(f"{var}={text!r}: {e}")
    if errors:
        raise EnvValueError(" | ".join(errors))
    return out


def unknown_env(env: Mapping[str, str],
                field_names: Iterable[str]) -> list[tuple[str, str | None]]:
    """``(name, closest setting variable or None)`` of each ``KVSTORE_*`` variable in ``env``
    that names no setting (a typo such as ``KVSTORE_POLCY`` would otherwise be ignored
    silently), in name order."""
    known = {env_name(name) for name in field_names}
    out = []
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known and name not in OTHER_ENV:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            out.append((name, close[0] if close else None))
    return out


#: remote-tier settings that mean nothing without ``remote_url`` (``remote_password``, which
#: may be set fleet-wide, is only warned about)
REMOTE_NEEDS_URL = ("remote_key_prefix", "remote_ttl_s", "remote_timeout_s",
                    "remote_queue_bytes", "remote_codec", "remote_restart_check_s")


def remote_without_url(file: Mapping[str, Any], env: Mapping[str, Any],
                       flags: Mapping[str, Any]) -> tuple[list[str], bool]:
    """Remote-tier settings given while no layer gives a remote URL (they would be ignored
    silently: no remote tier is built).

    Args:
        file, env, flags: the settings each layer gives (field name -> value; a flag of
            None is not given), as ``kvstore.daemon.config.resolve`` merges them.

    Returns:
        (where each setting of ``REMOTE_NEEDS_URL`` was given, named as its user wrote it:
        ``--remote-key-prefix``, ``KVSTORE_REMOTE_TTL_S``, ``remote_codec (config file)``;
        whether a ``remote_password`` is set), both empty/False when a layer gives a non-empty
        ``remote_url`` (a layer above that empties it disables the tier deliberately).
    """
    layers = (("file", file), ("env", env), ("flag", flags))
    if any(layer.get("remote_url") not in (None, "") for _, layer in layers):
        return [], False
    given = []
    for kind, layer in layers:
        for name in REMOTE_NEEDS_URL:
            if layer.get(name) is None:
                continue
            given.append({"file": f"{name} (config file)", "env": env_name(name),
                          "flag": "--" + name.replace("_", "-")}[kind])
    return given, any(layer.get("remote_password") not in (None, "") for _, layer in layers)
