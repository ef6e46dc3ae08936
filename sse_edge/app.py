"""The edge's ASGI application: its routes, error handlers and middleware."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenbus.sse_edge.api.batches import cancel_batch, create_batch, list_batches, retrieve_batch
from tokenbus.sse_edge.api.cancel import cancel_completion
from tokenbus.sse_edge.api.chat import chat_completions
from tokenbus.sse_edge.api.compaction import compact_response
from tokenbus.sse_edge.api.completions import completions
from tokenbus.sse_edge.api.console import console, console_root
from tokenbus.sse_edge.api.continuation import continue_turn
from tokenbus.sse_edge.api.conversations import (
    add_items,
    create_conversation,
    delete_conversation,
    delete_item,
    list_items,
    retrieve_conversation,
    retrieve_item,
    update_conversation,
)
from tokenbus.sse_edge.api.files import delete_file, file_content, list_files, retrieve_file, upload_file
from tokenbus.sse_edge.api.input_tokens import count_input_tokens
from tokenbus.sse_edge.api.keys import create_key, list_keys, own_key, revoke_key
from tokenbus.sse_edge.api.models import list_models, retrieve_model
from tokenbus.sse_edge.api.moderations import moderations
from tokenbus.sse_edge.api.ops import healthz, metrics, openapi, readyz
from tokenbus.sse_edge.api.responses import create_response
from tokenbus.sse_edge.api.resume import resume_stream
from tokenbus.sse_edge.api.stored_completions import (
    delete_completion,
    list_completions,
    list_stored_messages,
    retrieve_completion,
    update_completion,
)
from tokenbus.sse_edge.api.stored_responses import cancel_response, delete_response, list_input_items, retrieve_response
from tokenbus.sse_edge.api.transcripts import list_conversations, list_messages
from tokenbus.sse_edge.api.usage import tenant_usage
from tokenbus.sse_edge.errors import HANDLERS
from tokenbus.sse_edge.plumbing.framing import RefuseAmbiguousFraming
from tokenbus.sse_edge.plumbing.stream_response import DEFERRED_BODY
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


class EdgeApp(Starlette):
    """Starlette, except that a token stream's body is written here, once the middleware and
    routing have returned (sse_edge/plumbing/stream_response.py, ``DEFERRED_BODY``): they act on a response's
    start only, yet would hold a dozen coroutine frames and closures for as long as each stream
    lasts, about 4 KiB a stream on an edge holding thousands. So a middleware added below must not
    need to see a stream's body; an exception in the body reaches the server as it did through them
    (once a response has started, they re-raise)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        scope[DEFERRED_BODY] = None
        await super().__call__(scope, receive, send)
        write_body = scope.pop(DEFERRED_BODY, None)
        if write_body is not None:
            await write_body(receive, send)


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

    app = EdgeApp(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/chat/completions", list_completions, methods=["GET"]),
            Route("/v1/chat/completions/{completion_id}", retrieve_completion, methods=["GET"]),
            Route("/v1/chat/completions/{completion_id}", update_completion, methods=["POST"]),
            Route("/v1/chat/completions/{completion_id}", delete_completion, methods=["DELETE"]),
            Route("/v1/chat/completions/{completion_id}/messages", list_stored_messages, methods=["GET"]),
            Route("/v1/chat/completions/{completion_id}/stream", resume_stream, methods=["GET"]),
            Route("/v1/chat/completions/{completion_id}/continue", continue_turn, methods=["POST"]),
            Route("/v1/chat/completions/{completion_id}/cancel", cancel_completion, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/compact", compact_response, methods=["POST"]),
            Route("/v1/responses/input_tokens", count_input_tokens, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
            Route("/v1/moderations", moderations, methods=["POST"]),
            Route("/v1/files", upload_file, methods=["POST"]),
            Route("/v1/files", list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
            Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_batch, methods=["POST"]),
            Route("/v1/batches", list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
            Route("/v1/conversations", list_conversations, methods=["GET"]),
            Route("/v1/conversations", create_conversation, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", retrieve_conversation, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}", update_conversation, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
            Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items", add_items, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}/items/{item_id}", delete_item, methods=["DELETE"]),
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
    # Both act on a response's start only: a stream's body is written past them (EdgeApp).
    app.add_middleware(CountResponses)
    app.add_middleware(RefuseAmbiguousFraming)  # added last: runs first
    return app
