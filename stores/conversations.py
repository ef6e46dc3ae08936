"""Conversation objects (OpenAI's Conversations API), in Redis: a tenant's conversation, its
metadata, and its items in the order they were added, each addition a group of items (a turn's
input and output, or the items a client added at once).

One hash a conversation: its tenant, creation time and metadata, and a field per group,
``group:{added_at_ms:013d}:{group_id}`` (so the fields sort in the order the groups were added).
A turn adds its group under its own response id and start time: whoever reads the turn to its end
adds it, and a second reader finds the field written, not a second group. The store keeps
each group as the edge's JSON text and reads none of it. Every write renews the conversation's
TTL: one in use does not expire.

One turn at a time: a turn holds its conversation (fields ``turn`` and ``turn_since_ms``) from
before it reads the items until whoever reads it to its end adds its group, which lets go of it in
the same step (``end_turn``); a turn that finds it held is refused, as OpenAI refuses it, unless
the holder is stale (the edge decides that, and takes it over in one step, ``hold_turn``'s
``replacing``)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from tokenbus.stores.redis_client import RedisClient

CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{32}")
GROUP = "group:"
# Holds a tenant's (ARGV[1]) conversation (KEYS[1]) for the turn ARGV[2], since ARGV[3] (ms), where
# no turn holds it or ARGV[4] does (the stale holder it replaces); the holder then, nil where the
# tenant has no such conversation.
HOLD_TURN = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return false end
local holder = redis.call('HMGET', KEYS[1], 'turn', 'turn_since_ms')
if holder[1] and holder[1] ~= ARGV[4] then return holder end
redis.call('HSET', KEYS[1], 'turn', ARGV[2], 'turn_since_ms', ARGV[3])
return {ARGV[2], ARGV[3]}
"""
# Adds a group (field ARGV[2], items ARGV[3]; none where ARGV[2] is empty) to a conversation
# (KEYS[1]) that exists, with ARGV[5] (HSET; HSETNX to leave one written before as it is), and
# lets go of it where the turn ARGV[4] holds it; renews its TTL (ARGV[1]). 0 where the
# conversation is gone: nothing brings it back.
ADD_GROUP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] ~= '' then redis.call(ARGV[5], KEYS[1], ARGV[2], ARGV[3]) end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'turn') == ARGV[4] then
  redis.call('HDEL', KEYS[1], 'turn', 'turn_since_ms')
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


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


@dataclass(frozen=True, slots=True)
class TurnHolder:
    """The turn that holds a conversation, and since when (ms)."""

    response_id: str
    since_ms: int


class ConversationStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 30 * 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._hold_turn = client.register_script(HOLD_TURN)
        self._add_group = client.register_script(ADD_GROUP)

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
        return bool(await self._add_group(keys=[self._key(conversation_id)],
                                          args=[self._ttl_s, field, items, "", "HSET"]))

    async def hold_turn(self, tenant: str, conversation_id: str, response_id: str, now_ms: int,
                        replacing: str = "") -> TurnHolder | None:
        """Hold the conversation for a turn, where no turn holds it (or ``replacing`` does); the
        turn that holds it then (this one, or another), None where the tenant has no such one."""
        if not CONVERSATION_ID.fullmatch(conversation_id):
            return None
        holder = await self._hold_turn(keys=[self._key(conversation_id)],
                                       args=[tenant, response_id, now_ms, replacing])
        return TurnHolder(holder[0].decode(), int(holder[1])) if holder else None

    async def end_turn(self, conversation_id: str, response_id: str, group: tuple[str, str] | None) -> bool:
        """A turn ended: add its ``group`` (field, items), where it adds one, and let go of the
        conversation in the same step; False where the conversation is gone. A second reader of
        the turn leaves the group as the first wrote it (an item deleted since stays deleted)."""
        field, items = group or ("", "")
        return bool(await self._add_group(keys=[self._key(conversation_id)],
                                          args=[self._ttl_s, field, items, response_id, "HSETNX"]))

    async def set_metadata(self, conversation_id: str, metadata: str) -> None:
        await self._write(conversation_id, {"metadata": metadata})

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
