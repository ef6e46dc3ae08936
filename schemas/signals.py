"""The bus's records about turns rather than of them: a cancel sent to the GPU consumers
(``Control``), moderation's decisions (``ModerationDecision``, for ClickHouse and audit), and each
GPU consumer's report of its prefix cache and load (``CacheReport``, for KV-cache-aware routing).
Like the turn's own records (records.py), each names the Avro schema it is written with."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenbus.schemas.record_fields import now_ms, shallow_fields


class ControlAction(str, enum.Enum):
    CANCEL = "CANCEL"
    # Readers map symbols they do not know (from a newer writer) to UNKNOWN and ignore them.
    UNKNOWN = "UNKNOWN"


# A cancel may name a group of requests rather than one: ``{group}-*`` stands for every request
# whose id is ``{group}-{n}`` (a batch's lines, a response's choices). One record then cancels
# thousands, and a reader that does not know the form takes it for an id no request has.
GROUP_WILDCARD = "-*"


def group_cancel_id(group: str) -> str:
    """The id a cancel of every request ``{group}-{n}`` names."""
    return group + GROUP_WILDCARD


def cancelled_group(request_id: str) -> str | None:
    """The group a cancel's id names (``group_cancel_id``); None for one request's id."""
    return request_id[:-len(GROUP_WILDCARD)] if request_id.endswith(GROUP_WILDCARD) else None


def group_of(request_id: str) -> str | None:
    """The group a request's id places it in (``{group}-{n}``, n a line or choice number); None otherwise."""
    group, _, member = request_id.rpartition("-")
    return group if group and member.isdigit() else None


@dataclass(slots=True)
class Control:
    schema_name: ClassVar[str] = "tokenbus.Control"

    request_id: str
    action: ControlAction
    reason: str = ""
    created_at_ms: int = field(default_factory=now_ms)

    def to_avro(self) -> dict[str, Any]:
        return {**shallow_fields(self), "action": self.action.value}

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
        return shallow_fields(self)

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> ModerationDecision:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A prompt prefix an engine holds: its chain hash (schemas/prefixes.py) and how many of its
    prompt tokens are cached."""

    hash: int
    tokens: int


@dataclass(slots=True)
class CacheReport:
    """What one GPU consumer's engine holds in its prefix cache, the request partitions it owns and
    its load; routers index these to send a request where its prefix is cached."""

    schema_name: ClassVar[str] = "tokenbus.CacheReport"

    worker_id: str
    model: str
    started_at_ms: int
    seq: int
    snapshot: bool = False  # ``stored`` is everything the worker holds
    stored: list[CachedPrefix] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    partitions: list[tuple[str, int]] = field(default_factory=list)  # (topic, partition), all it owns
    running: int = 0
    waiting: int = 0
    leaving: bool = False
    created_at_ms: int = field(default_factory=now_ms)

    def to_avro(self) -> dict[str, Any]:
        return {**shallow_fields(self), "stored": [{"hash": p.hash, "tokens": p.tokens} for p in self.stored],
                "partitions": [{"topic": t, "partition": n} for t, n in self.partitions]}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> CacheReport:
        return cls(**{**data, "stored": [CachedPrefix(p["hash"], p["tokens"]) for p in data["stored"]],
                      "partitions": [(p["topic"], p["partition"]) for p in data["partitions"]]})
