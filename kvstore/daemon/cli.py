"""``kvstore`` command line: ``serve``, ``stats URL``, ``clear URL``, ``inspect DISK_PATH``.

Exit codes: 0 success, 1 runtime failure (server unreachable, 401 or another error answer,
not a kvstore daemon at the URL), 2 bad usage, input or configuration (an unknown flag is
reported with its subcommand's usage), 130 interrupted (Ctrl-C; one line, no traceback), 141
stdout closed by its reader (``| head``; quiet, no traceback).

``stats`` and ``clear`` import neither torch nor the store (they start in a fraction of a
second); ``serve`` and ``inspect`` import what they need when they run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any, Sequence

from kvstore.daemon.cli_client import (STAT_NOTES, UsageError,  # noqa: F401 (re-exported)
                                       SubcommandErrorsParser, add_client_parsers, cmd_clear,
                                       cmd_stats)
from kvstore.daemon.cli_table import flatten, format_table  # noqa: F401 (re-exported)
from kvstore.defaults import DEFAULT_DISK_BYTES

log = logging.getLogger("kvstore.daemon.cli")


def __getattr__(name: str) -> Any:
    """``inspect_disk`` (the ``inspect`` command's, re-exported here), imported on first use:
    it imports torch, which ``stats`` and ``clear`` do without."""
    if name == "inspect_disk":
        from kvstore.disk_inspect import inspect_disk
        return inspect_disk
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _DiskCodecs:
    """``kvstore.config.DISK_CODECS`` as argparse ``choices``, read on first use (a bad value
    or ``serve --help``): that module imports torch. Give the argument a ``metavar``, or
    argparse reads the choices when the argument is added."""

    def _names(self) -> tuple[str, ...]:
        from kvstore.config import DISK_CODECS
        return DISK_CODECS

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __len__(self) -> int:
        return len(self._names())


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the shared KV-cache daemon",
                       description="Flags override KVSTORE_* environment variables, which "
                                   "override the --config file.")
    p.add_argument("--config", help="YAML or TOML settings file (also $KVSTORE_CONFIG)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8500; 0 = any free port)")
    p.add_argument("--cpu-bytes", help="CPU tier capacity, e.g. 8GiB (default 1GiB)")
    p.add_argument("--gpu-bytes", help="GPU tier capacity (default 0: no GPU tier)")
    p.add_argument("--device", help="device of the GPU tier (default cuda)")
    p.add_argument("--disk-path", help="lmdb directory of the disk tier")
    p.add_argument("--disk-bytes", help="disk tier capacity (default with --disk-path: "
                   f"{DEFAULT_DISK_BYTES}; no --disk-path: no disk tier)")
    p.add_argument("--disk-shrink", action="store_const", const=True,
                   help="when --disk-path holds more than --disk-bytes, evict down to it at "
                        "start (default: refuse to start)")
    p.add_argument("--disk-codec", choices=_DiskCodecs(), metavar="CODEC",
                   help="value codec of the disk tier: %(choices)s "
                        "(default auto: shuffle-lz4 where it saves "
                        "10%%); int8/fp8/kivi store about half of fp16's bytes, lossily, only for "
                        "namespaces whose lossy_codec names it (others: auto)")
    p.add_argument("--policy", help="eviction policy of every tier: lru (default), lfu, fifo, "
                                    "s3fifo, arc")
    p.add_argument("--admission", help="admission filter of the tiers: none (default) or tinylfu "
                                       "(a chunk enters a full tier only if requested more "
                                       "often lately than the chunk it would evict)")
    p.add_argument("--auth-token", help="bearer token clients must send on every route but "
                                        "/healthz and /readyz, /metrics included (also "
                                        "$KVSTORE_AUTH_TOKEN)")
    p.add_argument("--tenants-file",
                   help="YAML/TOML/JSON file of tenants: name -> {token, role (admin, tenant, "
                        "reader), salt}; each tenant's token may name only namespaces with its "
                        "salt (see kvstore.daemon.tenants)")
    p.add_argument("--page-bytes",
                   help="allocation unit of the memory tiers, a multiple of 64 (default 4KiB): "
                        "a chunk takes whole pages, so smaller pages waste less on small chunks")
    p.add_argument("--insecure", action="store_const", const=True,
                   help="allow a non-loopback bind without --auth-token or --tenants-file")
    p.add_argument("--log-level", help="debug, info, warning, error (default info)")
    p.add_argument("--max-body-bytes", help="largest request body (default 1GiB); larger -> "
                   "413. kvstore clients split larger puts into requests within it; a single "
                   "chunk larger than it cannot be stored (the client's error names both)")
    p.add_argument("--max-batch-keys", type=int, help="most keys per request (default 1024); "
                   "kvstore clients split larger calls")
    p.add_argument("--request-timeout-s", type=float, help="per-request limit (default 60)")
    p.add_argument("--max-lease-s", type=float, help="longest pin lease (default 300)")
    p.add_argument("--shutdown-timeout-s", type=float,
                   help="SIGTERM waits this long for in-flight requests (default 30)")
    p.add_argument("--persist-on-shutdown-s", type=float, metavar="SECONDS",
                   help="then SIGTERM/SIGINT spends up to this long writing the chunks only "
                        "the memory tiers hold to the disk tier, hottest first, into its free "
                        "room, so a restart on the same --disk-path keeps them (default 30; "
                        "0 = none; a SIGKILL writes nothing)")
    p.add_argument("--http-parser", choices=("python", "c"),
                   help="aiohttp's HTTP parser: python (default; passes body pieces through "
                        "without a copy, +15-20%% put throughput) or c")
    p.add_argument("--max-connections",
                   help="cap on open client connections; at the cap a new one closes the "
                        "oldest idle one (503 when all are busy). Default auto: the "
                        "file-descriptor limit minus max(64, limit/8) minus 64 (256 -> 128); "
                        "0 = no cap")
    p.add_argument("--idle-timeout-s", type=float,
                   help="close a connection that sends no complete request headers this long "
                        "after connecting or after its last response (default 30)")
    p.add_argument("--max-namespaces", type=int,
                   help="namespaces the store keeps checked at once; the least recently used "
                        "beyond are forgotten and counted (default 4096)")
    p.add_argument("--max-inflight-bytes",
                   help="payload bytes requests may hold at once; more wait (up to the "
                        "request timeout, then 503); CPU-tier chunks take none (read and sent in "
                        "place). Default auto: cpu+gpu bytes / 16, at least 32MiB; 0 = "
                        "unbounded")
    p.add_argument("--unix-socket",
                   help="also serve same-host clients on this Unix socket (unix:///PATH or "
                        "PATH; mode 0600, the daemon's user or root only): they map the CPU "
                        "arena read-only and copy chunks from it at memory speed")
    _remote_flags(p)


def _remote_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("remote tier (Redis shared by every daemon; docs/remote-tier.md)")
    g.add_argument("--remote-url",
                   help="redis://host:port (standalone or a cluster seed), "
                        "redis://h1:7000,h2:7000,h3:7000 (cluster startup nodes) or rediss:// "
                        "(TLS); the password comes from the URL (redis://:PASSWORD@host:port), "
                        "$KVSTORE_REMOTE_PASSWORD or the config file (remote_password), not "
                        "from a flag of its own. Default: no remote tier")
    g.add_argument("--remote-key-prefix",
                   help="deployment prefix of every Redis key, <prefix>:<namespace>:<hash> "
                        "(default kvstore)")
    g.add_argument("--remote-ttl-s", type=float,
                   help="seconds a value lives after its last write or read (default 0: no "
                        "expiry; Redis's maxmemory policy evicts)")
    g.add_argument("--remote-timeout-s", type=float,
                   help="deadline of the wait for Redis's answers in a remote lookup, in seconds "
                        "(a get adds time per GiB; decoding runs after it); a late node's keys "
                        "miss, counted in kvstore_remote_late_total (default 0.25)")
    g.add_argument("--remote-restart-check-s", type=float, metavar="S",
                   help="seconds between checks of each Redis master's run_id: a master that "
                        "restarted empty gets the local chunks it lacks again (default 10; 0: "
                        "off)")
    g.add_argument("--remote-codec", choices=_DiskCodecs(), metavar="CODEC",
                   help="value codec in Redis: %(choices)s (default raw); int8/fp8/kivi "
                        "lossily, only for "
                        "namespaces whose lossy_codec names it (others: raw)")
    g.add_argument("--remote-queue-bytes",
                   help="most chunk bytes waiting to be written behind; beyond, writes are "
                        "dropped and counted (default 256MiB)")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstore`` argument parser (subcommands serve, stats, clear, inspect)."""
    ap = SubcommandErrorsParser(
        prog="kvstore", description="Tiered, shared KV-cache store.",
        epilog="Exit status: 0 done; 1 the daemon is unreachable, refused the call (401: no "
               "or wrong token) or answered an error, or the URL is not a kvstore daemon's; 2 "
               "bad usage or input (an unknown flag, a bad value, a malformed URL, a namespace "
               "that is not valid); 130 Ctrl-C.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ap.subcommands = sub
    _serve_parser(sub)
    add_client_parsers(sub)
    p = sub.add_parser("inspect", help="what a disk tier holds (offline, read-only)")
    p.add_argument("disk_path", help="the disk tier's directory (--disk-path), or its data.mdb")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.add_argument("--limit", type=int, default=20, help="chunks listed (default 20; 0 = all)")
    p.add_argument("--verify", action="store_true", help="also decode and checksum payloads")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script and ``python -m kvstore``."""
    args = build_parser().parse_args(argv)
    try:
        rc = {"serve": cmd_serve, "stats": cmd_stats, "clear": cmd_clear,
              "inspect": cmd_inspect}[args.cmd](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C while waiting on a daemon or reading a disk tier
        print(f"kvstore {args.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        print(f"kvstore {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvstore {args.cmd}: {e}", file=sys.stderr)
        return 2


#: exit status after Ctrl-C: 128 + SIGINT, what a shell reports for a command SIGINT ended.
EXIT_INTERRUPTED = 130

#: exit status when the reader of stdout went away (``kvstore inspect DIR | head``): 128 +
#: SIGPIPE, what a shell reports for a command that SIGPIPE ended.
EXIT_BROKEN_PIPE = 141


def _stdout_closed() -> int:
    """Quiet exit after the reader of stdout closed its end: point stdout at /dev/null so the
    interpreter's final flush does not raise again (the recipe of Python's ``signal`` docs)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured): nothing to flush
        pass
    finally:
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def choose_http_parser(which: str) -> None:
    """Select aiohttp's pure-Python (``"python"``) or C (``"c"``) HTTP parser for this process,
    through ``AIOHTTP_NO_EXTENSIONS``, which aiohttp reads once at import: a no-op (logged) when
    aiohttp is already imported."""
    want = which == "python"
    if "aiohttp" in sys.modules:
        from aiohttp import helpers
        if helpers.NO_EXTENSIONS != want:
            log.warning("aiohttp is already imported; --http-parser %s not applied", which)
        return
    if want:
        os.environ["AIOHTTP_NO_EXTENSIONS"] = "1"
    else:
        os.environ.pop("AIOHTTP_NO_EXTENSIONS", None)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.daemon.cli_interrupt import sigint_exits
    with sigint_exits("serve"):  # until the server listens and takes SIGINT itself
        return _serve_command(args)


def _serve_command(args: argparse.Namespace) -> int:
    from kvstore.daemon import config as serve_config
    from kvstore.daemon.cli_interrupt import exit_on_another_signal, restore_signals
    flags = {k: v for k, v in vars(args).items() if k in serve_config.FIELDS}
    try:
        cfg = serve_config.resolve(flags, config_file=args.config)
    except serve_config.EnvValueError as e:  # as argparse reports a flag it cannot parse
        print(f"kvstore serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvstore.daemon.start_checks import start_warnings
    for warning in start_warnings(cfg):
        log.warning("%s", warning)
    choose_http_parser(cfg.http_parser)
    return_freed_buffers_to_os()
    tenants = None
    if cfg.tenants_file:
        from kvstore.daemon.tenants import TenantTable
        tenants = TenantTable.from_file(cfg.tenants_file)
    store = build_store(cfg)
    persist_s = 0.0  # (only a graceful stop persists: not a failure to start or serve)
    try:
        asyncio.run(_serve(cfg, store, tenants))
        persist_s = cfg.persist_on_shutdown_s if cfg.disk_path is not None else 0.0
    finally:
        previous = exit_on_another_signal()  # (before the line: a script may signal on it)
        log.info("closing the store (flushing disk writes%s)",
                 f"; persisting the memory tiers for up to {persist_s:g} s; SIGTERM or Ctrl-C "
                 f"again to exit at once" if persist_s else "")
        try:
            store.close(persist_s=persist_s)
        finally:
            restore_signals(previous)
    log.info("stopped")
    return 0


#: glibc ``mallopt`` parameter number of the mmap threshold (malloc.h).
M_MMAP_THRESHOLD = -3


def return_freed_buffers_to_os(threshold_bytes: int = 1 << 20) -> bool:
    """Serve every allocation of ``threshold_bytes`` or more with its own mmap, so a freed
    request buffer (a 5.9 MB chunk in flight) goes back to the OS at once.

    By default glibc raises its mmap threshold after the first large free, then serves such
    buffers from heap arenas that it rarely trims: the daemon's RSS then keeps the peak of every
    thread's arena (measured: 4.3x the CPU tier's capacity above the idle RSS in the soak of
    ``bench.daemon_load``, 2.3x with this). Returns False where glibc is absent (no effect).
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))
    except (OSError, AttributeError):
        return False


class _NoError(Exception):
    """Matches nothing (``build_store`` without a remote tier)."""


def build_store(cfg) -> Any:
    """The ``ChunkStore`` for a ``ServeConfig``.

    Raises:
        ValueError: the tiers cannot be created (a disk path that is not a writable directory
            or not an lmdb environment, a memory tier the machine cannot allocate, a GPU tier
            without the device, a remote tier whose Redis is unreachable, refuses the password
            or is not the cluster the URL names), with the reason and never the password.
    """
    import lmdb
    from kvstore.config import StoreConfig
    from kvstore.store import ChunkStore
    remote_error: type[Exception] = _NoError
    if cfg.remote_url is not None:
        from kvstore.tiers.redis_nodes import RemoteConfigError as remote_error
    try:
        return ChunkStore(StoreConfig(**cfg.store_config_kwargs()))
    except remote_error as e:  # its message never holds the password
        raise ValueError(f"cannot start the remote tier: {e}") from None
    except (OSError, lmdb.Error) as e:
        raise ValueError(f"cannot open the disk tier at {cfg.disk_path!r}: {e}") from None
    except RuntimeError as e:  # torch: allocation failed, device unavailable
        raise ValueError(f"cannot create the store's memory tiers: {e}") from None


async def _serve(cfg, store, tenants=None) -> None:
    from kvstore.daemon.run import http_url
    from kvstore.daemon.server import ServerLimits, create_app, serve_until_signal
    limits = ServerLimits(auth_token=cfg.auth_token, tenants=tenants,
                          max_body_bytes=cfg.max_body_bytes,
                          max_batch_keys=cfg.max_batch_keys,
                          request_timeout_s=cfg.request_timeout_s, max_lease_s=cfg.max_lease_s,
                          max_inflight_bytes=cfg.max_inflight_bytes)
    app = create_app(store, limits)

    def on_listen(bound) -> None:
        # One parseable line on stdout: scripts and tests wait for it (and read the port).
        print(f"kvstore serve: listening on {http_url(*bound)}", flush=True)
        if cfg.unix_socket:  # (a second line: the first one's last word stays the URL)
            print(f"kvstore serve: same-host path on unix://{cfg.unix_socket}", flush=True)
    await serve_until_signal(app, cfg.host, cfg.port, shutdown_timeout_s=cfg.shutdown_timeout_s,
                             on_listen=on_listen, max_connections=cfg.max_connections,
                             idle_timeout_s=cfg.idle_timeout_s, unix_socket=cfg.unix_socket)


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvstore.daemon.cli_interrupt import sigint_exits
    with sigint_exits("inspect"):  # (read only: nothing to clean up)
        return _inspect_command(args)


def _inspect_command(args: argparse.Namespace) -> int:
    from kvstore.disk_inspect import inspect_disk
    if args.limit < 0:
        raise UsageError(f"--limit must be >= 0 (0 lists every chunk), got {args.limit}")
    report = inspect_disk(args.disk_path, limit=args.limit, verify=args.verify)
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
