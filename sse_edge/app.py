"""The edge's ASGI application."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sse_edge.chat import chat_completions
from sse_edge.errors import ApiError, handle_api_error
from sse_edge.framing import RefuseAmbiguousFraming
from sse_edge.openapi import openapi_spec
from sse_edge.protocol import model_list_body
from sse_edge.resume import resume_stream
from sse_edge.services import EdgeServices
from sse_edge.settings import EdgeSettings
from sse_edge.transcripts import list_conversations, list_messages
from sse_edge.usage import tenant_usage


async def list_models(request: Request) -> Response:
    edge: EdgeServices = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    return JSONResponse(model_list_body([m for m in edge.settings.bus.models if key.allows(m)]))


async def healthz(request: Request) -> Response:
    edge: EdgeServices = request.app.state.edge
    return JSONResponse({"status": "ok", "open_streams": edge.bus.router.open_streams})


async def readyz(request: Request) -> Response:
    """Ready when the broker and Redis both answer."""
    edge: EdgeServices = request.app.state.edge
    checks = {"broker": False, "redis": False}
    with contextlib.suppress(Exception):
        await asyncio.wait_for(edge.bus.producer.client.fetch_all_metadata(), 2)
        checks["broker"] = True
    with contextlib.suppress(Exception):
        checks["redis"] = bool(await asyncio.wait_for(edge.redis.ping(), 1))
    ready = all(checks.values())
    return JSONResponse({"status": "ready" if ready else "not ready", **checks}, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    edge: EdgeServices = request.app.state.edge
    return Response(generate_latest(edge.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec())


async def not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"Unknown path {request.url.path}.", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return ApiError(405, f"Method {request.method} is not allowed on {request.url.path}.", code="method_not_allowed").response()


async def server_error(request: Request, exc: Exception) -> Response:
    return ApiError(500, "The server had an error while processing your request.", type="server_error",
                    code="internal_error").response()


class CountResponses:
    """Counts responses by status (pure ASGI: it must not hide client disconnects from streams)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                edge: EdgeServices | None = getattr(scope["app"].state, "edge", None)
                if edge is not None:
                    edge.metrics.responses.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(settings: EdgeSettings | None = None) -> Starlette:
    settings = settings or EdgeSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        edge = EdgeServices(settings)
        await edge.start()
        app.state.edge = edge
        try:
            yield
        finally:
            await edge.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/chat/completions/{completion_id}/stream", resume_stream, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/conversations", list_conversations, methods=["GET"]),
            Route("/v1/usage", tenant_usage, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/messages", list_messages, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        exception_handlers={ApiError: handle_api_error, 404: not_found, 405: method_not_allowed, 500: server_error},
        lifespan=lifespan,
    )
    app.add_middleware(CountResponses)
    app.add_middleware(RefuseAmbiguousFraming)  # added last: runs first
    return app
