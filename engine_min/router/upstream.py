"""A request's call to an engine until its answer's status line and headers came back: which
failures there make a stale connection (worth one more try on a fresh connection to the same
engine), and the wait for the answer that ends when the engine is taken out.

Before the headers, aiohttp's ``await session.post(...)`` spans writing the request and reading
the answer's status line and headers, so a pooled (keep-alive) connection that the engine closed
or reset fails there, whether the write itself failed ("Cannot write to closing transport") or
the close came after the request went out (``ServerDisconnectedError``, a reset). After the
headers, a failure is the engine's (``engine_min.router.stream_end``): a stream cut before its
first event is sent to another engine, one cut later is ended with an error event; it is never
retried on the same engine, as the client may already hold bytes of the answer.
"""
from __future__ import annotations

import asyncio

import aiohttp

from engine_min.router.reasons import EngineTakenOut
from engine_min.router.stream_end import UpstreamFailed

#: A pooled connection the engine closed before the request's answer: disconnected, reset, or
#: found closing as the request is written (``ClientConnectionResetError``, aiohttp >= 3.10;
#: a ``ConnectionResetError``, not a ``ClientOSError``).
STALE_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                *((aiohttp.ClientConnectionResetError,)
                  if hasattr(aiohttp, "ClientConnectionResetError") else ()))


class StaleConnection(UpstreamFailed):
    """The engine closed or reset the connection before its answer's headers came back: maybe
    a pooled connection it had closed while idle; worth one more try on a fresh connection to
    the same engine (which is not taken out for it).

    The request is a POST and not idempotent: when the close came after the request's body
    reached the engine, the retry can run the generation a second time. That is accepted here
    because a generation changes nothing but the engine's caches, and no byte of the first
    answer came back (nor went to the client, who gets exactly one answer); the first run costs
    the engine its compute. aiohttp's own client retries a reused connection's
    ``ClientOSError`` / ``ServerDisconnectedError`` once too, but only for idempotent methods
    (RFC 9112 section 9.3.1), as it cannot know what a POST does.
    """


async def unless_lost(post, lost: asyncio.Future):
    """The engine's response (``await post``: the request written, the answer's status line
    and headers read), unless ``lost`` (the engine was taken out) comes first: then the request
    is abandoned and ``EngineTakenOut`` (the reason, a ``ClientConnectionError``) raised.

    Raises:
        EngineTakenOut: ``lost`` came first.
        aiohttp.ClientError: the call failed (``STALE_ERRORS`` among them).
    """
    task = asyncio.ensure_future(post)
    try:
        await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:   # the client left, or the router's shutdown
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            task.result().close()
        raise
    if not task.done():
        task.cancel()
        raise EngineTakenOut(lost.result())
    return task.result()
