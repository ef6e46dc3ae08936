"""The edge's ASGI application: its routes, error handlers and middleware."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenbus.sse_edge.api.cancel import cancel_completion
from tokenbus.sse_edge.api.chat import chat_completions
from tokenbus.sse_edge.api.console import console, console_root
from tokenbus.sse_edge.api.continuation import continue_turn
from tokenbus.sse_edge.api.conversations import list_conversations, list_messages
from tokenbus.sse_edge.api.keys import create_key, list_keys, own_key, revoke_key
from tokenbus.sse_edge.api.models import list_models
from tokenbus.sse_edge.api.ops import healthz, metrics, openapi, readyz
from tokenbus.sse_edge.api.resume import resume_stream
from tokenbus.sse_edge.api.usage import tenant_usage
from tokenbus.sse_edge.errors import HANDLERS
from tokenbus.sse_edge.plumbing.framing import RefuseAmbiguousFraming
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.sse_edge.state import EdgeState


class CountResponses:
    """Counts responses by status (pure ASGI: it must not hide client disconnects from streams)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                edge: EdgeState | None = getattr(scope["app"].state, "edge", None)
                if edge is not None:
                    edge.metrics.responses.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class StreamingEndpoint:
    """A function endpoint as a plain ASGI app, for the routes whose responses stream: a stream
    holds its request's coroutine frames for as long as it lasts (thousands at once on an edge),
    and Starlette wraps a function endpoint in three more of them and a second layer of exception
    handling, which the app's own layer (the same handlers) makes redundant."""

    def __init__(self, endpoint: Callable[[Request], Awaitable[Response]]) -> None:
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.endpoint(Request(scope, receive, send))
        await response(scope, receive, send)


def create_app(settings: EdgeSettings | None = None) -> Starlette:
    edge_settings = settings or EdgeSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        edge = EdgeState(edge_settings)
        await edge.start()
        app.state.edge = edge
        try:
            yield
        finally:
            await edge.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", StreamingEndpoint(chat_completions), methods=["POST"]),
            Route("/v1/chat/completions/{completion_id}/stream", StreamingEndpoint(resume_stream), methods=["GET"]),
            Route("/v1/chat/completions/{completion_id}/continue", StreamingEndpoint(continue_turn), methods=["POST"]),
            Route("/v1/chat/completions/{completion_id}/cancel", cancel_completion, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/conversations", list_conversations, methods=["GET"]),
            Route("/v1/usage", tenant_usage, methods=["GET"]),
            Route("/v1/keys", list_keys, methods=["GET"]),
            Route("/v1/keys", create_key, methods=["POST"]),
            Route("/v1/keys/self", own_key, methods=["GET"]),
            Route("/v1/keys/{key_id}", revoke_key, methods=["DELETE"]),
            Route("/v1/conversations/{conversation_id}/messages", list_messages, methods=["GET"]),
            Route("/console", console_root, methods=["GET"]),
            Route("/console/", console, methods=["GET"]),
            Route("/console/{name}", console, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        exception_handlers=HANDLERS,
        lifespan=lifespan,
    )
    app.add_middleware(CountResponses)
    app.add_middleware(RefuseAmbiguousFraming)  # added last: runs first
    return app
