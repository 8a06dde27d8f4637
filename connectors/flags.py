"""The ``--kvstore-*`` command-line flags of an engine's server and the connector they ask for.

``add_store_args(parser)`` adds the flags (sizes accept ``512MiB``, ``2GiB``, bytes: see
``parse_size``); ``connector_from_args(args)`` checks their combination and builds the
``EngineMinConnector`` (through ``connectors.factory.create_connector``, imported only when a
store flag is given), or returns None when no store flag is set. The engine's command line
calls both; it reaches the store only through them.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from kvstore import units
from kvstore.defaults import DEFAULT_CHUNK_SIZE

if TYPE_CHECKING:
    from connectors.engine_min import EngineMinConnector

__all__ = ["REMOTE_FLAGS", "STORE_FLAGS", "SizeError", "StoreFlagError", "add_store_args",
           "connector_from_args", "parse_size", "positive_seconds", "remote_options", "seconds"]

#: The flags (as ``argparse`` attribute names) that each name a store; none set = no store.
STORE_FLAGS = ("kvstore_cpu_bytes", "kvstore_disk_path", "kvstore_disk_bytes", "kvstore_url",
               "kvstore_remote_url")
#: The remote tier's flags (``argparse`` attribute names) -> ``StoreSpec`` fields.
REMOTE_FLAGS = {"kvstore_remote_url": "remote_url",
                "kvstore_remote_key_prefix": "remote_key_prefix",
                "kvstore_remote_ttl_s": "remote_ttl_s",
                "kvstore_remote_timeout_s": "remote_timeout_s"}


class StoreFlagError(ValueError):
    """Store flags that do not go together (the message names the flags)."""


class SizeError(argparse.ArgumentTypeError, ValueError):
    """A byte size that does not parse: ``argparse`` prints its reason after the flag's name
    (a plain ValueError would print only "invalid parse_size value"); still a ValueError."""


def parse_size(value: str | int) -> int:
    """``kvstore.units.parse_size`` as an ``argparse`` type: bytes named by ``value``
    (``4096``, ``"512MiB"``, ``"2GiB"``).

    Raises:
        SizeError: negative, not a number, an unknown unit or a fraction of a byte, with the
            reason and examples.
    """
    try:
        return units.parse_size(value)
    except ValueError as e:
        raise SizeError(str(e)) from None


def seconds(value: str) -> float:
    """A finite number of seconds >= 0, as an ``argparse`` type (else ``ArgumentTypeError``)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: give a finite number of seconds >= 0")
    return x


def positive_seconds(value: str) -> float:
    """A finite number of seconds > 0, as an ``argparse`` type (else ``ArgumentTypeError``)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: give a finite number of seconds > 0")
    return x


def add_store_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the ``--kvstore-*`` flags to ``parser`` as one argument group; returns the group.

    The auth token defaults to ``$KVSTORE_AUTH_TOKEN`` (read when the flags are added)."""
    s = parser.add_argument_group("kv store (off unless one of these is given)")
    s.add_argument("--kvstore-cpu-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="in-process store: CPU tier bytes")
    s.add_argument("--kvstore-disk-path", default=None, metavar="DIR",
                   help="in-process store: disk tier directory")
    s.add_argument("--kvstore-disk-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="in-process store: disk tier bytes (needs --kvstore-disk-path)")
    s.add_argument("--kvstore-url", default=None, metavar="URL",
                   help="remote store daemon (kvstore serve), e.g. http://127.0.0.1:8500, or "
                   "unix:///PATH (its --unix-socket; an http:// daemon on this host that has "
                   "one is used through it by itself)")
    s.add_argument("--kvstore-auth-token", default=os.environ.get("KVSTORE_AUTH_TOKEN"),
                   metavar="TOKEN", help="bearer token of a daemon started with --auth-token "
                   "(default $KVSTORE_AUTH_TOKEN; the flag needs --kvstore-url)")
    s.add_argument("--kvstore-chunk-size", type=int, default=None, metavar="N",
                   help="tokens per store chunk (a multiple of the block size; default "
                   f"{DEFAULT_CHUNK_SIZE}); needs a store")
    s.add_argument("--kvstore-tail-chunk-size", type=int, default=None, metavar="N",
                   help="also store a prompt's tokens past its last full chunk as pieces of N "
                   "tokens (a multiple of the block size dividing the chunk size), so a hit "
                   "recomputes < N tokens instead of up to a chunk (default: the engine's "
                   "block size, when it divides the chunk size); 0 = off (full chunks only)")
    s.add_argument("--kvstore-lossy-codec", default=None, choices=("kivi", "int8", "fp8"),
                   help="store this engine's chunks lossily with this codec (about half of "
                   "fp16's bytes) in the in-process store's disk and remote tiers, and accept "
                   "it from a daemon started with --disk-codec/--remote-codec of the same "
                   "codec: its chunks get keys of their own (never shared with bit-exact "
                   "engines). Default: bit-exact only")
    s.add_argument("--kvstore-wire-codec", default=None, choices=("kivi", "int8", "fp8"),
                   help="also send this engine's chunks to and from the daemon (--kvstore-url, "
                   "over HTTP) encoded with this codec, about half the bytes on the network; "
                   "the daemon stores the decoded values. Must name the --kvstore-lossy-codec "
                   "(the daemon refuses a lossy codec for a namespace that does not accept "
                   "it). Default: bit-exact payloads")
    s.add_argument("--kvstore-layerwise-load", default="auto", choices=("auto", "on", "off"),
                   help="on: a step's loads are written layer by layer while the forward pass "
                   "runs (layer i's attention waits only for layer i); off: every layer is "
                   "written before it; auto (default): on when the engine runs on CUDA, off on "
                   "the CPU (where the copies take the cores the forward pass needs)")
    s.add_argument("--kvstore-deadline-s", type=positive_seconds, default=None,
                   metavar="SECONDS", help="longest wait of a prefix lookup, and base wait of a "
                   "step's loads; a later answer is a miss and the prefix is recomputed "
                   "(default 0.5)")
    s.add_argument("--kvstore-deadline-s-per-chunk", type=seconds, default=None,
                   metavar="SECONDS", help="extra load wait per chunk loaded in a step (default "
                   "0.05); raise both on a slow or loaded host, where a late load is thrown "
                   "away and recomputed")
    s.add_argument("--kvstore-remote-url", default=None, metavar="URL",
                   help="in-process store: a remote tier in Redis below its tiers, shared by "
                   "every engine pointing at it: redis://HOST:PORT (standalone or a cluster "
                   "seed), redis://H1:P1,H2:P2 (cluster), rediss:// (TLS); password from "
                   "$KVSTORE_REMOTE_PASSWORD. Alone: with a 1GiB CPU tier. With only "
                   "--kvstore-url, give the daemon --remote-url instead")
    s.add_argument("--kvstore-remote-key-prefix", default=None, metavar="PREFIX",
                   help="deployment prefix of every Redis key (default kvstore)")
    s.add_argument("--kvstore-remote-ttl-s", type=float, default=None, metavar="SECONDS",
                   help="seconds a value lives in Redis after its last write or read "
                   "(default 0: no expiry)")
    s.add_argument("--kvstore-remote-timeout-s", type=float, default=None, metavar="SECONDS",
                   help="deadline of the wait for Redis's answers in a remote lookup (a get "
                   "adds time per GiB; decoding runs after it); a late Redis node's keys miss "
                   "(default 0.25)")
    return s


def connector_from_args(args: argparse.Namespace) -> EngineMinConnector | None:
    """The connector of the store flags (``kvstore_cpu_bytes``, ``kvstore_disk_path``,
    ``kvstore_disk_bytes``, ``kvstore_url``, ``kvstore_remote_*``, ``kvstore_chunk_size``,
    optional ``kvstore_deadline_s`` and ``kvstore_deadline_s_per_chunk``, ``kvstore_auth_token`` and ``kvstore_tail_chunk_size``:
    None or absent = pieces of the engine's block size, 0 = off; ``kvstore_lossy_codec``,
    ``kvstore_wire_codec``, ``kvstore_layerwise_load``: ``auto``/``on``/``off``), or None when
    no store flag is set.

    The store is in-process tiers (cpu bytes, disk path and bytes, a remote tier in Redis), a
    remote daemon (url), or both (local tiers in front of the daemon).

    Raises:
        StoreFlagError: a chunk size, tail chunk size, codec, deadline, layer-wise setting
            (``on``/``off``) or remote-tier setting without a store, an auth token flag
            without a daemon URL, disk bytes
            without a disk path, a wire codec without a daemon or other than the lossy
            codec, a remote URL with only a daemon, a remote URL that does not parse.
        ValueError: as ``connectors.factory.create_connector`` (a bad URL, size or chunk size;
            ``kvstore.tiers.redis_nodes.RemoteConfigError``: Redis unreachable or the password
            refused).
        OSError: a disk path that cannot be opened (a file, not writable).
    """
    opts = {k: getattr(args, f"kvstore_{k}", None)
            for k in ("cpu_bytes", "disk_path", "disk_bytes", "url")}
    remote = remote_options(args)
    _check_auth_token(args, opts["url"])
    if all(v is None for v in opts.values()) and not remote:
        for flag in ("chunk_size", "tail_chunk_size", "lossy_codec", "wire_codec",
                     "layerwise_load", "deadline_s", "deadline_s_per_chunk"):
            v = getattr(args, f"kvstore_{flag}", None)
            if v not in (None, "", "auto") and not (v == 0 and flag != "chunk_size"):
                raise StoreFlagError(f"--kvstore-{flag.replace('_', '-')} needs a store: "
                                     "--kvstore-cpu-bytes, --kvstore-disk-path, --kvstore-url "
                                     "or --kvstore-remote-url")   # (not ignored)
        return None
    if opts["disk_bytes"] and not opts["disk_path"]:
        raise StoreFlagError("--kvstore-disk-bytes needs --kvstore-disk-path")
    if remote and opts["url"] and not (opts["cpu_bytes"] or opts["disk_path"]):
        raise StoreFlagError("--kvstore-remote-url adds a tier to the in-process store, but "
                             "--kvstore-url names only a daemon: start the daemon with "
                             "kvstore serve --remote-url instead (or add --kvstore-cpu-bytes)")
    _check_wire_codec(args, opts["url"])
    if remote:
        opts["remote"] = remote
    extra = {}
    for k in ("chunk_size", "deadline_s", "deadline_s_per_chunk", "auth_token",
              "tail_chunk_size", "lossy_codec", "wire_codec"):
        v = getattr(args, f"kvstore_{k}", None)
        if v is not None:
            extra[k] = v
    layerwise = getattr(args, "kvstore_layerwise_load", None) or "auto"
    if layerwise != "auto":
        extra["layerwise_load"] = layerwise == "on"
    from connectors.factory import create_connector
    return create_connector(**opts, **extra)


def _check_auth_token(args: argparse.Namespace, url: str | None) -> None:
    """A ``--kvstore-auth-token`` given on the command line (not only inherited from
    ``$KVSTORE_AUTH_TOKEN``) needs ``--kvstore-url``: only a daemon reads it. Raises
    ``StoreFlagError``."""
    token = getattr(args, "kvstore_auth_token", None)
    if token and url is None and token != os.environ.get("KVSTORE_AUTH_TOKEN"):
        raise StoreFlagError("--kvstore-auth-token needs --kvstore-url (only a kvstore daemon "
                             "reads it)")


def _check_wire_codec(args: argparse.Namespace, url: str | None) -> None:
    """Raises StoreFlagError: ``--kvstore-wire-codec`` without ``--kvstore-url`` or naming
    another codec than ``--kvstore-lossy-codec`` (it would never be used)."""
    wire = getattr(args, "kvstore_wire_codec", None)
    if not wire:
        return
    if not url:
        raise StoreFlagError("--kvstore-wire-codec encodes chunks to and from a daemon: it "
                             "needs --kvstore-url")
    lossy = getattr(args, "kvstore_lossy_codec", None)
    if wire != lossy:
        raise StoreFlagError(f"--kvstore-wire-codec {wire} needs --kvstore-lossy-codec {wire} "
                             f"(got {lossy or 'none'}): the daemon sends and takes a lossy codec "
                             "only for chunks whose namespace accepts it")


def remote_options(args: argparse.Namespace) -> dict:
    """The remote tier's settings given by ``args`` as ``StoreSpec`` fields (``{}``: no remote
    tier), checked without connecting to Redis.

    Raises:
        StoreFlagError: a remote-tier setting without ``--kvstore-remote-url``, a URL that does
            not parse, a negative TTL or a non-positive timeout (never showing the password).
    """
    given = {field: getattr(args, flag, None) for flag, field in REMOTE_FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return {}
    if not given.get("remote_url"):
        names = ", ".join("--" + f.replace("_", "-") for f, k in REMOTE_FLAGS.items()
                          if k in given)
        raise StoreFlagError(f"{names} needs --kvstore-remote-url")
    from kvstore.tiers.redis_url import parse_redis_url
    try:
        parse_redis_url(given["remote_url"], env={})
    except ValueError as e:
        raise StoreFlagError(f"--kvstore-remote-url: {e}") from None
    ttl, timeout = given.get("remote_ttl_s", 0.0), given.get("remote_timeout_s", 1.0)
    if not ttl >= 0 or not 0 < timeout < float("inf"):
        raise StoreFlagError(f"--kvstore-remote-ttl-s must be >= 0 and --kvstore-remote-timeout-s "
                             f"a positive number of seconds, got {ttl} and {timeout}")
    return given
