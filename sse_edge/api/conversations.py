"""OpenAI's Conversations API: a conversation object made (with items, metadata), read, its
metadata set, deleted; its items listed, added, read and deleted. A Responses API turn naming a
conversation (``conversation``) is prompted with its items and adds its own to it once it ends
(api/responses.py, plumbing/kept_responses.py).

A conversation is the tenant's alone: another tenant's key finds none. Kept at the edge, in Redis
(stores/conversations.py), while it is in use (``TOKENBUS_EDGE_CONVERSATION_TTL_S`` after it was
last written); a deployment that stores no responses keeps no conversations either.

(``GET /v1/conversations`` and ``.../messages``, the conversations as transcribed, are
api/transcripts.py's: they read the transcripts of any conversation, these objects' included.)"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.errors import InvalidRequest, NotFound, unless_store_down
from tokenbus.sse_edge.plumbing.kept_responses import compact, listed_items
from tokenbus.sse_edge.protocol.batches import list_body
from tokenbus.sse_edge.protocol.conversations import (
    AddItemsRequest,
    CreateConversationRequest,
    UpdateConversationRequest,
    conversation_object,
    deleted_object,
    items_of,
)
from tokenbus.sse_edge.protocol.responses import parse_items
from tokenbus.sse_edge.protocol.validation import cursor_page, json_object, list_order, parse_body, read_body
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.conversations import StoredConversation, added_at_ms, group_field, new_conversation_id
from tokenbus.stores.keys import ApiKey

Stored = TypeVar("Stored")


async def create_conversation(request: Request) -> Response:
    edge, key = await served(request)
    asked = parse_body(await body_of(request, edge), CreateConversationRequest)
    now_ms = int(time.time() * 1000)
    conversation_id = new_conversation_id()
    groups = [(group_field(now_ms, conversation_id), added_items(asked.items))] if asked.items else []
    stored = StoredConversation(conversation_id, key.tenant, now_ms // 1000, compact(asked.metadata or {}), groups)
    await in_store(edge.conversations.create(stored))
    return JSONResponse(conversation_object(stored))


async def retrieve_conversation(request: Request) -> Response:
    _, _, stored = await tenant_conversation(request)
    return JSONResponse(conversation_object(stored))


async def update_conversation(request: Request) -> Response:
    edge, _, stored = await tenant_conversation(request)
    asked = parse_body(await body_of(request, edge), UpdateConversationRequest)
    await in_store(edge.conversations.set_metadata(stored.id, compact(asked.metadata)))
    return JSONResponse({**conversation_object(stored), "metadata": asked.metadata})


async def delete_conversation(request: Request) -> Response:
    edge, key, stored = await tenant_conversation(request)
    await in_store(edge.conversations.delete(key.tenant, stored.id))
    return JSONResponse(deleted_object(stored.id))


async def list_items(request: Request) -> Response:
    """A page of the conversation's items, newest first unless ``order=asc`` (OpenAI's default)."""
    _, _, stored = await tenant_conversation(request)
    items = items_of(stored)
    if list_order(request) == "desc":
        items.reverse()
    page, has_more = cursor_page(items, [item["id"] for item in items], request, default_limit=20, max_limit=100)
    return JSONResponse(list_body(page, has_more))


async def add_items(request: Request) -> Response:
    """Items added at once, after those the conversation holds: answered as a list of them."""
    edge, _, stored = await tenant_conversation(request)
    asked = parse_body(await body_of(request, edge), AddItemsRequest)
    items = added_items(asked.items)
    at_ms = max(int(time.time() * 1000), last_added_ms(stored) + 1)  # (after the last, whatever the clocks)
    if not await in_store(edge.conversations.put_group(stored.id, group_field(at_ms, item_group_id()), items)):
        raise conversation_not_found(stored.id)
    return JSONResponse(list_body(json.loads(items), False))


async def retrieve_item(request: Request) -> Response:
    _, _, stored = await tenant_conversation(request)
    _, index, items = find_item(stored, request.path_params["item_id"])
    return JSONResponse(items[index])


async def delete_item(request: Request) -> Response:
    """The item taken out of the conversation (turns after it are not prompted with it): answered
    with the conversation."""
    edge, _, stored = await tenant_conversation(request)
    field, index, items = find_item(stored, request.path_params["item_id"])
    del items[index]
    # (a group left empty stays, empty: a turn's second reader, finding it, adds nothing back)
    await in_store(edge.conversations.put_group(stored.id, field, compact(items)))
    return JSONResponse(conversation_object(stored))


async def served(request: Request) -> tuple[EdgeState, ApiKey]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    if not edge.settings.store_responses:
        raise InvalidRequest("Conversations are not kept by this deployment (it stores no responses).",
                             code="conversations_not_stored")
    return edge, key


async def tenant_conversation(request: Request) -> tuple[EdgeState, ApiKey, StoredConversation]:
    edge, key = await served(request)
    conversation_id = request.path_params["conversation_id"]
    stored = await in_store(edge.conversations.get(key.tenant, conversation_id))
    if stored is None:
        raise conversation_not_found(conversation_id)
    return edge, key, stored


async def body_of(request: Request, edge: EdgeState) -> dict[str, Any]:
    return json_object(await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s))


def added_items(raw: list[dict[str, Any]]) -> str:
    """Items a client adds, checked as a Responses request's input items are, as the list shows them."""
    return listed_items(parse_items(raw, "items"))


def item_group_id() -> str:
    """The group of items a client adds at once (a turn's group is named by its response)."""
    return f"items_{uuid.uuid4().hex}"


def last_added_ms(stored: StoredConversation) -> int:
    return max((added_at_ms(field) for field, _ in stored.groups), default=0)


def find_item(stored: StoredConversation, item_id: str) -> tuple[str, int, list[dict[str, Any]]]:
    """The group holding the item (its field, the item's place, its items)."""
    for field, raw in stored.groups:
        items = json.loads(raw)
        for index, item in enumerate(items):
            if item["id"] == item_id:
                return field, index, items
    raise NotFound(f"Item with id '{item_id}' not found.", param="item_id", code="item_not_found")


def conversation_not_found(conversation_id: str) -> NotFound:
    return NotFound(f"Conversation with id '{conversation_id}' not found.", param="conversation_id",
                    code="conversation_not_found")


async def in_store(operation: Awaitable[Stored]) -> Stored:
    return await unless_store_down(operation, "Conversations", "conversations_unavailable")
