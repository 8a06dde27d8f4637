"""The ``kvstore`` commands that talk to a running daemon: ``stats URL`` and ``clear URL``
(their arguments, the ``--namespace`` reader, the table notes of ``stats``)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from kvstore.daemon.cli_table import format_table


class UsageError(ValueError):
    """A flag's value cannot be used; ``kvstore`` prints ``kvstore CMD: error: MESSAGE``
    and exits 2, as argparse does for a flag it cannot parse."""


def positive_seconds(text: str) -> float:
    """argparse type of ``--timeout-s``: a finite number of seconds > 0.

    Raises:
        argparse.ArgumentTypeError: not a number, 0, negative, infinite or NaN.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def add_client_parsers(sub) -> None:
    """The ``stats`` and ``clear`` subcommands of ``kvstore``."""
    for name, text in (("stats", "print a running server's statistics as a table"),
                       ("clear", "delete chunks on a running server")):
        p = sub.add_parser(name, help=text)
        p.add_argument("url", help="server URL, e.g. http://127.0.0.1:8500")
        p.add_argument("--auth-token", default=os.environ.get("KVSTORE_AUTH_TOKEN"),
                       help="the server's bearer token (default $KVSTORE_AUTH_TOKEN)")
        p.add_argument("--timeout-s", type=positive_seconds, default=5.0,
                       help="seconds to wait for the answer (> 0; default 5)")
        if name == "stats":
            p.add_argument("--json", action="store_true", help="raw JSON instead of a table")
        else:
            p.add_argument("--namespace", help="clear only this namespace (JSON of "
                                               "Namespace.to_dict(), or @FILE); default: all")


def read_namespace(text: str):
    """The ``Namespace`` of ``--namespace``: JSON of ``Namespace.to_dict()``, or ``@FILE``
    holding it.

    Raises:
        UsageError: the file cannot be read, the text is not a JSON object, or a field is
            missing or bad (the message names the file or the field).
    """
    from kvstore.keys import Namespace
    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--namespace: cannot read {text[1:]}: {e}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--namespace: not JSON: {e}") from None
    if not isinstance(d, dict):
        raise UsageError(f"--namespace: expected a JSON object (Namespace.to_dict()), got "
                         f"{type(d).__name__}")
    try:
        return Namespace.from_dict(d)
    except KeyError as e:  # model_id and layout, or a field of the layout
        field = e.args[0]
        where = "namespace" if field in ("model_id", "layout") else 'namespace "layout"'
        raise UsageError(f'--namespace: {where} needs "{field}"') from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--namespace: {e}") from None


def _client(args):
    from kvstore.daemon.client import KVStoreClient
    return KVStoreClient(args.url, auth_token=args.auth_token, timeout_s=args.timeout_s)


def cmd_stats(args: argparse.Namespace) -> int:
    """``kvstore stats URL``: the daemon's ``/v1/stats`` as a table (or ``--json``)."""
    from kvstore.daemon.client import RemoteError, StoreUnavailable
    try:
        with _client(args) as c:
            st = c.stats()
    except (StoreUnavailable, RemoteError) as e:
        print(f"kvstore stats: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2, sort_keys=True) if args.json
          else format_table(st, notes=STAT_NOTES))
    return 0


#: what a ``/v1/stats`` counter counts, shown after its name in ``kvstore stats``'s table:
#: ``lookups`` count prefix lookups and their tokens, while ``hits``/``misses`` count the chunks
#: of get calls (``kvstore.metrics``, ``kvstore.tiers.remote_metrics``); ``*_by_tier.<tier>``
#: rows take their counter's note
STAT_NOTES = {
    "lookups": "prefix lookups",
    "requested_tokens": "lookup: tokens asked",
    "hit_tokens": "lookup: leading tokens found",
    "hits": "get: chunks returned",
    "misses": "get: chunks not returned",
    "remote.lookups": "lookup: chunks probed",
    "remote.lookup_hits": "lookup: chunks found",
    "remote.reads": "get: chunks asked",
    "remote.hits": "get: chunks read",
    "remote.misses": "get: chunks not served",
}


def cmd_clear(args: argparse.Namespace) -> int:
    """``kvstore clear URL [--namespace NS]``: delete one namespace's chunks, or all."""
    from kvstore.daemon.client import RemoteError, StoreUnavailable
    ns = read_namespace(args.namespace) if args.namespace else None
    try:
        with _client(args) as c:
            n = c.clear(ns)
    except (StoreUnavailable, RemoteError) as e:
        print(f"kvstore clear: {e}", file=sys.stderr)
        return 1
    print(f"removed {n} chunks" + ("" if ns else " (all namespaces)"))
    return 0
