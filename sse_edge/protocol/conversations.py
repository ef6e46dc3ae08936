"""OpenAI's Conversations API protocol: its requests (a conversation made, its metadata set, items
added) and the objects it answers with. A conversation's items are the Responses API's input
items as an item list shows them (plumbing/kept_responses.py's ``listed_items``), and a turn's
output items as its response holds them. Nothing here knows about Redis or Kafka."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenbus.sse_edge.protocol.metadata import Metadata
from tokenbus.stores.conversations import StoredConversation

ITEMS_AT_ONCE = 20  # OpenAI's: a conversation is made, or added to, with up to 20 items at a time


class CreateConversationRequest(BaseModel):
    """``POST /v1/conversations``."""

    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] | None = Field(default=None, max_length=ITEMS_AT_ONCE)
    metadata: Metadata | None = None


class UpdateConversationRequest(BaseModel):
    """``POST /v1/conversations/{id}``: its metadata, replaced."""

    model_config = ConfigDict(extra="forbid")

    metadata: Metadata


class AddItemsRequest(BaseModel):
    """``POST /v1/conversations/{id}/items``."""

    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1, max_length=ITEMS_AT_ONCE)


def conversation_object(stored: StoredConversation) -> dict[str, Any]:
    return {"id": stored.id, "object": "conversation", "created_at": stored.created_at,
            "metadata": json.loads(stored.metadata)}


def deleted_object(conversation_id: str) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def items_of(stored: StoredConversation) -> list[dict[str, Any]]:
    """A conversation's items, in the order they were added."""
    return [item for _, items in stored.groups for item in json.loads(items)]


def turn_items(input_items: str, response: dict[str, Any]) -> str:
    """What a turn adds to its conversation once it ends: its input items, then its output."""
    return json.dumps([*json.loads(input_items), *response["output"]], separators=(",", ":"), ensure_ascii=False)
