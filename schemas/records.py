"""The records that travel on the bus, as dataclasses.

Each class names the Avro schema (``schemas/avro/<name>.avsc``) it is written with.
Field names and defaults mirror the schema, so ``to_avro`` / ``from_avro`` are plain
conversions; the codec does the bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar


def now_ms() -> int:
    return int(time.time() * 1000)


def estimate_prompt_tokens(texts: Iterable[str]) -> int:
    """Prompt tokens of messages with these texts, without a tokenizer: about four characters a
    token, plus a few per message. For budgets and admission only; engines count exactly."""
    return sum(len(text) // 4 + 4 for text in texts)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _fields(record: object) -> dict[str, Any]:
    """A record's fields as a shallow dict: ``dataclasses.asdict`` deep-copies, and this is the hot path."""
    # mypy does not take a class for Hashable here; it is.
    return {name: getattr(record, name) for name in _field_names(type(record))}  # type: ignore[arg-type]


def _messages_to_avro(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def _messages_from_avro(items: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage(role=m["role"], content=m["content"]) for m in items]


@dataclass(slots=True)
class ChatRequest:
    schema_name: ClassVar[str] = "tokenbus.ChatRequest"

    request_id: str
    model: str
    tier: str
    messages: list[ChatMessage]
    reply_topic: str
    reply_partition: int
    tenant: str = ""
    key_id: str = ""
    conversation_id: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    created_at_ms: int = field(default_factory=now_ms)
    deadline_ms: int | None = None

    @property
    def partition_key(self) -> str:
        """Requests of one conversation share a partition, so they share a GPU consumer's caches."""
        return self.conversation_id or self.request_id

    @property
    def estimated_prompt_tokens(self) -> int:
        return estimate_prompt_tokens(m.content for m in self.messages)

    def to_avro(self) -> dict[str, Any]:
        return {**_fields(self), "messages": _messages_to_avro(self.messages)}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> ChatRequest:
        return cls(**{**data, "messages": _messages_from_avro(data["messages"])})


@dataclass(slots=True)
class TokenEvent:
    """One engine step's delta for one request; the final one carries finish_reason and usage."""

    schema_name: ClassVar[str] = "tokenbus.TokenEvent"

    request_id: str
    seq: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    worker_id: str = ""
    created_at_ms: int = field(default_factory=now_ms)
    # Output moderation's stop signal: ends the stream wherever its reader is (see ReplyStream.offer).
    truncate: bool = False
    # Who asked, on the first event only: output moderation applies the tier's actions.
    tenant: str | None = None
    tier: str | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    def to_avro(self) -> dict[str, Any]:
        return _fields(self)

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> TokenEvent:
        return cls(**data)


@dataclass(slots=True)
class Completion:
    """Closes a request: the source of transcripts and billing."""

    schema_name: ClassVar[str] = "tokenbus.Completion"

    request_id: str
    model: str
    tier: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    created_at_ms: int
    started_at_ms: int
    finished_at_ms: int
    tenant: str = ""
    key_id: str = ""
    conversation_id: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    cancelled: bool = False
    error: str | None = None
    worker_id: str = ""
    first_token_at_ms: int | None = None

    @classmethod
    def for_request(cls, request: ChatRequest, **outcome: Any) -> Completion:
        """The Completion that closes ``request``: who asked and what is carried over from the
        request, plus ``outcome`` (text, finish_reason, token counts, timings, worker_id, ...)."""
        return cls(request_id=request.request_id, model=request.model, tier=request.tier, tenant=request.tenant,
                   key_id=request.key_id, conversation_id=request.conversation_id, messages=request.messages,
                   created_at_ms=request.created_at_ms, **outcome)

    def to_avro(self) -> dict[str, Any]:
        return {**_fields(self), "messages": _messages_to_avro(self.messages)}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Completion:
        return cls(**{**data, "messages": _messages_from_avro(data["messages"])})


class ControlAction(str, enum.Enum):
    CANCEL = "CANCEL"
    # Readers map symbols they do not know (from a newer writer) to UNKNOWN and ignore them.
    UNKNOWN = "UNKNOWN"


@dataclass(slots=True)
class Control:
    schema_name: ClassVar[str] = "tokenbus.Control"

    request_id: str
    action: ControlAction
    reason: str = ""
    created_at_ms: int = field(default_factory=now_ms)

    def to_avro(self) -> dict[str, Any]:
        return {**_fields(self), "action": self.action.value}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Control:
        return cls(**{**data, "action": ControlAction(data["action"])})


@dataclass(slots=True)
class ModerationDecision:
    """What moderation decided about a prompt (``stage="input"``) or a token stream (``"output"``)."""

    schema_name: ClassVar[str] = "tokenbus.ModerationDecision"

    request_id: str
    stage: str
    action: str
    tenant: str = ""
    model: str = ""
    tier: str = ""
    categories: list[str] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    seq: int | None = None
    policy: str = ""
    decided_at_ms: int = field(default_factory=now_ms)

    def to_avro(self) -> dict[str, Any]:
        return _fields(self)

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> ModerationDecision:
        return cls(**data)


Record = ChatRequest | TokenEvent | Completion | Control | ModerationDecision
RECORD_TYPES: tuple[type[Record], ...] = (ChatRequest, TokenEvent, Completion, Control, ModerationDecision)
