"""Stored chat completions' endpoints (OpenAI's, for completions asked with ``store: true``):
``GET /v1/chat/completions`` (a page of them, by model and metadata), ``GET``, ``POST`` (new
metadata) and ``DELETE`` ``/v1/chat/completions/{id}``, and ``GET .../messages`` (what it was asked
with). Another tenant's is not found, whatever its id."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import InvalidRequest, NotFound, unless_store_down
from tokenbus.sse_edge.protocol.batches import list_body
from tokenbus.sse_edge.protocol.stored_completions import UpdateCompletionRequest, deleted_object, stored_object
from tokenbus.sse_edge.protocol.validation import (
    cursor_page,
    invalid_cursor,
    json_object,
    list_order,
    page_params,
    parse_body,
    read_body,
)
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.chat_completions import StoredCompletion
from tokenbus.stores.keys import ApiKey

Stored = TypeVar("Stored")
METADATA_PARAM = "metadata["  # a filter's pairs: metadata[key]=value, as OpenAI's clients send them


async def list_completions(request: Request) -> Response:
    """A page of the tenant's stored completions, oldest first unless ``order=desc``; of one
    ``model``, and whose metadata holds every ``metadata[key]=value`` given."""
    edge, key = await served(request)
    limit, after = page_params(request, default_limit=20, max_limit=100)
    newest_first = list_order(request, default="asc") == "desc"
    metadata = {name[len(METADATA_PARAM):-1]: value for name, value in request.query_params.items()
                if name.startswith(METADATA_PARAM) and name.endswith("]")}
    try:
        page, has_more = await in_store(edge.completions.page(
            key.tenant, limit, after, newest_first, request.query_params.get("model") or None, metadata))
    except KeyError:
        raise invalid_cursor() from None
    return JSONResponse(list_body([stored_object(s.body, s.metadata) for s in page], has_more))


async def retrieve_completion(request: Request) -> Response:
    _, _, stored = await tenant_completion(request)
    return JSONResponse(stored_object(stored.body, stored.metadata))


async def update_completion(request: Request) -> Response:
    """The completion with its metadata replaced (the only thing of it that changes)."""
    edge, key, stored = await tenant_completion(request)
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked = parse_body(json_object(raw), UpdateCompletionRequest)
    updated = await in_store(edge.completions.set_metadata(key.tenant, stored.id, asked.metadata or {}))
    if updated is None:  # (deleted meanwhile)
        raise completion_not_found(stored.id)
    return JSONResponse(stored_object(updated.body, updated.metadata))


async def delete_completion(request: Request) -> Response:
    edge, key, stored = await tenant_completion(request)
    await in_store(edge.completions.delete(key.tenant, stored.id))
    return JSONResponse(deleted_object(stored.id))


async def list_stored_messages(request: Request) -> Response:
    """The messages the completion was asked with, a page at a time, in their order unless ``order=desc``."""
    _, _, stored = await tenant_completion(request)
    messages: list[dict[str, Any]] = json.loads(stored.messages)
    if list_order(request, default="asc") == "desc":
        messages.reverse()
    page, has_more = cursor_page(messages, [m["id"] for m in messages], request, default_limit=20, max_limit=100)
    return JSONResponse(list_body(page, has_more))


async def served(request: Request) -> tuple[EdgeState, ApiKey]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    if not edge.settings.store_responses:
        raise InvalidRequest("Chat completions are not kept by this deployment (it stores no responses).",
                             code="completions_not_stored")
    return edge, key


async def tenant_completion(request: Request) -> tuple[EdgeState, ApiKey, StoredCompletion]:
    edge, key = await served(request)
    completion_id = request.path_params["completion_id"]
    stored = await in_store(edge.completions.get(key.tenant, completion_id))
    if stored is None:
        raise completion_not_found(completion_id)
    return edge, key, stored


def completion_not_found(completion_id: str) -> NotFound:
    return NotFound(f"Chat completion with id '{completion_id}' not found.", param="completion_id",
                    code="not_found")


async def in_store(operation: Awaitable[Stored]) -> Stored:
    return await unless_store_down(operation, "Stored chat completions", "completions_unavailable")
