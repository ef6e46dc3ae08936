"""Conversation objects (OpenAI's Conversations API), in Redis: a tenant's conversation, its
metadata, and its items in the order they were added, each addition a group of items (a turn's
input and output, or the items a client added at once).

One hash a conversation: its tenant, creation time and metadata, and a field per group,
``group:{added_at_ms:013d}:{group_id}`` (so the fields sort in the order the groups were added).
A turn adds its group under its own response id and start time: whoever reads the turn to its end
adds it, and a second reader writes the same field again, not a second group. The store keeps
each group as the edge's JSON text and reads none of it. Every write renews the conversation's
TTL: one in use does not expire."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from tokenbus.stores.redis_client import RedisClient

CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{32}")
GROUP = "group:"


def new_conversation_id() -> str:
    """A conversation's id, as OpenAI's look (``conv_...``)."""
    return f"conv_{uuid.uuid4().hex}"


def group_field(added_at_ms: int, group_id: str) -> str:
    return f"{GROUP}{added_at_ms:013d}:{group_id}"


def added_at_ms(field: str) -> int:
    return int(field.split(":", 2)[1])


@dataclass(frozen=True, slots=True)
class StoredConversation:
    id: str
    tenant: str
    created_at: int  # seconds
    metadata: str  # JSON object
    groups: list[tuple[str, str]]  # (its field, its items as a JSON array), in the order added

    @staticmethod
    def group_id(field: str) -> str:
        return field.split(":", 2)[2]


class ConversationStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 30 * 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s

    def _key(self, conversation_id: str) -> str:
        return f"{self._prefix}conversation:{conversation_id}"

    async def create(self, conversation: StoredConversation) -> None:
        fields = {"tenant": conversation.tenant, "created_at": str(conversation.created_at),
                  "metadata": conversation.metadata, **dict(conversation.groups)}
        await self._write(conversation.id, fields)

    async def get(self, tenant: str, conversation_id: str) -> StoredConversation | None:
        if not CONVERSATION_ID.fullmatch(conversation_id):
            return None
        stored = await self._redis.hgetall(self._key(conversation_id))
        raw = {k.decode(): v.decode() for k, v in stored.items()}
        if raw.get("tenant") != tenant:
            return None
        groups = sorted((k, v) for k, v in raw.items() if k.startswith(GROUP))
        return StoredConversation(conversation_id, tenant, int(raw["created_at"]), raw["metadata"], groups)

    async def put_group(self, conversation_id: str, field: str, items: str) -> bool:
        """Add (or write again) a group of items; False where the conversation is gone (deleted,
        or expired), which nothing then brings back."""
        key = self._key(conversation_id)
        if not await self._redis.exists(key):
            return False
        await self._write(conversation_id, {field: items})
        return True

    async def set_metadata(self, conversation_id: str, metadata: str) -> None:
        await self._write(conversation_id, {"metadata": metadata})

    async def remove_group(self, conversation_id: str, field: str) -> None:
        await self._redis.hdel(self._key(conversation_id), field)

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        if await self.get(tenant, conversation_id) is None:
            return False
        await self._redis.delete(self._key(conversation_id))
        return True

    async def _write(self, conversation_id: str, fields: dict[str, str]) -> None:
        key = self._key(conversation_id)
        async with self._redis.pipeline(transaction=False) as pipe:  # one round trip
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self._ttl_s)
            await pipe.execute()
