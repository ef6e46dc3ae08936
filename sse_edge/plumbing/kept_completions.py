"""Keeping a chat completion its request asked to store (OpenAI's ``store: true``): the
``chat.completion`` its client got whole, stored once the client has it. A whole one is kept as
answered; a stream's is made from its events as they go by (``reading``), as a client that
joins its chunks makes it, and kept before its ``[DONE]`` goes out, so a client that retrieves
it after its stream ended finds it. One that ends in an error, or whose client leaves first, is
not kept."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import redis.asyncio as redis

from tokenbus.schemas import TokenEvent
from tokenbus.sse_edge.plumbing.relay import Choices, CollectedChoice, completion_of, generation_error
from tokenbus.stores.chat_completions import CompletionStore, StoredCompletion
from tokenbus.topics import ReplyEvent

log = logging.getLogger(__name__)


class KeptCompletion:
    """A completion to store, with what is stored beside it: its messages (as listed) and metadata."""

    __slots__ = ("store", "tenant", "completion_id", "created_at_ms", "metadata", "messages")

    def __init__(self, store: CompletionStore, tenant: str, completion_id: str, created_at_ms: int,
                 metadata: dict[str, str], messages: str) -> None:
        self.store = store
        self.tenant = tenant
        self.completion_id = completion_id
        self.created_at_ms = created_at_ms
        self.metadata = metadata
        self.messages = messages

    async def keep(self, body: dict[str, Any]) -> None:
        """Store the completion as ``body`` says it (its model: the one that answered, a fallback's
        where admission chose one). A store that fails costs the keeping, never the answer: the
        client has it either way."""
        stored = StoredCompletion(self.completion_id, self.tenant, body["model"], self.created_at_ms, self.metadata,
                                  json.dumps(body, separators=(",", ":"), ensure_ascii=False), self.messages)
        try:
            await self.store.put(stored)
        except (redis.RedisError, OSError) as exc:
            log.warning("completion %s not stored: %s", self.completion_id, type(exc).__name__)

    async def reading(self, events: AsyncGenerator[ReplyEvent, None], choices: Choices, model: str,
                      service_tier: str | None = None) -> AsyncGenerator[ReplyEvent, None]:
        """``events`` as they are, keeping the completion they make once the last has gone by
        (every one of ``choices`` ended well)."""
        delivered: dict[str, list[TokenEvent]] = {request_id: [] for request_id in choices.ids}
        try:
            async for reply in events:
                delivered[reply.event.request_id if choices.several else choices.ids[0]].append(reply.event)
                yield reply
        finally:
            await events.aclose()
        collected = [CollectedChoice(of_choice) for of_choice in delivered.values() if of_choice]
        if len(collected) == len(choices.ids) and all(c.final.is_final and generation_error(c.final) is None
                                                      for c in collected):
            await self.keep(completion_of(collected, self.completion_id, model, choices,
                                          created=self.created_at_ms // 1000, service_tier=service_tier))
