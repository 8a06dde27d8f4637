"""The router's ``--engines`` list: parsed and checked (``parse_engine_urls``), and one engine
given twice refused, by two host names of one address (``check_distinct_addresses``) or by
two URLs that reach one engine process (``check_distinct_engines``). Only the standard library
is imported here, so a malformed list is refused before the router imports anything heavy."""
from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import urlsplit


def parse_engine_urls(text: str) -> list[str]:
    """``URL,URL,...`` as base URLs without a trailing slash.

    Raises:
        ValueError: an empty list, a duplicate, or a URL that is not ``http(s)://host[:port]``
            (a path other than ``/`` included).
    """
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise ValueError("--engines: no engine URL given")
    for u in urls:
        parts = urlsplit(u)
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"--engines: bad URL {u!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path \
                or parts.query:
            raise ValueError(f"--engines: bad URL {u!r} (expected http://host:port)")
    seen: dict[tuple, str] = {}
    for u in urls:
        key = _normal(u)
        if key in seen:
            raise ValueError(f"--engines: an engine is listed twice: {seen[key]} and {u}")
        seen[key] = u
    return urls


def _normal(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``, lower case, the scheme's default port filled in."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, parts.hostname.lower(), parts.port or (443 if scheme == "https" else 80)


def check_distinct_addresses(urls: list[str]) -> None:
    """Refuse two URLs whose host names resolve to a common address on the same scheme and
    port (``localhost`` and ``127.0.0.1``): one engine given twice. A name that does not
    resolve is left to the wait for the engines.

    Raises:
        ValueError: names the two URLs and the address they share.
    """
    import socket
    seen: dict[tuple, str] = {}
    for u in urls:
        scheme, host, port = _normal(u)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        for addr in {info[4][0] for info in infos}:
            key = (scheme, addr, port)
            if key in seen and seen[key] != u:
                raise ValueError(f"--engines: {seen[key]} and {u} are the same engine (both "
                                 f"{addr} port {port})")
            seen[key] = u


def check_distinct_engines(urls: list[str], timeout_s: float = 10.0) -> None:
    """Refuse two URLs that reach the same engine process: the same KV event log ``epoch``
    (random, one per engine process) in ``GET /v1/kv_events/snapshot``. An engine without the
    events routes (404) or that does not answer has no identity and is not compared.

    Raises:
        ValueError: names the two URLs.
    """
    import json
    seen: dict[str, str] = {}
    for u in urls:
        try:
            with urllib.request.urlopen(u + "/v1/kv_events/snapshot", timeout=timeout_s) as r:
                epoch = json.loads(r.read()).get("epoch")
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            continue
        if not isinstance(epoch, str):
            continue
        if epoch in seen:
            raise ValueError(f"--engines: {seen[epoch]} and {u} are the same engine (the same "
                             f"KV events epoch {epoch})")
        seen[epoch] = u
