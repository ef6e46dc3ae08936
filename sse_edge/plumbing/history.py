"""Server-side history: the stored turns of a tenant's conversation, for a request that asks for
them (``metadata: {"conversation_id": ..., "history": "server"}``).

The transcript store is the record (the transcripts processor writes each turn once it ends).
Redis keeps the last ``turns`` turns of each conversation with the id of the newest, so a
request reads one conversation row from the store to learn whether the cache is current, and
only the messages of newer turns when it is not; a cache that is missing (flushed, expired) is
rebuilt from the store, which gives the same turns.

Read your writes: a client that sends its next turn as soon as the last one ended may arrive
before the processor has stored it. Each edge notes the newest request it published in a
conversation; a request whose conversation's stored newest turn is another one waits for it,
up to ``wait_s``, then goes on with what is stored (a turn still streaming, or one that never
finished, is not waited for again). A conversation an edge has published to exists, stored or
not yet.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as redis

from tokenbus.schemas import ChatMessage, ToolCall
from tokenbus.stores.redis_client import RedisClient
from tokenbus.stores.transcripts import Conversation, Summary, TranscriptMessage, TranscriptStore

POLL_S = 0.05
PAGE = 500
LEADING_ROLES = ("system", "developer")  # the request's own say; stored ones are not replayed


@dataclass(frozen=True, slots=True)
class StoredTurn:
    """What one earlier request added to its conversation: its new prompt messages (but system
    and developer ones) and the assistant's reply."""

    request_id: str
    turn_at_ms: int
    messages: tuple[ChatMessage, ...]

    @property
    def position(self) -> tuple[int, str]:
        """Where it stands in its conversation (what a summary's ``through`` is compared with)."""
        return self.turn_at_ms, self.request_id


@dataclass(frozen=True, slots=True)
class History:
    turns: list[StoredTurn]  # the last ones, oldest first
    summary: Summary | None = None  # of earlier turns, where summaries are made


class ConversationNotFound(LookupError):
    """No such conversation for this tenant (another tenant's looks the same)."""


class ConversationHistory:
    def __init__(self, client: RedisClient, prefix: str, store: Callable[[], TranscriptStore], turns: int,
                 ttl_s: int, wait_s: float) -> None:
        self._redis = client
        self._prefix = prefix
        self._store = store
        self._turns = turns
        self._ttl_s = ttl_s
        self._wait_s = wait_s

    def _cache_key(self, tenant: str, conversation_id: str) -> str:
        return f"{self._prefix}history:{tenant}:{conversation_id}"

    def _summarizing_key(self, tenant: str, conversation_id: str) -> str:
        return f"{self._prefix}summarizing:{tenant}:{conversation_id}"

    async def claim_summary(self, tenant: str, conversation_id: str, ttl_s: float) -> bool:
        """Whether this request may ask for the conversation's summary (one at a time)."""
        try:
            return bool(await self._redis.set(self._summarizing_key(tenant, conversation_id), "1", nx=True,
                                              px=int(ttl_s * 1000)))
        except (redis.RedisError, OSError):
            return False

    def _newest_key(self, tenant: str, conversation_id: str) -> str:
        return f"{self._prefix}history-newest:{tenant}:{conversation_id}"

    async def published(self, tenant: str, conversation_id: str, request_id: str) -> None:
        """A request of this conversation went onto the bus: the next turn waits for it to be stored."""
        try:
            await self._redis.set(self._newest_key(tenant, conversation_id), request_id, ex=self._ttl_s)
        except (redis.RedisError, OSError):
            pass  # the next turn may miss this one if it comes before it is stored

    async def load(self, tenant: str, conversation_id: str) -> History:
        """The last turns of the conversation, oldest first, and its summary."""
        conversation, known = await self._stored_conversation(tenant, conversation_id)
        if conversation is None:
            if not known:
                raise ConversationNotFound(conversation_id)
            return History([])
        cached = await self._cached(tenant, conversation_id)
        if cached is not None and cached["newest"] == conversation.last_request_id:
            return History([turn_from_json(t) for t in cached["turns"]], conversation.summary)
        turns = [turn_from_json(t) for t in cached["turns"]] if cached else []
        rows = await self._messages(tenant, conversation_id, cached["cursor"] if cached else None)
        turns = (turns + group_turns(rows))[-self._turns:]
        cursor = rows[-1].cursor if rows else (cached["cursor"] if cached else None)
        await self._cache(tenant, conversation_id, conversation.last_request_id, cursor, turns)
        return History(turns, conversation.summary)

    async def _stored_conversation(self, tenant: str, conversation_id: str) -> tuple[Conversation | None, bool]:
        """The stored conversation once it holds the newest turn published to it (or ``wait_s``
        passed), and whether the conversation is known to exist (stored, or published to)."""
        store = self._store()
        conversation = await store.get_conversation(tenant, conversation_id)
        try:
            newest = await self._redis.get(self._newest_key(tenant, conversation_id))
        except (redis.RedisError, OSError):
            newest = None
        deadline = time.monotonic() + self._wait_s
        while newest is not None and (conversation is None or conversation.last_request_id != newest.decode()):
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)
            conversation = await store.get_conversation(tenant, conversation_id)
        return conversation, conversation is not None or newest is not None

    async def _messages(self, tenant: str, conversation_id: str, after: str | None) -> list[TranscriptMessage]:
        rows: list[TranscriptMessage] = []
        while True:
            page = await self._store().list_messages(tenant, conversation_id, PAGE, after)
            rows += page.items
            if page.next_cursor is None:
                return rows
            after = page.next_cursor

    async def _cached(self, tenant: str, conversation_id: str) -> dict[str, Any] | None:
        try:
            raw = await self._redis.get(self._cache_key(tenant, conversation_id))
        except (redis.RedisError, OSError):
            return None
        return json.loads(raw) if raw else None

    async def _cache(self, tenant: str, conversation_id: str, newest: str, cursor: str | None,
                     turns: list[StoredTurn]) -> None:
        value = json.dumps({"newest": newest, "cursor": cursor, "turns": [turn_to_json(t) for t in turns]},
                           separators=(",", ":"))
        try:
            await self._redis.set(self._cache_key(tenant, conversation_id), value, ex=self._ttl_s)
        except (redis.RedisError, OSError):
            pass  # the next request reads the store again


def group_turns(rows: list[TranscriptMessage]) -> list[StoredTurn]:
    """Transcript rows (in conversation order) as turns."""
    turns: list[StoredTurn] = []
    for row in rows:
        if row.role in LEADING_ROLES:
            continue
        message = ChatMessage(row.role, row.content, tuple(row.calls), row.tool_call_id or None)
        if turns and turns[-1].request_id == row.request_id:
            turns[-1] = StoredTurn(row.request_id, row.turn_at_ms, (*turns[-1].messages, message))
        else:
            turns.append(StoredTurn(row.request_id, row.turn_at_ms, (message,)))
    return turns


def turn_to_json(turn: StoredTurn) -> list[Any]:
    messages = [[m.role, m.content, [[c.id, c.name, c.arguments] for c in m.tool_calls], m.tool_call_id]
                for m in turn.messages]
    return [turn.request_id, turn.turn_at_ms, messages]


def turn_from_json(data: list[Any]) -> StoredTurn:
    request_id, turn_at_ms, messages = data
    return StoredTurn(request_id, turn_at_ms, tuple(
        ChatMessage(role, content, tuple(ToolCall(*c) for c in calls), call_id) for role, content, calls, call_id in messages))
