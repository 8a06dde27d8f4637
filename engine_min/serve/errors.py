"""Every HTTP error of ``engine_min.serve.server`` as an OpenAI error object.

aiohttp answers an unknown route (404), a known route with the wrong method (405), a body over
``client_max_size`` (413) and an unhandled exception (500) in plain text; OpenAI clients and
benchmark tools expect ``{"error": {"message", "type", "param", "code"}}`` (the shape of the
OpenAI API, which vLLM's server also answers). ``openai_error_middleware`` turns each of those
into that object; the handlers' own refusals (``ApiError``) already have it.

Fields follow the 400s of ``engine_min.serve.protocol``: ``type`` is ``invalid_request_error``
for 4xx and ``server_error`` for 5xx, ``code`` a short string (``not_found``,
``method_not_allowed``, ``request_too_large``, ``internal_error``). (vLLM puts the HTTP status in
``code`` and its phrase in ``type``; the keys are the same.)
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiohttp import web

from engine_min.serve import protocol as proto

logger = logging.getLogger("engine_min.serve.server")

_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_response(exc: proto.ApiError, headers: dict | None = None) -> web.Response:
    """``exc`` as a JSON response with its HTTP status."""
    return web.json_response(proto.error_body(exc.message, exc.type, exc.param, exc.code),
                             status=exc.status, headers=headers)


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> web.Response:
    where = f"{request.method} {request.path}"
    headers = None
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"Method Not Allowed: {where} (allowed: {allowed})."
        headers = {"Allow": allowed}
    elif isinstance(exc, web.HTTPNotFound):
        message = f"Not Found: no route {where}."
    else:
        message = f"{exc.reason}: {where}."
    type_ = "server_error" if exc.status >= 500 else "invalid_request_error"
    code = _CODES.get(exc.status, exc.reason.lower().replace(" ", "_"))
    return error_response(proto.ApiError(message, code=code, status=exc.status, type=type_),
                          headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_error_middleware(request: web.Request, handler: Handler
                                  ) -> web.StreamResponse:
    """Answer aiohttp's HTTP errors (status >= 400), a body it cannot decode (400, e.g. bad
    gzip under ``Content-Encoding: gzip``) and unhandled exceptions (500, logged) as OpenAI
    error objects; everything else passes through unchanged (an exception after a
    response started streaming too: aiohttp then closes the connection, as before)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(request, exc)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except web.RequestPayloadError as exc:  # a body aiohttp cannot decode (bad gzip/deflate)
        detail = str(exc).splitlines()[-1].strip()
        resp = error_response(proto.ApiError(f"Cannot decode the request body: {detail}",
                                             code="invalid_body", status=400))
        resp.force_close()  # the rest of the body cannot be read: the connection cannot be reused
        return resp
    except Exception as exc:
        if request.writer.output_size > 0:  # a stream already started: aiohttp closes it
            raise
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(proto.ApiError(f"Internal server error: {exc!r}",
                                             code="internal_error", status=500,
                                             type="server_error"))
