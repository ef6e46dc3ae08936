"""Avro schemas of every record on the bus, their dataclasses and the codec."""

from tokenbus.schemas.codec import AvroCodec, DecodeError
from tokenbus.schemas.records import (
    ChatMessage,
    ChatRequest,
    Completion,
    Control,
    ControlAction,
    ModerationDecision,
    Record,
    TokenEvent,
    estimate_prompt_tokens,
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
    "estimate_prompt_tokens",
    "now_ms",
]
