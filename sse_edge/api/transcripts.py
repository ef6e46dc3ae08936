"""Tenant-scoped transcript reads: ``GET /v1/conversations`` and
``GET /v1/conversations/{conversation_id}/messages``. The tenant always comes from the
API key, never from the request, so a key reads its own tenant's transcripts only."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import NotFound
from tokenbus.sse_edge.protocol.completion_bodies import tool_calls_body
from tokenbus.sse_edge.protocol.validation import invalid_cursor, page_params
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.transcripts.model import BadCursor, Page, TranscriptMessage


def list_body(page: Page, rows: list[dict]) -> dict:
    return {"object": "list", "data": rows, "has_more": page.next_cursor is not None, "next_cursor": page.next_cursor}


async def list_conversations(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    limit, after = page_params(request, 50)
    try:
        page = await edge.transcripts().list_conversations(key.tenant, limit, after)
    except BadCursor:
        raise invalid_cursor() from None
    rows = [{"object": "conversation", "id": c.conversation_id, "model": c.model,
             "last_turn_at": c.last_turn_at_ms / 1000, "last_request_id": c.last_request_id} for c in page.items]
    return JSONResponse(list_body(page, rows))


def message_row(m: TranscriptMessage) -> dict[str, Any]:
    row: dict[str, Any] = {"object": "conversation.message", "request_id": m.request_id, "role": m.role, "content": m.content,
           "model": m.model, "finish_reason": m.finish_reason or None, "status": m.status,
           "created_at": m.turn_at_ms / 1000, "cursor": m.cursor}
    if m.tool_calls:
        row["tool_calls"] = tool_calls_body([(c.id, c.name, c.arguments) for c in m.calls])
    if m.tool_call_id:
        row["tool_call_id"] = m.tool_call_id
    return row


async def list_messages(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    limit, after = page_params(request, 100)
    conversation_id = request.path_params["conversation_id"]
    try:
        page = await edge.transcripts().list_messages(key.tenant, conversation_id, limit, after)
    except BadCursor:
        raise invalid_cursor() from None
    if not page.items and after is None:
        # Another tenant's conversation and one that does not exist look the same.
        raise NotFound(f"No conversation '{conversation_id}'.", code="conversation_not_found")
    rows = [message_row(m) for m in page.items]
    return JSONResponse(list_body(page, rows))
