"""The ``kvstore`` commands that talk to a running daemon: ``stats URL`` and ``clear URL``
(their arguments, the ``--namespace`` reader, the table notes of ``stats``).

They call the daemon's HTTP routes through ``kvstore.daemon.transport`` (its deadlines,
retries and fast failures), not through ``KVStoreClient``, so that they import neither torch
nor the store: ``kvstore stats`` answers in a fraction of a second. ``clear --namespace``
checks the namespace with ``kvstore.ns_wire`` (plain JSON, the rules of ``kvstore.keys``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
from typing import Any

from kvstore.daemon.cli_table import format_table


class UsageError(ValueError):
    """A flag's value cannot be used; ``kvstore`` prints ``kvstore CMD: error: MESSAGE``
    and exits 2, as argparse does for a flag it cannot parse."""


class SubcommandErrorsParser(argparse.ArgumentParser):
    """The top ``kvstore`` parser: an argument after a subcommand that the subcommand does not
    know is reported by that subcommand's parser (``usage: kvstore clear ...``, ``kvstore
    clear: error: unrecognized arguments: --x``, exit 2), not with the top-level usage as plain
    argparse reports it. Set ``subcommands`` to the ``add_subparsers`` action."""

    subcommands: Any = None

    def parse_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            argv = list(sys.argv[1:] if args is None else args)
            cmd = getattr(ns, "cmd", None)
            choices = self.subcommands.choices if self.subcommands is not None else {}
            after = cmd in argv and extras[0] not in argv[:argv.index(cmd)]
            reporter = choices[cmd] if after and cmd in choices else self
            reporter.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


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
            which = p.add_mutually_exclusive_group()
            which.add_argument("--all", action="store_true",
                               help="clear every namespace (with a remote tier, the shared "
                                    "Redis too); an admin token")
            which.add_argument("--namespace", help="clear only this namespace (JSON of "
                                                   "Namespace.to_dict(), or @FILE)")
            which.add_argument("--namespace-id", type=namespace_id, metavar="HEX",
                               help="clear only the namespace of this id (its ns_id in "
                                    "`kvstore stats`: 32 hex digits), also one known from "
                                    "disk only (no request named it since the daemon "
                                    "started), which only an admin token may clear")
            p.add_argument("--json", action="store_true",
                           help='one JSON object instead of a line: {"removed": N, '
                                '"cleared": "namespace"|"ns_id"|"all", "ns_id": HEX or null}')


_NS_ID = re.compile(r"[0-9a-f]{32}")


def namespace_id(text: str) -> str:
    """argparse type of ``--namespace-id``: a namespace id, 32 hex digits (16 bytes), as
    ``kvstore stats`` shows it; returned in lowercase.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if not _NS_ID.fullmatch(value):
        raise argparse.ArgumentTypeError(f"expected a namespace id of 32 hex digits (ns_id "
                                         f"in `kvstore stats`), got {text!r}")
    return value


def read_namespace(text: str) -> dict:
    """The namespace of ``--namespace`` in its canonical wire form (``Namespace.to_dict()``,
    computed without torch: ``kvstore.ns_wire.wire_namespace``), from JSON of a namespace or
    ``@FILE`` holding it.

    Raises:
        UsageError: the file cannot be read, the text is not a JSON object, or a field is
            unknown (a typo), missing or bad (the message names the file or the field).
    """
    from kvstore.ns_wire import wire_namespace
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
        return wire_namespace(d)   # (an unknown field, a typo, is refused naming it)
    except KeyError as e:  # model_id and layout, or a field of the layout
        field = e.args[0]
        where = "namespace" if field in ("model_id", "layout") else 'namespace "layout"'
        raise UsageError(f'--namespace: {where} needs "{field}"') from None
    except (TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"--namespace: {e}") from None


def call_daemon(args: argparse.Namespace, path: str, body: dict | None = None) -> Any:
    """One call of ``kvstore stats``/``clear`` to the daemon at ``args.url``: ``GET path``
    (``body`` None) or ``POST path`` with JSON ``body``; the answer's JSON. Idempotent calls
    only (retried inside ``args.timeout_s`` seconds, as ``KVStoreClient``'s).

    Raises:
        ValueError: a malformed URL (``kvstore.daemon.transport.check_url``).
        StoreUnavailable: no answer in time, refused, a host name that does not resolve.
        RemoteError: an error answer (``NotADaemon``: something else answered).
    """
    from kvstore.daemon.transport import Transport, error_text
    from kvstore.errors import RemoteError
    http = Transport(args.url, auth_token=args.auth_token, timeout_s=args.timeout_s,
                     pool_size=1)

    async def handle(resp):
        if resp.status == 404:
            raise RemoteError(404, await error_text(resp))
        return await resp.json()

    async def run() -> Any:
        try:
            if body is None:
                return await http.call("GET", path, handle, idempotent=True, timeout_s=None)
            return await http.post_json(path, json.dumps(body).encode(), idempotent=True,
                                        timeout_s=None)
        finally:
            await http.close()
    return asyncio.run(run())


def cmd_stats(args: argparse.Namespace) -> int:
    """``kvstore stats URL``: the daemon's ``/v1/stats`` as a table (or ``--json``)."""
    from kvstore.errors import RemoteError, StoreUnavailable
    try:
        st = call_daemon(args, "/v1/stats")
    except (StoreUnavailable, RemoteError) as e:
        print(f"kvstore stats: {failure_text(e, args)}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2, sort_keys=True) if args.json
          else format_table(readable_codecs(readable_namespaces(st)), notes=STAT_NOTES))
    return 0


def readable_codecs(st: dict) -> dict:
    """``st`` (a ``/v1/stats`` answer) for the table: ``tier_codecs`` without lower tiers
    (``{}``) reads ``none (memory tiers only)``, unknown (null) ``unknown``, and
    ``wire_codecs`` as one comma-separated line."""
    out = dict(st)
    if "tier_codecs" in out and not out["tier_codecs"]:
        out["tier_codecs"] = "unknown" if out["tier_codecs"] is None \
            else "none (memory tiers only)"
    if isinstance(out.get("wire_codecs"), list):
        out["wire_codecs"] = ", ".join(map(str, out["wire_codecs"]))
    return out


def unknown_namespace_label(ns_id) -> str:
    """The table's text for a namespace the daemon knows by its id only: from chunks on disk
    after a restart, or one that left the daemon's list of recently named namespaces."""
    return f"(fields unknown: no request named it lately; clear: --namespace-id {ns_id})"


def readable_namespaces(st: dict) -> dict:
    """``st`` (a ``/v1/stats`` answer) for the table: a namespace whose fields the daemon does
    not know (``"namespace": null``: its chunks are on disk from before a restart and no
    request named it since) reads as ``unknown_namespace_label`` gives."""
    namespaces = st.get("namespaces")
    if not isinstance(namespaces, list):
        return st
    shown = [{**n, "namespace": unknown_namespace_label(n.get("ns_id"))}
             if isinstance(n, dict) and n.get("namespace", "") is None else n
             for n in namespaces]
    return {**st, "namespaces": shown}


#: what a ``/v1/stats`` counter counts, shown after its name in ``kvstore stats``'s table:
#: ``lookups`` count prefix lookups and their tokens, while ``hits``/``misses`` count the chunks
#: of get calls (``kvstore.metrics``, ``kvstore.tiers.remote_metrics``); ``*_by_tier.<tier>``
#: rows take their counter's note
STAT_NOTES = {
    "num_namespaces": "named by requests since start (namespaces[] also lists those on disk)",
    "evictions": "per tier left (also when a lower tier keeps it)",
    "dropped_chunks": "evicted out of every tier",
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
    "tier_codecs.disk": "lossy: only namespaces accepting it",
    "tier_codecs.remote": "lossy: only namespaces accepting it",
    "wire_codecs": "X-KVStore-Wire-Codec",
}


def cmd_clear(args: argparse.Namespace) -> int:
    """``kvstore clear URL (--namespace NS | --namespace-id HEX | --all) [--json]``: delete one
    namespace's chunks, or all (``POST /v1/clear``); naming none is a usage error. Prints
    ``removed N chunks``, or with ``--json`` the object of ``clear_result``."""
    from kvstore.errors import RemoteError, StoreUnavailable
    if args.namespace:
        body = {"namespace": read_namespace(args.namespace)}
    elif getattr(args, "namespace_id", None):
        body = {"ns_id": args.namespace_id}
    elif getattr(args, "all", False):
        body = {"all": True}
    else:  # a bare `kvstore clear URL` used to empty everything, fleet-wide with Redis
        raise UsageError("name what to clear: --namespace NS, --namespace-id HEX, or --all "
                         "(every namespace; with a remote tier, the shared Redis too)")
    try:
        n = call_daemon(args, "/v1/clear", body)["removed"]
    except (StoreUnavailable, RemoteError) as e:
        print(f"kvstore clear: {failure_text(e, args)}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(clear_result(body, n), sort_keys=True))
    else:
        print(f"removed {n} chunks" + (" (all namespaces)" if "all" in body else ""))
    return 0


def clear_result(body: dict, removed: int) -> dict:
    """``kvstore clear --json``'s object: ``removed`` (chunks deleted), ``cleared`` (what was
    named: ``"namespace"``, ``"ns_id"`` or ``"all"``) and ``ns_id`` (32 hex digits of the
    namespace cleared; None for ``--all``)."""
    from kvstore.ns_wire import namespace_digest
    if "namespace" in body:
        return {"removed": removed, "cleared": "namespace",
                "ns_id": namespace_digest(body["namespace"])[:16].hex()}
    if "ns_id" in body:
        return {"removed": removed, "cleared": "ns_id", "ns_id": body["ns_id"]}
    return {"removed": removed, "cleared": "all", "ns_id": None}


def failure_text(error: Exception, args: argparse.Namespace) -> str:
    """The one line ``kvstore stats``/``clear`` print for a failed call (exit 1): the error,
    and for a 401 (no token, or a wrong one) how to give the daemon's token."""
    text = str(error)
    if getattr(error, "status", None) == 401:
        if args.auth_token:
            text += ("; the token given (--auth-token, else $KVSTORE_AUTH_TOKEN) is not the "
                     "daemon's")
        else:
            text += ("; no token was given: pass --auth-token TOKEN or set "
                     "$KVSTORE_AUTH_TOKEN (the daemon's --auth-token, or a --tenants-file token)")
    return text
