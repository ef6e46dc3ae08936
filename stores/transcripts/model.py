"""The transcript data model, shared by every store.

A conversation belongs to one tenant; the tenant is part of every key, so no read can
cross tenants. A turn is one request: the prompt messages it added and the assistant's
reply. Messages are ordered by ``(turn_at_ms, request_id, position)``, and a turn is
written under its request id, so writing it again (a replay) rewrites the same rows.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tokenbus.schemas import INCOMPLETE_FINISH_REASONS, ChatMessage, Completion, ToolCall

T = TypeVar("T")

MAX_PAGE = 500


def page_size(limit: int) -> int:
    """A requested page size, clamped to 1..MAX_PAGE."""
    return max(1, min(int(limit), MAX_PAGE))


@dataclass(frozen=True, slots=True)
class TranscriptMessage:
    tenant: str
    conversation_id: str
    turn_at_ms: int
    request_id: str
    position: int
    role: str
    content: str
    model: str = ""
    finish_reason: str = ""
    tool_calls: str = ""  # an assistant message's function calls: JSON text of [{id, name, arguments}]
    tool_call_id: str = ""  # a tool message: the call it answers
    written_at_ms: int = 0  # when the store last wrote it (set by the store; what `tokenbus trace` shows)

    @property
    def status(self) -> str:
        """``incomplete`` for a reply whose stream ended without finishing (it can be continued)."""
        return "incomplete" if self.finish_reason in INCOMPLETE_FINISH_REASONS else "completed"

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(**c) for c in json.loads(self.tool_calls)] if self.tool_calls else []

    @property
    def cursor(self) -> str:
        return encode_cursor([self.turn_at_ms, self.request_id, self.position])


@dataclass(frozen=True, slots=True)
class Summary:
    """A summary of a conversation's turns up to and including ``through`` (turn time, request id)."""

    content: str
    through_turn_at_ms: int
    through_request_id: str

    @property
    def through(self) -> tuple[int, str]:
        return self.through_turn_at_ms, self.through_request_id


@dataclass(frozen=True, slots=True)
class Conversation:
    tenant: str
    conversation_id: str
    model: str
    last_turn_at_ms: int
    last_request_id: str
    summary: Summary | None = None  # of its earlier turns, where summaries are made (read by get_conversation)

    @property
    def cursor(self) -> str:
        return encode_cursor([self.conversation_id])


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """One request's rows: what a store writes for one Completion."""

    tenant: str
    conversation_id: str
    request_id: str
    turn_at_ms: int
    model: str
    messages: list[TranscriptMessage] = field(default_factory=list)
    # When this version of the turn was finished: of two versions (an incomplete turn and its
    # continuation), the later one stands, whatever order they are written in.
    version_ms: int = 0


class BadCursor(ValueError):
    """A page cursor that this store did not hand out."""


def encode_cursor(key: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[Any]:
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, UnicodeDecodeError):
        raise BadCursor("malformed cursor") from None
    if not isinstance(key, list) or len(key) != arity:
        raise BadCursor("malformed cursor")
    return key


def new_messages(messages: list[ChatMessage], continues_conversation: bool) -> list[ChatMessage]:
    """The prompt messages this turn adds. Clients resend the whole history each turn; in a
    named conversation the earlier turns are stored already (everything up to the last
    assistant message), so only what follows it is new."""
    if not continues_conversation:
        return list(messages)
    last_assistant = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    return list(messages[last_assistant + 1:])


# A request that asks a model to summarize a conversation's earlier turns carries these
# annotations; the transcripts job stores its Completion as the conversation's summary.
PURPOSE = "purpose"
PURPOSE_SUMMARY = "summary"


def summary_annotations(conversation_id: str, through_turn_at_ms: int, through_request_id: str) -> dict[str, str]:
    return {PURPOSE: PURPOSE_SUMMARY, "conversation_id": conversation_id,
            "through_turn_at_ms": str(through_turn_at_ms), "through_request_id": through_request_id}


def is_summary(completion: Completion) -> bool:
    """Whether ``completion`` answers a summarizing request (it is no turn of its conversation)."""
    return completion.annotations.get(PURPOSE) == PURPOSE_SUMMARY


def summary_of(completion: Completion) -> tuple[str, Summary] | None:
    """The conversation and summary a summarizing request's Completion holds; None for any other
    Completion (a turn), and for a summary the model did not finish (a refusal, a failure)."""
    notes = completion.annotations
    if not is_summary(completion):
        return None
    if completion.finish_reason not in ("stop", "length") or not completion.text.strip():
        return None
    summary = Summary(completion.text.strip(), int(notes["through_turn_at_ms"]), notes["through_request_id"])
    return notes["conversation_id"], summary


def calls_json(calls: tuple[ToolCall, ...]) -> str:
    if not calls:
        return ""
    return json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls], separators=(",", ":"))


def turn_of(completion: Completion, assistant_text: str | None = None) -> Turn:
    """The rows a Completion contributes; a request without a conversation id is its own conversation.
    A continuation of an incomplete turn rewrites that turn's rows (its request id and time)."""
    request_id = completion.continues_request_id or completion.request_id
    turn_at_ms = completion.continues_turn_at_ms or completion.created_at_ms
    conversation_id = completion.conversation_id or request_id
    prompt = new_messages(completion.messages, completion.conversation_id is not None)
    reply = ChatMessage("assistant", completion.text if assistant_text is None else assistant_text,
                        tuple(completion.tool_calls))
    rows = [
        TranscriptMessage(completion.tenant, conversation_id, turn_at_ms, request_id, position, m.role, m.content,
                          completion.model,
                          completion.finish_reason if m is reply else "", calls_json(m.tool_calls),
                          m.tool_call_id or "")
        for position, m in enumerate([*prompt, reply])
    ]
    return Turn(completion.tenant, conversation_id, request_id, turn_at_ms, completion.model, rows,
                completion.finished_at_ms)
