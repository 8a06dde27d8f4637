"""Why a call to an engine failed, in words for the router's log (``describe_error``): host:port
and the OS reason for a connection that could not be made, instead of aiohttp's raw reprs
(``ClientConnectorError(ConnectionKey(host=..., ...), ...)``)."""
from __future__ import annotations

import asyncio
import os

import aiohttp


class EngineTakenOut(aiohttp.ClientConnectionError):
    """Set on a request in flight to an engine that was taken out while the request waited
    for it (its health checks failed: it hangs or is gone); the request ends as if the
    engine had cut its connection. ``str()`` is the reason it was taken out."""


def describe_error(exc: BaseException) -> str:
    """A one-line reason for ``exc`` raised by a call to an engine.

    Examples: ``"cannot connect to 127.0.0.1:8001: connection refused"``, ``"timed out"``,
    ``"the engine closed the connection"``, ``"HTTP 503"``."""
    if isinstance(exc, EngineTakenOut):
        return f"taken out while the request waited for it: {exc}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error.errno, int) and os_error.errno > 0:   # e.g. ECONNREFUSED
            why = os.strerror(os_error.errno)
        else:  # a name that does not resolve carries its own text
            why = os_error.strerror or str(os_error) or type(os_error).__name__
        return f"cannot connect to {exc.host}:{exc.port}: {why.lower()}"
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timed out"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the engine closed the connection"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"HTTP {exc.status}" + (f" {exc.message}" if exc.message else "")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"the response body was cut: {exc}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
