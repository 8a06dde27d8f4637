"""``python -m engine_min route --engines URL,URL,... [flags]``: the cache-aware router's command
line (the app is ``engine_min.router.proxy``).

Start-up: the engine URLs are checked (``http://host:port``; one engine given twice, by the
same URL or by host names that resolve to one address, is refused); then, at the same time,
the tokenizer of ``--model`` loads while every engine is waited for until it answers
``GET /health`` within ``--startup-timeout-s`` (an engine still loading its model is waited
for); two URLs that reach one engine process (the same KV events epoch) are refused once they
answer. The log says what is still awaited and when the router is ready; it listens once both
are done. Any failure is one line on stderr and exit status 2, as soon as it is known: a
tokenizer that cannot be loaded without waiting for the engines, engines not answering within
``--startup-timeout-s`` without waiting for the tokenizer. An engine whose ``/tokenize``
disagrees with the router's tokenizer on a probe chat is logged as a warning (its requests
would be routed by load only).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request

from engine_min.router.engine_urls import (check_distinct_addresses,
                                           check_distinct_engines, parse_engine_urls)

logger = logging.getLogger("engine_min.router")


def _number(kind: type, low: float, high: float = float("inf"), low_open: bool = False,
            what: str = ""):
    """An argparse type: a finite ``kind`` (int or float) in ``[low, high]`` (``(low, high]``
    with ``low_open``); anything else is refused with ``what`` the flag expects."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not (value > low if low_open else value >= low) or not value <= high \
                or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


_POSITIVE_S = _number(float, 0, low_open=True, what="a number of seconds > 0")


def add_route_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``route`` flags to ``parser``."""
    parser.add_argument("--engines", required=True, metavar="URL,URL,...",
                        help="engine base URLs, comma-separated (http://host:port)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=_number(int, 0, 65535, what="a port in 0..65535"), default=8100, help="TCP port (default 8100)")
    parser.add_argument("--policy", default="cache-aware", choices=("cache-aware", "round-robin"),
                        help="routing policy (default cache-aware)")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder whose tokenizer "
                        "and chat template the engines use (default: embedded SmolLM2-135M)")
    parser.add_argument("--max-load-gap", type=_number(int, 0, what="an integer >= 0"), default=8, metavar="N",
                        help="in-flight requests an engine may have beyond the least loaded "
                        "and still win on cached prefix (default 8)")
    parser.add_argument("--min-hit-fraction",
                        type=_number(float, 0, 1, what="a fraction in [0, 1]"), default=0.5, metavar="F",
                        help="least fraction of a prompt an engine must hold to win on cached "
                        "prefix (default 0.5)")
    parser.add_argument("--health-interval-s", type=_POSITIVE_S, default=1.0,
                        help="seconds between health checks of each engine (default 1)")
    parser.add_argument("--startup-timeout-s", type=_POSITIVE_S, default=60.0,
                        help="seconds to wait for every engine to answer /health at start "
                        "(default 60)")
    parser.add_argument("--shutdown-timeout-s", type=_number(float, 0, what="a number of "
                        "seconds >= 0"), default=5.0, metavar="S",
                        help="at Ctrl-C / SIGTERM, seconds the requests in flight may still "
                        "run; then streams end with finish_reason \"abort\", an error event "
                        "and [DONE], other requests get 503 (default 5)")
    parser.add_argument("--kvstore-url", default=None, metavar="URL",
                        help="the kvstore daemon the engines share (http://host:port): an "
                        "engine then wins on its cache only by what it holds beyond the store")
    parser.add_argument("--kvstore-auth-token", default=os.environ.get("KVSTORE_AUTH_TOKEN"),
                        metavar="TOKEN", help="bearer token of that daemon (default "
                        "$KVSTORE_AUTH_TOKEN)")
    parser.add_argument("--kvstore-lookup-timeout-ms",
                        type=_number(float, 0, low_open=True, what="a number of ms > 0"), default=5.0, metavar="MS",
                        help="deadline of a request's store lookup; past it the request is "
                        "scored without the store (default 5)")
    parser.add_argument("--log-level", default="info", help="logging level (default info)")
    return parser


def wait_for_engines(urls: list[str], timeout_s: float) -> None:
    """Return once every engine answers ``GET /health`` with 200.

    Raises:
        RuntimeError: some did not within ``timeout_s``; names them and the last error.
    """
    deadline = time.monotonic() + timeout_s
    pending = {u: "no answer yet" for u in urls}
    while True:
        for u in list(pending):
            try:
                with urllib.request.urlopen(u + "/health", timeout=5) as r:
                    if r.status == 200:
                        del pending[u]
            except (urllib.error.URLError, OSError, ValueError) as exc:
                pending[u] = str(getattr(exc, "reason", exc))
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError("engine(s) not answering /health after "
                               f"{timeout_s:g} s: " + "; ".join(f"{u} ({why})"
                                                               for u, why in pending.items()))
        time.sleep(0.5)


#: the probe ``check_tokenizer`` sends: special tokens, digits, spaces, non-ASCII, a chat turn
PROBE_MESSAGES = [{"role": "user", "content": "Route 2 this:  naïve café 🚀 12345 <|im_end|>"}]


def check_tokenizer(urls: list[str], tokenizer) -> list[str]:
    """Compare the router's token ids of ``PROBE_MESSAGES`` (chat template included) with each
    engine's ``POST /tokenize``. Returns one warning per engine that disagrees or cannot say
    (empty: all agree); a router with another tokenizer than its engines routes by load only,
    as its hashes match nothing."""
    import json

    from engine_min.router.prompt import prompt_token_ids
    body = json.dumps({"messages": PROBE_MESSAGES}).encode()
    mine = prompt_token_ids(tokenizer, body, "chat")
    warnings = []
    for u in urls:
        req = urllib.request.Request(u + "/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                theirs = json.loads(r.read()).get("tokens")
        except (urllib.error.URLError, OSError, ValueError, AttributeError) as exc:
            warnings.append(f"{u}: cannot compare tokenizers (/tokenize: {exc})")
            continue
        if theirs != mine:
            warnings.append(f"{u} tokenizes a chat differently from --model (its /tokenize "
                            f"gave {len(theirs or [])} ids, the router {len(mine or [])}): "
                            f"pass the engines' model as --model, or its requests are routed "
                            f"by load only")
    return warnings


class EngineWaiter:
    """``wait_for_engines`` on a daemon thread, so the tokenizer loads meanwhile.

    Attributes:
        error: the RuntimeError it raised (None: all answered, or still waiting).
        waited_s: seconds until every engine answered (None until then).
    """

    def __init__(self, urls: list[str], timeout_s: float):
        self.urls, self.timeout_s = urls, timeout_s
        self.error: RuntimeError | None = None
        self.waited_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="wait-for-engines", daemon=True)

    def start(self) -> "EngineWaiter":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            wait_for_engines(self.urls, self.timeout_s)
            self.waited_s = time.monotonic() - t0
        except RuntimeError as exc:
            self.error = exc

    @property
    def done(self) -> bool:
        """Every engine answered, or the wait failed."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the outcome. Raises the RuntimeError of ``wait_for_engines``."""
        self._thread.join()
        if self.error is not None:
            raise self.error


class _TokenizerLoader:
    """``load_tokenizer(model)`` on a daemon thread (``result`` or ``error`` once done)."""

    def __init__(self, model: str | None):
        self.model, self.result, self.error = model, None, None
        self.loaded_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="load-tokenizer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from engine_min.tokenizer import load_tokenizer
        t0 = time.monotonic()
        try:
            self.result = load_tokenizer(self.model)
            self.loaded_s = time.monotonic() - t0
        except BaseException as exc:   # re-raised on the main thread
            self.error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self):
        """The tokenizer; raises what loading it raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def load_while_waiting(model: str | None, urls: list[str], timeout_s: float):
    """The tokenizer of ``model``, loaded while the engines are waited for; returns once both
    are done, logging each (what is still awaited, then ready). Whichever fails first is
    raised at once: an engine not answering within ``timeout_s`` does not wait for the
    tokenizer, nor a tokenizer that cannot be loaded for the engines. Once every engine
    answers, two URLs of one engine process are refused (``check_distinct_engines``).

    Raises:
        RuntimeError: engines not answering within ``timeout_s``.
        ValueError: two URLs reach the same engine; or the tokenizer's own error.
        ModelLoadError, OSError: the tokenizer cannot be loaded.
    """
    waiter = EngineWaiter(urls, timeout_s).start()
    logger.info("loading the tokenizer of %s while waiting for %d engine(s)",
                model or "the embedded model", len(urls))
    loader = _TokenizerLoader(model)
    logged = False
    while not waiter.done:
        if loader.done:
            loader.join()          # raises a loading error at once
            if not logged:
                logger.info("tokenizer loaded in %.2f s; still waiting for the engines",
                            loader.loaded_s)
                logged = True
        time.sleep(0.02)
    waiter.join()
    logger.info("all %d engine(s) healthy after %.2f s", len(urls), waiter.waited_s)
    check_distinct_engines(urls)
    tokenizer = loader.join()
    if not logged:
        logger.info("tokenizer loaded in %.2f s", loader.loaded_s)
    return tokenizer


def route_main(args: argparse.Namespace) -> int:
    """Check the flags, load the tokenizer while waiting for the engines, serve until
    interrupted. Returns 2 (reason on stderr) on bad flags, engines not answering or a model
    that cannot be read."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:   # before torch is imported (seconds), which also makes the exit slower
        urls = parse_engine_urls(args.engines)
        check_distinct_addresses(urls)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from engine_min.interrupt import sigint_exits
    with sigint_exits():   # Ctrl-C before it listens: KeyboardInterrupt in torch is unsafe
        from engine_min.router.policy import make_policy
        from engine_min.serve.cli import check_listen
        from engine_min.weights import ModelLoadError
        try:
            policy = make_policy(args.policy, args.max_load_gap, args.min_hit_fraction)
            store = None
            if args.kvstore_url:
                from engine_min.router.store_lookup import StoreLookup
                store = StoreLookup(args.kvstore_url, args.kvstore_lookup_timeout_ms / 1e3,
                                    args.kvstore_auth_token)
                refused = store.check_token()
                if refused is not None:
                    logger.warning("shared store %s refuses the router (%s): routing without the "
                                   "store; give the daemon's token (--kvstore-auth-token, "
                                   "$KVSTORE_AUTH_TOKEN)", store.url, refused)
                    store = None
            check_listen(args.host, args.port)  # before the tokenizer loads (tens of seconds)
            tokenizer = load_while_waiting(args.model, urls, args.startup_timeout_s)
        except (ModelLoadError, OSError, ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except SystemExit as exc:  # (check_listen's: the message says it all)
            print(exc, file=sys.stderr)
            return 2
    for warning in check_tokenizer(urls, tokenizer):
        logger.warning("%s", warning)
    if store is not None and getattr(policy, "name", "") != "cache-aware":
        logger.warning("--kvstore-url is used by the cache-aware policy only; --policy %s "
                       "routes without the store", args.policy)
    from aiohttp import web

    from engine_min.router.proxy import create_router_app
    app = create_router_app(urls, tokenizer, policy, args.health_interval_s, store=store,
                            shutdown_timeout_s=args.shutdown_timeout_s)

    def started(text: str) -> None:
        where = text.splitlines()[0].strip("= ").removeprefix("Running on ")
        logger.info("routing (%s) to %s on %s%s", args.policy, ", ".join(urls), where,
                    f"; shared store {args.kvstore_url}" if store is not None else "")
    try:
        web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                    access_log=None, print=started, shutdown_timeout=1.0)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    return 0
