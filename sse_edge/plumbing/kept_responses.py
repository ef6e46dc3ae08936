"""What the edge keeps of a Responses API turn (stores/responses.py holds it): the response as it
starts and as it ends, the input items it was asked with, and its context.

A context is the chain of turns a turn continuing the response is prompted with, as server-side
history keeps turns (``StoredTurn``: each turn's input messages and its answer, no instructions),
and, while the response is under way, its own input (``pending``): whoever reads its stream to
the end (the edge that serves it, or any edge a client resumes it on) can then store it ended. A
chain is one conversation (``conversation``): named by the client's ``metadata.conversation_id``,
or its first response's id.

A turn in a conversation object (the Conversations API's) is prompted with the conversation's
items (``conversation_turns``), and whoever stores it ended adds its input and output items to
the conversation (``adds_to``), where it completed (or was cut short by its token limit): a
failed or cancelled turn adds nothing."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

import redis.asyncio as redis

from tokenbus.schemas import ChatMessage, ToolCall
from tokenbus.sse_edge.plumbing.history import StoredTurn, turn_from_json, turn_to_json
from tokenbus.sse_edge.protocol.compaction import CompactionItem
from tokenbus.sse_edge.protocol.conversations import turn_items
from tokenbus.sse_edge.protocol.response_objects import item_id, output_text
from tokenbus.sse_edge.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    TextPart,
    bus_messages,
    parse_items,
)
from tokenbus.stores.conversations import ConversationStore, StoredConversation, added_at_ms, group_field
from tokenbus.stores.responses import ResponseStore, StoredResponse

log = logging.getLogger(__name__)

ADDED_WHEN = ("completed", "incomplete")  # the statuses of a turn whose items its conversation takes
# Conversation groups read as messages, kept per process (the last used): at most 1,024 of up to
# 16,384 characters each, so tens of MB at worst.
GROUPS_KEPT = 1024
GROUP_KEPT_CHARS = 16_384


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(slots=True)
class KeptResponse:
    """One response's keeping: its tenant, its input items (as the item list shows them, JSON),
    whether its text's scores were asked for, the chain it continues and its own input turn."""

    store: ResponseStore
    tenant: str
    items: str
    logprobs: bool
    earlier: list[StoredTurn]
    pending: StoredTurn
    chain_turns: int  # the most turns a chain keeps
    conversation: str  # the conversation the chain is (its first response's id, the client's, a conversation object)
    adds_to: ConversationStore | None = None  # where ``conversation`` is a conversation object, its store
    has_ended: bool = False  # its reader met its end (and stored it, where Redis allowed)

    @classmethod
    def of_stored(cls, store: ResponseStore, stored: StoredResponse, chain_turns: int,
                  conversations: ConversationStore) -> KeptResponse | None:
        """The keeping of a response stored as it started; None where it has ended."""
        context = json.loads(stored.context)
        if context.get("pending") is None:
            return None
        return cls(store, stored.tenant, stored.input_items, context.get("logprobs", False),
                   [turn_from_json(t) for t in context["turns"]], turn_from_json(context["pending"]), chain_turns,
                   conversation_of(stored), conversations if context.get("adds_items") else None)

    async def started(self, response: dict[str, Any]) -> None:
        await self._put(response, {"turns": [turn_to_json(t) for t in self.earlier], "logprobs": self.logprobs,
                                   "conversation": self.conversation, "pending": turn_to_json(self.pending),
                                   "adds_items": self.adds_to is not None})

    async def ended(self, response: dict[str, Any]) -> None:
        """Keep the response as it ended, with the chain's newest turns, this one last; in a
        conversation object, end its turn there first: whoever sees the response ended finds the
        conversation with its items, and free for the next turn."""
        self.has_ended = True
        if self.adds_to is not None:
            await self._end_turn(self.adds_to, response)
        turn = StoredTurn(self.pending.request_id, self.pending.turn_at_ms,
                          (*self.pending.messages, answer_message(response)))
        chain = [*self.earlier, turn][-self.chain_turns:]
        await self._put(response, {"turns": [turn_to_json(t) for t in chain], "logprobs": self.logprobs,
                                   "conversation": self.conversation})

    async def _end_turn(self, conversations: ConversationStore, response: dict[str, Any]) -> None:
        """Add the turn's items (where it completed) under its own group (its start and id: a second
        reader finds it added, not a second group), and let go of the conversation."""
        group = (group_field(self.pending.turn_at_ms, self.pending.request_id), turn_items(self.items, response)) \
            if response["status"] in ADDED_WHEN else None
        try:
            added = await conversations.end_turn(self.conversation, self.pending.request_id, group)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not add response %s to its conversation: %s", response["id"], type(exc).__name__)
            return
        if not added:
            log.info("response %s ended after its conversation was deleted: nothing added", response["id"])

    async def _put(self, response: dict[str, Any], context: dict[str, Any]) -> None:
        """The response is answered either way: one that cannot be stored (Redis down) is only
        missing later, which a retrieval or continuation says."""
        try:
            await self.store.put(StoredResponse(response["id"], self.tenant, compact(response), self.items,
                                                compact(context)))
        except (redis.RedisError, OSError) as exc:
            log.warning("could not store response %s: %s", response["id"], type(exc).__name__)


def chain_of(stored: StoredResponse) -> list[StoredTurn] | None:
    """The turns a turn continuing ``stored`` is prompted with; None while it is under way."""
    context = json.loads(stored.context)
    if context.get("pending") is not None:
        return None
    return [turn_from_json(t) for t in context["turns"]]


def conversation_turns(stored: StoredConversation) -> list[StoredTurn]:
    """A conversation's items as the turns a turn in it is prompted with: each group added (a
    turn's, or items a client added at once) one turn, its messages as the items read."""
    turns = []
    for field, items in stored.groups:
        if items == "[]":  # every item of it deleted
            continue
        turns.append(StoredTurn(StoredConversation.group_id(field), added_at_ms(field), group_messages(items)))
    return turns


def group_messages(items: str) -> tuple[ChatMessage, ...]:
    """A group's items (as stored, JSON) as the messages a turn is prompted with. A group of up to
    ``GROUP_KEPT_CHARS`` is kept by its text (the messages are frozen): every turn of a conversation
    reads all its groups again, and would check each item again (~15 µs an item)."""
    return _kept_group(items) if len(items) <= GROUP_KEPT_CHARS else _read_group(items)


def _read_group(items: str) -> tuple[ChatMessage, ...]:
    return tuple(bus_messages(None, parse_items(json.loads(items), "items")))


_kept_group = functools.lru_cache(maxsize=GROUPS_KEPT)(_read_group)


def conversation_of(stored: StoredResponse) -> str:
    """The conversation a turn continuing ``stored`` is part of: its chain's, as transcripts group
    turns and as the bus keys requests (a chain's turns go to the GPU consumer holding its prefix)."""
    return str(json.loads(stored.context).get("conversation") or stored.id)


def answer_message(response: dict[str, Any]) -> ChatMessage:
    """A response's output as the assistant message a turn continuing it is prompted with."""
    text = output_text(response)
    calls = tuple(ToolCall(item["call_id"], item["name"], item["arguments"]) for item in response["output"]
                  if item["type"] == "function_call")
    return ChatMessage("assistant", text, calls)


def listed_part(part: TextPart) -> dict[str, Any]:
    """A message's text part as OpenAI lists it: an answer's with its (here always no) annotations."""
    return {"type": part.type, "text": part.text, **({"annotations": []} if part.type == "output_text" else {})}


def listed_items(items: list[InputItem]) -> str:
    """Input items as the input item list shows them (JSON): each with an id, a message's content as parts."""
    listed = []
    for item in items:
        if isinstance(item, CompactionItem):
            listed.append(item.listed())
        elif isinstance(item, FunctionCallItem):
            listed.append({"id": item_id("fc"), **item.model_dump(), "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else [listed_part(p) for p in item.output]
            listed.append({"id": item_id("fco"), "type": item.type, "call_id": item.call_id, "output": output,
                           "status": "completed"})
        else:
            parts = [TextPart(type="output_text" if item.role == "assistant" else "input_text", text=item.content)] \
                if isinstance(item.content, str) else item.content
            content = [listed_part(p) for p in parts]
            listed.append({"id": item_id("msg"), "type": "message", "role": item.role, "content": content,
                           "status": "completed"})
    return compact(listed)
