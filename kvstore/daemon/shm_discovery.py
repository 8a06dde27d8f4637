"""Auto-discovery of the same-host path: an HTTP client of a daemon on this host switches to
the daemon's Unix socket (``kvstore.daemon.client.KVStoreClient`` with ``same_host=True``).

The daemon names its socket in ``/v1/whoami`` (any token) and ``/v1/stats`` (admin tokens) as
``"unix_socket"``, with ``"instance"``, an id drawn at each start; whoami is asked first, so a
tenant's or reader's client is not refused on /v1/stats (a daemon older than whoami: stats). The socket is taken only
when its file exists here and its ``hello`` answers the same ``instance``: a path that names a
socket of another daemon (another host's path, an older start) is not used.
"""
from __future__ import annotations

import logging
import os
import stat
from typing import Any, Callable

from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.errors import RemoteError, StoreUnavailable

log = logging.getLogger("kvstore.daemon.client")

#: Longest wait (seconds) for the discovered socket's ``hello``; past it, HTTP stays.
HELLO_TIMEOUT_S = 2.0


def daemon_socket(ask: Callable[[str], dict]) -> tuple[str | None, str | None]:
    """``(unix_socket, instance)`` the daemon announces (None, None when it names none).

    Args:
        ask: ``ask("whoami")`` / ``ask("stats")`` answer ``/v1/whoami`` / ``/v1/stats``.

    Raises:
        StoreUnavailable: the daemon did not answer.
    """
    for route in ("whoami", "stats"):
        try:
            info = ask(route)
        except RemoteError as e:  # 404: no whoami (an older daemon), 403: not an admin
            if e.status in (403, 404):  # token (stats); 401: no use asking
                continue
            return None, None
        path, instance = info.get("unix_socket"), info.get("instance")
        if isinstance(path, str) and isinstance(instance, str):
            return path, instance
        return None, None  # an answer without a socket: the daemon offers none
    return None, None


def is_socket(path: str) -> bool:
    """Whether ``path`` is a Unix socket file on this host."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def discover_socket(ask: Callable[[str], dict], client_kwargs: dict[str, Any],
                    timeout_s: float | None) -> ShmKVStoreClient | None:
    """A ``ShmKVStoreClient`` of the same daemon ``ask`` reaches over HTTP, or None (HTTP
    stays: no socket announced, absent here, refused, another daemon's).

    Args:
        ask: as ``daemon_socket``.
        client_kwargs: the HTTP client's arguments (the socket client takes the same).
        timeout_s: the deadline of the call that discovers (None: the client's).

    Raises:
        StoreUnavailable: the daemon did not answer over HTTP (nothing decided).
    """
    path, instance = daemon_socket(ask)
    if path is None:
        return None
    if not is_socket(path):
        log.info("kvstore daemon's socket %s is not on this host; staying on HTTP", path)
        return None
    shm = ShmKVStoreClient(path, **client_kwargs)
    wait = min(HELLO_TIMEOUT_S, timeout_s if timeout_s is not None else shm.timeout_s)
    try:
        got = shm.hello(timeout_s=wait)["instance"]
    except (StoreUnavailable, RemoteError, OSError, ValueError) as e:
        shm.close()
        log.info("kvstore daemon's socket %s refused (%s); staying on HTTP", path, e)
        return None
    if got != instance:
        shm.close()
        log.info("socket %s belongs to another daemon (instance %s, not %s); staying on HTTP",
                 path, got, instance)
        return None
    log.info("kvstore daemon is on this host: using its socket %s", path)
    return shm
