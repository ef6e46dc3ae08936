"""Where each request's stream lives, kept in Redis so any edge process can find it: for
idempotent retries, resuming with Last-Event-ID, and cancelling after a disconnect unless
the client comes back."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from tokenbus.schemas import shallow_fields
from tokenbus.stores.redis_client import RedisClient


@dataclass(frozen=True, slots=True)
class StreamRecord:
    request_id: str
    tenant: str
    model: str
    partition: int  # of ``topic``
    start_offset: int  # no event of this request lies before it
    include_usage: bool = False
    body_hash: str = ""
    # Where the request lies on the bus as published (what a continuation of an incomplete turn
    # repeats): the record names it rather than holding it, prompt and all, for a day in Redis.
    request_topic: str = ""
    request_partition: int = -1
    request_offset: int = -1
    created_at_ms: int = 0  # the request's, for the ``created`` of a stream resumed later
    # Where its events are written: ``tokens`` when empty, else a rolled reply log (topics/replies.py).
    topic: str = ""
    # The request itself (Avro, base64), as records written before the request's place was kept
    # held it; read as such while they last.
    request: str = ""
    text_prompt: bool = False  # a text completion's stream: read again in its shapes
    # A response of several choices (OpenAI's ``n``, a batch of prompts): the requests, one a choice
    # in index order, whose events on ``partition`` are its stream; this many choices a prompt.
    choices: list[str] = dataclasses.field(default_factory=list)
    choices_per_prompt: int = 1
    tier: str = ""  # the tier it ran at, which a stream read again names (unknown in older records)

    @property
    def several_choices(self) -> bool:
        return len(self.choices) > 1

    @property
    def names_request(self) -> bool:
        return bool(self.request) or self.request_offset >= 0


STREAM_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(StreamRecord))


class IdempotencyConflict(Exception):
    """The idempotency key was used before with another body."""


class StreamRegistry:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s

    def _stream(self, request_id: str) -> str:
        return f"{self._prefix}stream:{request_id}"

    def _idempotency(self, tenant: str, key: str) -> str:
        # The client's key is hashed: whatever bytes it holds, it names one Redis key of one tenant.
        return f"{self._prefix}idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"

    def _continued(self, request_id: str) -> str:
        return f"{self._prefix}continued:{request_id}"

    async def claim_continuation(self, request_id: str, continuation_id: str) -> str | None:
        """Bind an incomplete turn to the one request that continues it; returns the continuation
        that claimed it first, if another did."""
        if await self._redis.set(self._continued(request_id), continuation_id, nx=True, ex=self._ttl_s):
            return None
        earlier = await self._redis.get(self._continued(request_id))
        return earlier.decode() if earlier else None

    async def release_continuation(self, request_id: str, continuation_id: str) -> None:
        """The continuation was never published: the turn may be continued again."""
        if await self._redis.get(self._continued(request_id)) == continuation_id.encode():
            await self._redis.delete(self._continued(request_id))

    def _detached(self, request_id: str) -> str:
        return f"{self._prefix}detached:{request_id}"

    async def register(self, record: StreamRecord) -> None:
        await self._redis.set(self._stream(record.request_id), json.dumps(shallow_fields(record)), ex=self._ttl_s)

    async def get(self, request_id: str) -> StreamRecord | None:
        raw = await self._redis.get(self._stream(request_id))
        if not raw:
            return None
        # What a newer edge may write besides (during a rolling upgrade) is left out.
        return StreamRecord(**{k: v for k, v in json.loads(raw).items() if k in STREAM_RECORD_FIELDS})

    async def claim(self, tenant: str, key: str, body_hash: str, request_id: str) -> str | None:
        """Bind an idempotency key to a new request; returns the earlier request's id if the key
        was used before with the same body, raises IdempotencyConflict if with another."""
        value = json.dumps({"request_id": request_id, "body_hash": body_hash})
        while True:
            if await self._redis.set(self._idempotency(tenant, key), value, nx=True, ex=self._ttl_s):
                return None
            raw = await self._redis.get(self._idempotency(tenant, key))
            if raw is not None:
                break
            # Let go of between the two calls (its request failed, or was not stored and its
            # client went): free again, so it is claimed again, not taken for another body's.
        earlier = json.loads(raw)
        if earlier.get("body_hash") != body_hash:
            raise IdempotencyConflict(key)
        return str(earlier["request_id"])

    async def release(self, tenant: str, key: str, request_id: str) -> None:
        """Unbind an idempotency key from a request that was never published (it failed first)."""
        raw = await self._redis.get(self._idempotency(tenant, key))
        if raw and json.loads(raw).get("request_id") == request_id:
            await self._redis.delete(self._idempotency(tenant, key))

    async def detach(self, request_id: str, grace_s: float) -> None:
        await self._redis.set(self._detached(request_id), "1", px=max(1, int(grace_s * 1000) + 60_000))

    async def attach(self, request_id: str) -> None:
        await self._redis.delete(self._detached(request_id))

    async def still_detached(self, request_id: str) -> bool:
        return bool(await self._redis.exists(self._detached(request_id)))
