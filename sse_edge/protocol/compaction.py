"""OpenAI's compaction (``POST /v1/responses/compact``), the protocol side: the request, the
compacted response (its user messages, then one ``compaction`` item), and what a compaction item
holds and reads as when a later turn gives it back.

OpenAI's compaction item carries the summary encrypted, for its servers alone to read. Here it
is opaque to clients but not secret: ``encrypted_content`` is the summary as text, versioned and
base64url-encoded (``tbc1.``), which only the client that asked for it holds. A later turn reads it
as a system message (``SUMMARY_PREFIX``, as server-side history places its summaries)."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenbus.sse_edge.protocol.response_objects import item_id

ENCODING = "tbc1."
SUMMARY_PREFIX = "Summary of the earlier conversation: "
MAX_ENCRYPTED_CONTENT = 1_000_000  # characters: a summary is short; this only bounds what is decoded
INSTRUCTION = ("Summarize the conversation below so that it can go on from the summary alone. Keep names, facts, "
               "numbers, decisions, the results of tool calls, and what is still to be done; write only the summary.")


def encode_summary(summary: str) -> str:
    return ENCODING + base64.urlsafe_b64encode(summary.encode()).decode()


def decode_summary(encrypted_content: str) -> str:
    """The summary a compaction item holds; ValueError where it holds none this edge made."""
    if not encrypted_content.startswith(ENCODING):
        raise ValueError("is not a compaction this server made")
    try:
        return base64.b64decode(encrypted_content[len(ENCODING):], altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("is not a compaction this server made") from None


class CompactionItem(BaseModel):
    """A compaction item given back as input: the summary of what came before it."""

    model_config = ConfigDict(extra="ignore")  # created_by

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1, max_length=MAX_ENCRYPTED_CONTENT)
    id: str | None = Field(default=None, max_length=256)

    @field_validator("encrypted_content")
    @classmethod
    def _made_here(cls, value: str) -> str:
        decode_summary(value)
        return value

    @property
    def summary(self) -> str:
        return decode_summary(self.encrypted_content)

    def listed(self) -> dict[str, Any]:
        """As an item list shows it."""
        return {"id": self.id or item_id("cmp"), "type": self.type, "encrypted_content": self.encrypted_content}


class CompactRequest(BaseModel):
    """The part of OpenAI's compact request that tokenbus serves: what to compact (``input``, the
    chain ``previous_response_id`` ends, or both) and the model that summarizes it."""

    model_config = ConfigDict(extra="ignore")  # prompt_cache_key, service_tier, reasoning: nothing to change

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    seed: int | None = None  # vLLM's sampling extension, as a turn's


def compacted_object(response_id: str, created_at: int, user_texts: list[str], summary: str,
                     usage: dict[str, Any]) -> dict[str, Any]:
    """The compacted response: each user message as it was, then the compaction item."""
    messages = [{"id": item_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": text}]} for text in user_texts]
    compaction = {"id": item_id("cmp"), "type": "compaction", "encrypted_content": encode_summary(summary)}
    return {"id": response_id, "object": "response.compaction", "created_at": created_at,
            "output": [*messages, compaction], "usage": usage}

