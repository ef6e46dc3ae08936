"""OpenAI's stored chat completions in its shapes: a stored completion as retrieving or listing it
shows it (the ``chat.completion`` it was answered with, and its metadata), the messages it was asked
with as its messages list shows them, and the body of an update (new metadata)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from tokenbus.sse_edge.protocol.chat import ChatMessageParam
from tokenbus.sse_edge.protocol.metadata import Metadata


class UpdateCompletionRequest(BaseModel):
    """OpenAI's update of a stored completion: its metadata, replaced whole."""

    model_config = ConfigDict(extra="forbid")  # nothing else of it can change

    metadata: Metadata | None


def stored_object(body: str, metadata: dict[str, str]) -> dict[str, Any]:
    """A stored completion as retrieved: the completion it was answered with, and its metadata now."""
    return {**json.loads(body), "metadata": metadata}


def stored_messages(completion_id: str, messages: list[ChatMessageParam]) -> str:
    """The messages a completion was asked with, as its messages list shows them (JSON text): each
    with an id of its own, its text as ``content``, and the parts it was given as, where it was."""
    listed = []
    for index, message in enumerate(messages):
        item: dict[str, Any] = {"id": f"{completion_id}-{index}", "role": message.role,
                                "content": None if message.content is None else message.text(), "name": message.name,
                                "content_parts": [p.model_dump() for p in message.content]
                                if isinstance(message.content, list) else None}
        if message.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        listed.append(item)
    return json.dumps(listed, separators=(",", ":"), ensure_ascii=False)


def deleted_object(completion_id: str) -> dict[str, Any]:
    return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}
