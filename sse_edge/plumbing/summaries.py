"""Summaries of the turns server-side history leaves out, where configured
(``TOKENBUS_EDGE_HISTORY_SUMMARIES=model:summarizing-model``).

When a request's history leaves out turns that its conversation's summary does not cover yet,
the edge asks the summarizing model for a new summary, on the bus like any request, at the
lowest tier: the old summary and the left-out turns, annotated ``purpose=summary`` with the
conversation and the newest turn it covers. Nobody waits for it: the transcripts job stores its
Completion as the conversation's summary, and later requests place it before the turns that
fit. One summary is asked for at a time per conversation; it is billed to the tenant like any
request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiokafka.errors import KafkaError

from tokenbus.producers import TokenbusClient, new_request_id
from tokenbus.schemas import ChatMessage, ChatRequest
from tokenbus.sse_edge.plumbing.history import ConversationHistory, History, StoredTurn
from tokenbus.stores.keys import ApiKey
from tokenbus.stores.transcripts.model import summary_annotations

log = logging.getLogger(__name__)

INSTRUCTION = ("Summarize the conversation below in a few sentences. Keep names, facts, numbers, decisions and "
               "open questions; write only the summary.")
CLAIM_S = 60.0  # a summary asked for and never stored may be asked for again after this


def needs_summary(history: History, dropped: list[StoredTurn]) -> bool:
    """Turns were left out that the conversation's summary does not cover."""
    return bool(dropped) and (history.summary is None or history.summary.through < dropped[-1].position)


def summary_request(client: TokenbusClient, model: str, key: ApiKey, conversation_id: str, history: History,
                    dropped: list[StoredTurn], max_tokens: int) -> ChatRequest:
    """Ask ``model`` to summarize ``dropped`` (after the conversation's summary so far)."""
    so_far = f"Summary so far: {history.summary.content}\n" if history.summary else ""
    newest = dropped[-1]
    return ChatRequest(
        request_id=new_request_id(), model=model, tier=client.settings.tiers[-1], tenant=key.tenant,
        key_id=key.key_id, max_tokens=max_tokens, reply_topic=client.router.reply_topic,
        reply_partition=client.router.reply_partition,
        messages=[ChatMessage("system", INSTRUCTION),
                  ChatMessage("user", so_far + transcript(m for turn in dropped for m in turn.messages))],
        annotations=summary_annotations(conversation_id, newest.turn_at_ms, newest.request_id),
    )


def transcript(messages: Iterable[ChatMessage]) -> str:
    """Messages as the text a summarizing model reads: a line each, its role first, and a line for
    each call an assistant made (what a tool answered is a tool message's line)."""
    lines = []
    for m in messages:
        if m.content:
            lines.append(f"{m.role}: {m.content}")
        lines += [f"{m.role} called {call.name}({call.arguments})" for call in m.tool_calls]
    return "\n".join(lines)


async def ask_for_summary(client: TokenbusClient, conversations: ConversationHistory, request: ChatRequest) -> None:
    """Publish ``request`` (a summary_request) unless this conversation's summary is being made."""
    tenant, conversation_id = request.tenant, request.annotations["conversation_id"]
    if not await conversations.claim_summary(tenant, conversation_id, CLAIM_S):
        return
    try:
        await client.publish(request)
    except KafkaError as exc:
        log.warning("asking for a summary failed (%s); a later request asks again", type(exc).__name__)
