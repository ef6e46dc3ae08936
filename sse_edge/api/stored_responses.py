"""A stored response's endpoints (OpenAI's Responses API): ``GET /v1/responses/{id}`` (whole, or
its stream again), ``DELETE``, ``cancel`` and ``input_items``; another tenant's is not found."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.api.response_streams import (
    read_on_if_unread,
    response_not_found,
    scores_asked,
    stored_response,
    stream_again,
)
from tokenbus.sse_edge.api.resume import find_stream
from tokenbus.sse_edge.errors import InvalidRequest, Unavailable
from tokenbus.sse_edge.protocol.batches import list_body
from tokenbus.sse_edge.protocol.validation import cursor_page, list_order
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.keys import ApiKey
from tokenbus.stores.responses import StoredResponse

CANCEL_WAIT_S = 3.0  # for a cancelled turn's stream to end and store it


async def tenant_response(request: Request) -> tuple[EdgeState, ApiKey, StoredResponse]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    response_id = request.path_params["response_id"]
    stored = await stored_response(edge, key, response_id)
    if stored is None:
        raise response_not_found(response_id)
    return edge, key, stored


async def retrieve_response(request: Request) -> Response:
    """A stored response; with ``stream=true``, its stream again, after ``starting_after`` if given.
    A response under way whose reader is gone (its edge stopped) is read on from here."""
    edge, key, stored = await tenant_response(request)
    if request.query_params.get("stream", "false").lower() in ("false", "0"):
        read_on_if_unread(edge, key, stored)
        return Response(stored.body, media_type="application/json")
    raw = request.query_params.get("starting_after", "-1")
    if not raw.lstrip("-").isdigit() or int(raw) < -1:
        raise InvalidRequest("starting_after must be the sequence number of an event received, like 12.",
                             param="starting_after", code="invalid_value")
    return await stream_again(request, edge, key, stored.id, json.loads(stored.body), scores_asked(stored), int(raw))


async def delete_response(request: Request) -> Response:
    edge, key, stored = await tenant_response(request)
    try:
        await edge.responses.delete(key.tenant, stored.id)
    except (redis.RedisError, OSError):
        raise Unavailable("Stored responses are unavailable right now; retry shortly.",
                          "responses_unavailable") from None
    return JSONResponse({"id": stored.id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """Stop a turn's generation now (OpenAI cancels background responses so; here any turn under
    way, as chat completions' ``cancel``). Answered with the response as it ended (stored, where it
    is), or, where it is not stored, with its id and ``cancelled``. A response that has ended is as
    it was."""
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    response_id = request.path_params["response_id"]
    stored = await stored_response(edge, key, response_id)
    if stored is None or json.loads(stored.body)["status"] == "in_progress":
        await find_stream(edge, response_id, key.tenant, response_not_found)
        await edge.bus.cancel(response_id, "cancelled by the client")
        if stored is not None:
            read_on_if_unread(edge, key, stored)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:  # its stream ends, and stores it
            await asyncio.sleep(0.05)
            stored = await stored_response(edge, key, response_id)
            if stored is not None and json.loads(stored.body)["status"] != "in_progress":
                break
    if stored is None:
        return JSONResponse({"id": response_id, "object": "response", "status": "cancelled"})
    return Response(stored.body, media_type="application/json")


async def list_input_items(request: Request) -> Response:
    _, _, stored = await tenant_response(request)
    items: list[dict[str, Any]] = json.loads(stored.input_items)
    if list_order(request) == "desc":
        items.reverse()
    page, has_more = cursor_page(items, [item["id"] for item in items], request, default_limit=20, max_limit=100)
    return JSONResponse(list_body(page, has_more))
