"""Stored chat completions, as OpenAI keeps those a request asks it to (``store: true``): the
``chat.completion`` it was answered with, the messages it was asked with, its model and its
metadata (which its client may change later). Kept in Redis, which every edge shares, as one hash
each for ``ttl_s`` (OpenAI keeps them 30 days); each tenant's ids are a sorted set by creation
time, the listing's order, from which the first listing that finds one gone drops it. Every read
names the tenant: another tenant's completion is not found, whatever its id.

The store keeps the body and the messages as the edge's JSON text and reads neither: what they
hold belongs to the edge (sse_edge/protocol/stored_completions.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from tokenbus.stores.redis_client import RedisClient

COMPLETION_ID = re.compile(r"chatcmpl-[0-9a-f]{32}")
READ_AHEAD = 100  # ids read at once while a filtered listing looks for its page


@dataclass(frozen=True, slots=True)
class StoredCompletion:
    id: str
    tenant: str
    model: str
    created_at_ms: int
    metadata: dict[str, str]
    body: str  # the chat.completion as answered, JSON text
    messages: str  # the request's messages as the listing shows them, a JSON array


class CompletionStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 30 * 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s

    def _key(self, completion_id: str) -> str:
        return f"{self._prefix}chatcmpl:{completion_id}"

    def _listing(self, tenant: str) -> str:
        return f"{self._prefix}chatcmpls:{tenant}"

    async def put(self, stored: StoredCompletion) -> None:
        key = self._key(stored.id)
        async with self._redis.pipeline(transaction=False) as pipe:  # one round trip
            pipe.hset(key, mapping={"tenant": stored.tenant, "model": stored.model,
                                    "created_at_ms": stored.created_at_ms, "metadata": json.dumps(stored.metadata),
                                    "body": stored.body, "messages": stored.messages})
            pipe.expire(key, self._ttl_s)
            pipe.zadd(self._listing(stored.tenant), {stored.id: stored.created_at_ms})
            await pipe.execute()

    async def get(self, tenant: str, completion_id: str) -> StoredCompletion | None:
        if not COMPLETION_ID.fullmatch(completion_id):
            return None
        return _stored(completion_id, tenant, await self._redis.hgetall(self._key(completion_id)))

    async def set_metadata(self, tenant: str, completion_id: str, metadata: dict[str, str]) -> StoredCompletion | None:
        """The completion with its metadata replaced (OpenAI's update); None where there is none."""
        stored = await self.get(tenant, completion_id)
        if stored is None:
            return None
        await self._redis.hset(self._key(completion_id), mapping={"metadata": json.dumps(metadata)})
        return replace(stored, metadata=metadata)

    async def delete(self, tenant: str, completion_id: str) -> bool:
        if await self.get(tenant, completion_id) is None:
            return False
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(self._key(completion_id))
            pipe.zrem(self._listing(tenant), completion_id)
            await pipe.execute()
        return True

    async def page(self, tenant: str, limit: int, after: str | None = None, newest_first: bool = False,
                   model: str | None = None, metadata: dict[str, str] | None = None) -> tuple[list[StoredCompletion], bool]:
        """A page of the tenant's completions in creation order (``newest_first``: the other way),
        after the one ``after`` names, of those of ``model`` whose metadata holds every pair of
        ``metadata``: up to ``limit`` of them, and whether more follow. ``KeyError`` where ``after``
        names none of the tenant's."""
        listing = self._listing(tenant)
        start = 0
        if after is not None:
            rank = await (self._redis.zrevrank if newest_first else self._redis.zrank)(listing, after)
            if rank is None:
                raise KeyError(after)
            start = rank + 1
        found: list[StoredCompletion] = []
        while len(found) <= limit:
            ids = [i.decode() for i in await (self._redis.zrevrange if newest_first else self._redis.zrange)(
                listing, start, start + READ_AHEAD - 1)]
            if not ids:
                break
            start += len(ids)
            async with self._redis.pipeline(transaction=False) as pipe:
                for completion_id in ids:
                    pipe.hgetall(self._key(completion_id))
                rows = await pipe.execute()
            for completion_id, row in zip(ids, rows, strict=True):
                stored = _stored(completion_id, tenant, row)
                if stored is None:
                    await self._redis.zrem(listing, completion_id)  # expired
                    start -= 1  # (the ranks after it moved down by one)
                elif (model is None or stored.model == model) and all(
                        stored.metadata.get(k) == v for k, v in (metadata or {}).items()):
                    found.append(stored)
        return found[:limit], len(found) > limit


def _stored(completion_id: str, tenant: str, raw: dict[bytes, bytes]) -> StoredCompletion | None:
    if raw.get(b"tenant", b"").decode() != tenant or b"body" not in raw:
        return None
    return StoredCompletion(completion_id, tenant, raw[b"model"].decode(), int(raw[b"created_at_ms"]),
                            json.loads(raw[b"metadata"]), raw[b"body"].decode(), raw[b"messages"].decode())
