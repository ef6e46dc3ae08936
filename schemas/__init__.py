"""Avro schemas of every record on the bus, their dataclasses and the codec."""

from schemas.codec import AvroCodec, DecodeError
from schemas.records import (
    ChatMessage,
    ChatRequest,
    Completion,
    Control,
    ControlAction,
    ModerationDecision,
    Record,
    TokenEvent,
    now_ms,
)

__all__ = [
    "AvroCodec",
    "ChatMessage",
    "ChatRequest",
    "Completion",
    "Control",
    "ControlAction",
    "DecodeError",
    "ModerationDecision",
    "Record",
    "TokenEvent",
    "now_ms",
]
