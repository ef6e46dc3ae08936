"""The edge's ASGI application."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sse_edge.bus import EdgeBus
from sse_edge.chat import chat_completions
from sse_edge.errors import ApiError, handle_api_error
from sse_edge.protocol import model_list_body
from sse_edge.settings import EdgeSettings


async def list_models(request: Request) -> Response:
    bus: EdgeBus = request.app.state.bus
    return JSONResponse(model_list_body(bus.settings.bus.models))


async def healthz(request: Request) -> Response:
    bus: EdgeBus = request.app.state.bus
    return JSONResponse({"status": "ok", "open_streams": bus.router.open_streams})


async def not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"Unknown path {request.url.path}.", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"Method {request.method} is not allowed on {request.url.path}.", code="method_not_allowed").response()


def create_app(settings: EdgeSettings | None = None) -> Starlette:
    settings = settings or EdgeSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        bus = EdgeBus(settings)
        await bus.start()
        app.state.bus = bus
        try:
            yield
        finally:
            await bus.stop()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        exception_handlers={ApiError: handle_api_error, 404: not_found, 405: method_not_allowed},
        lifespan=lifespan,
    )
