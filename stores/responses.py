"""Stored responses, as OpenAI's Responses API keeps them (``store``, its default): the response
object a turn ended with, the input items it was asked with, and its context (what a later turn
naming it as ``previous_response_id`` continues). Kept in Redis, which every edge shares, as one
hash a response, for ``ttl_s`` (OpenAI keeps them 30 days). Every read names the tenant: another
tenant's response is not found, whatever its id.

The store keeps each part as the edge's JSON text and reads none of it: what a response object,
an item or a context is belongs to the edge (sse_edge/protocol/responses.py). A stored
response's reader holds a lease (``claim_reader``): an edge that finds one under way with no
reader (its edge stopped) takes the reading over."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from tokenbus.stores.redis_client import RedisClient

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


def new_response_id() -> str:
    """A response's id, as OpenAI's look (``resp_...``); also its request's id on the bus."""
    return f"resp_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    tenant: str
    body: str  # the response object, as JSON text
    input_items: str  # the items it was asked with, a JSON array
    context: str  # what a turn continuing it is prompted with before its own input, as JSON


class ResponseStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 30 * 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s

    def _key(self, response_id: str) -> str:
        return f"{self._prefix}response:{response_id}"

    async def put(self, stored: StoredResponse) -> None:
        key = self._key(stored.id)
        async with self._redis.pipeline(transaction=False) as pipe:  # one round trip
            pipe.hset(key, mapping={"tenant": stored.tenant, "body": stored.body, "input_items": stored.input_items,
                                    "context": stored.context})
            pipe.expire(key, self._ttl_s)
            await pipe.execute()

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        raw = await self._redis.hgetall(self._key(response_id))
        if not raw or raw.get(b"tenant", b"").decode() != tenant:
            return None
        return StoredResponse(response_id, tenant, raw[b"body"].decode(), raw[b"input_items"].decode(),
                              raw[b"context"].decode())

    def _reader(self, response_id: str) -> str:
        return f"{self._prefix}response:{response_id}:reader"

    async def claim_reader(self, response_id: str, reader: str, lease_s: float) -> bool:
        """Whether ``reader`` may read a response's stream to its end (and store it): no
        other reader holds it, or ``reader`` does; held for ``lease_s``, kept by claiming again."""
        key = self._reader(response_id)
        if await self._redis.set(key, reader, nx=True, px=int(lease_s * 1000)):
            return True
        holder = await self._redis.get(key)
        if holder is not None and holder.decode() == reader:
            await self._redis.pexpire(key, int(lease_s * 1000))
            return True
        return False

    async def release_reader(self, response_id: str) -> None:
        await self._redis.delete(self._reader(response_id))

    async def delete(self, tenant: str, response_id: str) -> bool:
        if await self.get(tenant, response_id) is None:
            return False
        await self._redis.delete(self._key(response_id))
        return True
