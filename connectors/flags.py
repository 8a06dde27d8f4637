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

__all__ = ["STORE_FLAGS", "SizeError", "StoreFlagError", "add_store_args",
           "connector_from_args", "parse_size"]

#: The flags (as ``argparse`` attribute names) that each name a store; none set = no store.
STORE_FLAGS = ("kvstore_cpu_bytes", "kvstore_disk_path", "kvstore_disk_bytes", "kvstore_url")


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
                   help="remote store daemon (kvstore serve), e.g. http://127.0.0.1:8500")
    s.add_argument("--kvstore-auth-token", default=os.environ.get("KVSTORE_AUTH_TOKEN"),
                   metavar="TOKEN", help="bearer token of a daemon started with --auth-token "
                   "(default $KVSTORE_AUTH_TOKEN)")
    s.add_argument("--kvstore-chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help="tokens per store chunk (a multiple of the block size; default %(default)s)")
    s.add_argument("--kvstore-tail-chunk-size", type=int, default=0, metavar="N",
                   help="also store a prompt's tokens past its last full chunk as pieces of N "
                   "tokens (a multiple of the block size dividing the chunk size), so a hit "
                   "recomputes < N tokens instead of up to a chunk; 0 (default) = off")
    return s


def connector_from_args(args: argparse.Namespace) -> EngineMinConnector | None:
    """The connector of the store flags (``kvstore_cpu_bytes``, ``kvstore_disk_path``,
    ``kvstore_disk_bytes``, ``kvstore_url``, ``kvstore_chunk_size``, optional
    ``kvstore_deadline_s``, ``kvstore_auth_token`` and ``kvstore_tail_chunk_size``), or None
    when no store flag is set.

    The store is in-process tiers (cpu bytes, disk path and bytes), a remote daemon (url), or
    both (local tiers in front of the daemon).

    Raises:
        StoreFlagError: a tail chunk size without a store, disk bytes without a disk path.
        ValueError: as ``connectors.factory.create_connector`` (a bad URL, size or chunk size).
        OSError: a disk path that cannot be opened (a file, not writable).
    """
    opts = {k: getattr(args, f"kvstore_{k}", None)
            for k in ("cpu_bytes", "disk_path", "disk_bytes", "url")}
    if all(v is None for v in opts.values()):
        if getattr(args, "kvstore_tail_chunk_size", 0):  # would be ignored silently
            raise StoreFlagError("--kvstore-tail-chunk-size needs a store: --kvstore-cpu-bytes, "
                                 "--kvstore-disk-path or --kvstore-url")
        return None
    if opts["disk_bytes"] and not opts["disk_path"]:
        raise StoreFlagError("--kvstore-disk-bytes needs --kvstore-disk-path")
    extra = {}
    for k in ("chunk_size", "deadline_s", "auth_token", "tail_chunk_size"):
        v = getattr(args, f"kvstore_{k}", None)
        if v is not None:
            extra[k] = v
    from connectors.factory import create_connector
    return create_connector(**opts, **extra)
