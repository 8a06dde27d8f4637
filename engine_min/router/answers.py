"""The router's answers that are not streams: an engine's whole (non-streamed) answer relayed
to the client (``relay_whole``), the headers copied from an engine (``upstream_headers``), and
the 503 when no engine can take a request (``no_engine``)."""
from __future__ import annotations

import json
import logging

import aiohttp
from aiohttp import web

from engine_min.router.reasons import describe_error
from engine_min.router.shutdown import answering
from engine_min.router.stream_end import ClientGone, UpstreamFailed, to_client
from engine_min.router.usage import cached_tokens
from engine_min.serve import protocol as proto
from engine_min.serve.errors import error_response

logger = logging.getLogger("engine_min.router")

#: response headers not copied from the engine (hop-by-hop, or set by the router's server)
_DROP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                           "date", "server", "content-encoding"})


def upstream_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    """The engine's response headers the client gets (all but hop-by-hop and server ones)."""
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_HEADERS}


async def relay_whole(request: web.Request, up: aiohttp.ClientResponse, e, metrics
                      ) -> web.Response:
    """Read the engine's whole answer and send it to the client: status, headers (but
    ``_DROP_HEADERS``) and body unchanged; the ``cached_tokens`` of a 200's usage go to
    ``router_reported_cached_tokens_total``. Once the answer is being written the router's
    shutdown lets it finish (``answering``). A client that left as the answer was written
    (``ClientGone``) ends it there, counted in ``router_client_gone_total``; the engine is not
    blamed (it stays in service) and the request is not sent again.

    Args:
        request: the client's request; up: the engine's response.
        e: the engine (``engine_min.router.subscriber.Engine``: ``url``).
        metrics: the router's ``RouterMetrics``.

    Raises:
        UpstreamFailed: the engine's answer could not be read (nothing went to the client).
    """
    try:
        body = await up.read()
    except aiohttp.ClientError as exc:
        raise UpstreamFailed(describe_error(exc)) from exc
    resp = web.Response(body=body, status=up.status, headers=upstream_headers(up))
    answering(request)
    try:
        await to_client(resp.prepare(request))
        await to_client(resp.write_eof())
    except ClientGone as exc:   # the client left: not the engine's failure (nothing to retry)
        logger.debug("%s: the client left as its answer was written (%s)", e.url, exc)
        metrics.client_gone.inc()
        return resp
    if up.status == 200:
        try:
            n = cached_tokens(json.loads(body))
        except ValueError:
            n = None
        if n is not None:
            metrics.reported_cached_tokens.labels(e.url).inc(n)
    return resp


def no_engine(after_failures: bool) -> web.Response:
    """503 ``no_healthy_engine`` (OpenAI error object): every engine tried failed
    (``after_failures``), or none is healthy."""
    msg = ("Every engine failed this request." if after_failures
           else "No healthy engine is available.")
    return error_response(proto.ApiError(msg, code="no_healthy_engine", status=503,
                                         type="server_error"))
