"""``GET /v1/models/{model}`` and ``GET /version`` of ``engine_min.serve.server``.

``/v1/models/{model}`` answers one served model's card (the object ``/v1/models`` lists), or
404 ``model_not_found`` in OpenAI's error shape for a name the server does not serve.
``/version`` answers ``{"version": str}``, the installed ``kvstore-tiered`` package's version
(vLLM's ``/version`` shape).
"""
from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from aiohttp import web

from engine_min.serve import protocol as proto
from engine_min.serve.errors import error_response

if TYPE_CHECKING:
    from engine_min.serve.server import OpenAIServing

PACKAGE = "kvstore-tiered"


def package_version() -> str:
    """The installed package's version, ``"unknown"`` when it is not installed."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def model_card(serving: "OpenAIServing", name: str) -> dict:
    """The OpenAI model object of served name ``name``."""
    return {"id": name, "object": "model", "created": serving.created,
            "owned_by": "engine_min", "root": serving.model_name,
            "max_model_len": serving.max_model_len}


def add_model_routes(app: web.Application, serving: "OpenAIServing") -> None:
    """Register ``GET /v1/models/{model}`` and ``GET /version`` on ``app``."""

    async def model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in serving.model_names:
            return error_response(proto.ApiError(f"The model `{name}` does not exist.",
                                                 param="model", code="model_not_found",
                                                 status=404))
        return web.json_response(model_card(serving, name))

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": package_version()})

    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/version", version)
