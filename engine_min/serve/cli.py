"""The ``serve`` command line of engine_min's OpenAI server: its flags, building the engine
and the KV connector from them, and running the server (``python -m engine_min serve`` or
``python -m engine_min.serve.server``). The HTTP app itself is ``engine_min.serve.server``."""
from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from engine_min.interrupt import sigint_exits
from engine_min.serve.run import DEFAULT_SHUTDOWN_TIMEOUT_S, run_server
from engine_min.serve.server import SERVING_KEY, create_app

logger = logging.getLogger("engine_min.serve.server")


#: ``EngineConfig``'s defaults the flags' help shows (engine_min.config imports torch, which
#: ``--help`` and flag errors need not load; a test keeps the two equal)
ENGINE_DEFAULTS = {"kv_cache_bytes": 256 * 2**20, "block_size": 16,
                   "max_num_batched_tokens": 512, "max_num_seqs": 32}


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``parser``: server, engine, and the KV store's
    ``--kvstore-*`` (``connectors.flags.add_store_args``). Sizes accept ``512MiB``, ``2GiB``,
    bytes."""
    from connectors.flags import add_store_args, parse_size, seconds

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) in the API, as vLLM's: responses report the first, "
                   "requests may name any (default: the model's id, from its metadata or "
                   "--model-id)")
    g.add_argument("--shutdown-timeout-s", type=seconds,
                   default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                   help="on Ctrl-C / SIGTERM, how long requests in flight may run on before "
                   "they are aborted (streams end with finish_reason \"abort\", an error "
                   "event and [DONE]); a second Ctrl-C exits at once "
                   f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    e = parser.add_argument_group("engine")
    e.add_argument("--model", default=None,
                   help="GGUF file or safetensors folder (default: embedded SmolLM2-135M)")
    e.add_argument("--model-id", default=None, metavar="ID",
                   help="the model's name in the KV store namespace and the default served "
                   "name (default: from the model's metadata, e.g. "
                   "HuggingFaceTB/SmolLM2-135M-Instruct for the embedded GGUF)")
    e.add_argument("--model-revision", default=None, metavar="REV",
                   help="weights revision in the KV store namespace (default: a hub "
                   "snapshot's commit, else empty)")
    e.add_argument("--no-weights-fingerprint", action="store_true",
                   help="leave the weights' content fingerprint out of the KV store "
                   "namespace: engines then share chunks by --model-id/--model-revision "
                   "alone, and whoever sets this vouches that they load the same weights")
    from engine_min.cli import add_device_args
    add_device_args(e)
    d = ENGINE_DEFAULTS
    e.add_argument("--kv-cache-bytes", type=parse_size, default=None, metavar="SIZE",
                   help=f"bytes of the engine's KV block pool (default "
                   f"{d['kv_cache_bytes'] // 2**20}MiB)")
    e.add_argument("--block-size", type=int, default=None,
                   help=f"tokens per KV block (default {d['block_size']})")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one engine step (default "
                   f"{d['max_num_batched_tokens']})")
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most running requests (default {d['max_num_seqs']})")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion limit in tokens (default: the model's context "
                   "or what the KV pool holds, whichever is smaller: 5808 for the embedded "
                   "model with the default 256MiB pool); a value above either is refused")
    e.add_argument("--no-prefix-caching", action="store_true",
                   help="disable the engine's own prefix cache")
    e.add_argument("--no-kv-events", action="store_true",
                   help="do not publish the prefix cache's KV events (GET /v1/kv_events, "
                   "/v1/kv_events/snapshot answer 404; a cache-aware router then routes this "
                   "engine by load only)")
    e.add_argument("--kv-event-batches", type=int, default=None,
                   help="event batches retained for late subscribers (default 1024)")
    add_store_args(parser)
    parser.add_argument("--log-level", default="info", help="logging level (default info)")
    return parser


def build_connector(args: argparse.Namespace) -> Any | None:
    """The KV connector the store flags ask for, or ``None`` when no store flag is given
    (``connectors.flags.connector_from_args``, imported only here).

    Raises:
        SystemExit: inconsistent store flags (--kvstore-tail-chunk-size without a store), a
            chunk or tail size that does not fit the engine's block size, a disk path that
            cannot be opened, or the connector module is missing.
    """
    from connectors.flags import StoreFlagError, connector_from_args
    from engine_min.config import EngineConfig
    try:
        conn = connector_from_args(args)
        if conn is not None:    # sizes that cannot fit the engine's blocks: refused before
            try:                # the model loads
                conn.geometry_for(getattr(args, "block_size", None) or EngineConfig.block_size)
            except ValueError:
                conn.close()
                raise
        return conn
    except ImportError as exc:  # the store's optional dependencies
        raise SystemExit(f"the KV store connector for engine_min is not available ({exc}); "
                         f"run without --kvstore-* flags") from exc
    except StoreFlagError as exc:
        raise SystemExit(f"error: {exc}") from exc
    except (ValueError, OSError) as exc:  # OSError: a disk path that is a file or not writable
        raise SystemExit(f"error: bad --kvstore-* flags: {exc}") from exc


def engine_config(args: argparse.Namespace) -> Any:
    """The ``EngineConfig`` of the engine flags (unset flags keep its defaults); cheap, no
    model load.

    Raises:
        ValueError: a bad engine flag (size, dtype, a device that is unknown or absent).
    """
    from engine_min.config import EngineConfig

    kw = {"model": args.model, "dtype": args.dtype, "device": getattr(args, "device", None),
          "kv_cache_bytes": args.kv_cache_bytes,
          "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
          "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
          "model_id": getattr(args, "model_id", None),
          "model_revision": getattr(args, "model_revision", None)}
    kw = {k: v for k, v in kw.items() if v is not None}
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    if getattr(args, "no_kv_events", False):
        kw["enable_kv_events"] = False
    if getattr(args, "kv_event_batches", None) is not None:
        kw["kv_event_batches"] = args.kv_event_batches
    if getattr(args, "no_weights_fingerprint", False):
        kw["weights_fingerprint"] = False
    return EngineConfig(**kw)


def build_engine(args: argparse.Namespace, connector: Any | None = None) -> Any:
    """An ``LLMEngine`` from the engine flags (``engine_config``)."""
    from engine_min.engine import LLMEngine
    return LLMEngine(engine_config(args), connector=connector)


def check_max_model_len(requested: int | None, engine: Any) -> None:
    """Refuse ``--max-model-len`` above what the built engine can serve (as vLLM refuses one
    above the model's context): the model's context length or the tokens its KV pool holds.

    Raises:
        ValueError: the requested length is larger, naming both limits.
    """
    if requested is None or requested <= engine.max_model_len:
        return
    context = int(engine.model_config.max_position)
    pool_tokens = (int(engine.kv_cache.shape[2]) - 1) * int(engine.kv_cache.shape[3])
    why = (f"the model's context is {context} tokens" if requested > context else
           f"the KV pool ({engine.kv_cache.nbytes / 2**20:.1f} MiB, --kv-cache-bytes) holds "
           f"{pool_tokens} tokens; raise --kv-cache-bytes or lower --max-model-len")
    raise ValueError(f"--max-model-len {requested} is more than this engine can serve: {why} "
                     f"(largest allowed: {engine.max_model_len})")


def served_model_names(args: argparse.Namespace, engine: Any) -> list[str]:
    """``--served-model-name`` (one or more; the first is reported in responses), else the
    engine's model id (``engine.kv_identity["model_id"]``: ``--model-id`` or the model's
    metadata name, e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``).

    Raises:
        ValueError: an empty name.
    """
    names = list(args.served_model_name or [engine.kv_identity["model_id"]])
    check_served_names(names)
    return list(dict.fromkeys(names))  # duplicates dropped, order kept


def check_served_names(names: list[str] | None) -> None:
    """Refuse an empty served name (None: no names given, nothing to check).

    Raises:
        ValueError: a name that is empty or only spaces.
    """
    if names and any(not n.strip() for n in names):
        raise ValueError(f"--served-model-name: empty name in {names}")


def check_listen(host: str, port: int) -> None:
    """Fail fast, before the model loads (10-20 s), when ``host:port`` cannot be listened on
    (a port in use, an address not of this host, a name that does not resolve). The server
    binds again later; this only moves the common errors before the load.

    Raises:
        SystemExit: the address cannot be bound (or the port is outside [0, 65535]), with
            host, port and the reason.
    """
    if port == 0:
        return
    try:
        socket.create_server((host, port)).close()
    except (OSError, OverflowError) as exc:   # OverflowError: a port outside [0, 65535]
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc}") from None


def log_identity(engine: Any, names: list[str]) -> None:
    """Log what the engine serves (model id, revision, weights fingerprint, served names); the
    connector logs the store namespace built from it when it binds."""
    ident = engine.kv_identity
    logger.info("model %s (revision %s, weights %s), served as %s", ident["model_id"],
                ident["revision"] or "-", ident["weights_fingerprint"] or "not fingerprinted",
                ", ".join(names))


def serve_main(args: argparse.Namespace) -> None:
    """Build the engine (and connector) from ``args`` and serve until interrupted.

    Raises:
        SystemExit: bad flags (a device this machine lacks: before the store or the model is
            touched), a model that cannot be loaded, or an unusable KV pool size.
    """
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_served_names(args.served_model_name)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    check_listen(args.host, args.port)
    try:
        engine_config(args)    # bad engine flags (a device absent here) before store or model
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    connector = build_connector(args)
    try:
        with sigint_exits():   # Ctrl-C in the model load: KeyboardInterrupt in torch is unsafe
            engine = build_engine(args, connector)
        check_max_model_len(args.max_model_len, engine)
        names = served_model_names(args, engine)
    except ValueError as exc:  # ModelLoadError is a ValueError; so are bad engine sizes
        if connector is not None:
            connector.close()
        raise SystemExit(f"error: {exc}") from exc
    log_identity(engine, names)
    name = names[0]
    app = create_app(engine, names)
    max_len = app[SERVING_KEY].max_model_len

    def started(url: str) -> None:  # the bound address (also for --port 0)
        logger.info("serving %s on %s (max_model_len %d)", name, url, max_len)

    def close_connector() -> None:
        if connector is not None:
            connector.close()  # flush queued saves to the store
    run_server(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout_s,
               started=started, after=close_connector)


def run_serve(args: argparse.Namespace) -> int:
    """``serve_main`` as a command: returns its exit code, 2 for bad flags, a model that cannot
    be loaded or an address that cannot be bound (the reason on stderr, as argparse's own
    usage errors); 130 when interrupted before it listens (Ctrl-C during the model load)."""
    try:
        serve_main(args)
    except KeyboardInterrupt:  # Ctrl-C before the server listens (model load)
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m engine_min.serve.server [flags]``."""
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()  # before the engine (torch, so OpenMP) loads
    parser = argparse.ArgumentParser(
        prog="python -m engine_min.serve.server",
        description="OpenAI-compatible HTTP server for engine_min.")
    raise SystemExit(run_serve(add_serve_args(parser).parse_args(argv)))
