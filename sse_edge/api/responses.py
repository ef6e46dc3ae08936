"""OpenAI's Responses API: ``POST /v1/responses``, a turn, streamed as named events or answered
whole, or in the background (a stored response's other endpoints are stored_responses.py's, its
stream read again response_streams.py's).

A turn is served as a chat turn is (chat.py's ``start_turn``): the request reads as a chat
completion's (protocol/responses.py), goes on the bus under the response's id, and is billed,
moderated and transcribed as any turn is. What the Responses API adds is kept here, at the edge:
a stored response (``store``, its default) holds its context, which a turn naming it as
``previous_response_id`` is prompted with before its own input (the previous turn's
``instructions`` are not carried over, as OpenAI's are not); a turn in a conversation object holds
it while it runs."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.schemas import ChatMessage
from tokenbus.sse_edge.api.chat import (
    Turn,
    check_model,
    claim_idempotency_key,
    prompt_messages,
    start_turn,
    to_bus_request,
)
from tokenbus.sse_edge.api.conversations import in_store
from tokenbus.sse_edge.api.response_streams import (
    EVENT_STREAM,
    answered_before,
    handing_over,
    nothing_kept,
    read_on_if_unread,
    stored_response,
    stream_again,
)
from tokenbus.sse_edge.errors import ApiError, ClientClosed, InvalidRequest
from tokenbus.sse_edge.plumbing.history import History, StoredTurn
from tokenbus.sse_edge.plumbing.kept_responses import (
    KeptResponse,
    chain_of,
    conversation_of,
    conversation_turns,
    listed_items,
)
from tokenbus.sse_edge.plumbing.relay import collect_choices
from tokenbus.sse_edge.plumbing.response_readers import ReaderLease, read_to_the_end, served_frames, serving
from tokenbus.sse_edge.plumbing.response_relay import Ending, response_frames
from tokenbus.sse_edge.plumbing.stream_response import sse_response
from tokenbus.sse_edge.protocol.chat import ChatCompletionRequest
from tokenbus.sse_edge.protocol.response_objects import (
    ResponseEvents,
    ended_as,
    output_items,
    response_object,
)
from tokenbus.sse_edge.protocol.responses import InputItem, ResponsesRequest
from tokenbus.sse_edge.protocol.service_tiers import openai_name
from tokenbus.sse_edge.protocol.validation import body_hash, parse_responses_request, read_body
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.conversations import TurnHolder
from tokenbus.stores.keys import ApiKey
from tokenbus.stores.responses import new_response_id

UNSTARTED_AFTER_S = 60  # a turn that holds its conversation but was not stored as started this long never will be


async def create_response(request: Request) -> Response:
    """A turn. With an ``Idempotency-Key`` seen before (same body), the turn is not published
    again: the response it made is answered (its stream read again, while it is under way)."""
    edge: EdgeState = request.app.state.edge
    started = time.perf_counter()
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked, items, chat = parse_responses_request(raw, edge.settings)
    if not edge.settings.store_responses:
        if asked.background:
            raise InvalidRequest("Background responses must be stored, and this deployment stores no responses.",
                                 param="background", code="unsupported_value")
        if asked.conversation is not None:
            raise InvalidRequest("This deployment stores no responses, and keeps no conversations.",
                                 param="conversation", code="unsupported_value")
        asked.store = False  # (and the response says so)
    check_model(edge, key, chat.model)
    response_id, digest = new_response_id(), body_hash(raw)
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key:
        earlier = await claim_idempotency_key(edge, key, idempotency_key, digest, response_id)
        if earlier is not None:
            return await answered_before(request, edge, key, earlier.request_id, asked.stream)
    try:
        return await respond(request, edge, key, asked, items, chat, response_id, digest, started)
    except ClientClosed:
        if idempotency_key and not asked.store:  # (one not stored cannot be taken up: a retry is a new turn)
            await edge.streams.release(key.tenant, idempotency_key, response_id)
        raise  # a stored one goes on, and is stored as it ends: a retry with this key is answered it
    except ApiError:
        if idempotency_key:  # not published, or failed: a retry with this key may try again
            await edge.streams.release(key.tenant, idempotency_key, response_id)
        raise


async def respond(request: Request, edge: EdgeState, key: ApiKey, asked: ResponsesRequest, items: list[InputItem],
                  chat: ChatCompletionRequest, response_id: str, digest: str, started: float) -> Response:
    if asked.conversation_id is not None:  # one turn at a time: held from before its items are read until it ends
        await hold_conversation(edge, key, asked.conversation_id, response_id)
    try:
        turn, in_progress, kept, lease = await start_response(request, edge, key, asked, items, chat, response_id,
                                                              digest)
    except BaseException:
        if asked.conversation_id is not None:  # (it never started: let go at once)
            with contextlib.suppress(redis.RedisError, OSError):
                await edge.conversations.end_turn(asked.conversation_id, response_id, None)
        raise
    on_end = kept.ended if kept is not None else nothing_kept
    hand_over = handing_over(edge, key, response_id, in_progress, asked.logprobs)
    if asked.background:
        writer = ResponseEvents(in_progress, asked.logprobs)
        frames = response_frames(turn.events, writer, turn.hooks, edge.metrics, started, on_end)
        edge.in_background(read_to_the_end(lease, frames))
        if asked.stream:  # the client reads the stream from the log, as any edge could: its going changes nothing
            await turn.registered
            return await stream_again(request, edge, key, response_id, in_progress, asked.logprobs, -1)
        return JSONResponse(in_progress, headers=turn.headers)
    if asked.stream:
        writer = ResponseEvents(in_progress, asked.logprobs)
        frames = response_frames(turn.events, writer, turn.hooks, edge.metrics, started, on_end, turn.direct)
        if kept is not None:
            frames = served_frames(frames, kept, hand_over, lease)
        return sse_response(frames, edge.settings.heartbeat_s, EVENT_STREAM, turn.headers, turn.direct)
    async with serving(kept, hand_over, lease) if kept is not None else contextlib.nullcontext():
        [choice] = await collect_choices(request, turn.events, turn.choices, turn.hooks)
        ending = Ending.of(choice.final)
        calls = [(c.id, c.name, c.arguments) for c in choice.calls]
        output = output_items(turn.response_id, choice.text, calls, ending.status,
                              choice.scored if asked.logprobs else None)
        response = ended_as(in_progress, ending.status, output, ending.usage, ending.error, ending.incomplete_reason)
        await on_end(response)  # a failed one too: retrieving it says how it ended
    if ending.failure is not None:
        raise ending.failure
    return JSONResponse(response, headers=turn.headers)


async def start_response(request: Request, edge: EdgeState, key: ApiKey, asked: ResponsesRequest,
                         items: list[InputItem], chat: ChatCompletionRequest, response_id: str,
                         digest: str) -> tuple[Turn, dict[str, Any], KeptResponse | None, ReaderLease]:
    """Publish the turn, prompted with the turns it continues, and store it as it starts (where
    it is stored): the turn, the response as it starts, its keeping and its reader's lease."""
    earlier, chain = await previous_turns(edge, key, asked.conversation_id, asked.previous_response_id)
    bus_request = to_bus_request(chat, edge, key, response_id)
    # A chain's turns are one conversation (its first names it), and a conversation object's are
    # its; otherwise a client's metadata.conversation_id names its own.
    if bus_request.conversation_id is None or asked.conversation_id is not None:
        bus_request.conversation_id = chain
    own = bus_request.messages
    bus_request.messages = await responses_prompt(edge, key, asked, chat, own, earlier)
    turn = await start_turn(request, edge, key, [bus_request], include_usage=True, digest=digest)
    turn.hooks.background = asked.background
    served_as = {**asked.echoed(), "service_tier": openai_name(bus_request.tier, edge.settings.bus.tiers)}
    in_progress = response_object(turn.response_id, bus_request.created_at_ms // 1000, turn.model, served_as)
    kept, lease = None, ReaderLease(edge.responses, response_id, edge.settings.reader_lease_s)
    if asked.store:
        this_turn = own[1:] if asked.instructions else own  # a turn continuing it gets its own instructions
        kept = KeptResponse(edge.responses, key.tenant, listed_items(items), asked.logprobs, earlier,
                            StoredTurn(turn.response_id, bus_request.created_at_ms, tuple(this_turn)),
                            edge.settings.history_turns, bus_request.conversation_id or turn.response_id,
                            edge.conversations if asked.conversation_id else None)
        await lease.claim()  # (held before anyone can ask about it)
        await kept.started(in_progress)
    return turn, in_progress, kept, lease


async def previous_turns(edge: EdgeState, key: ApiKey, conversation_id: str | None,
                         previous_response_id: str | None) -> tuple[list[StoredTurn], str | None]:
    """The turns of the conversation object a turn is in, or of the chain ``previous_response_id``
    ends, and the conversation it is (none without either)."""
    if conversation_id is not None:
        conversation = await in_store(edge.conversations.get(key.tenant, conversation_id))
        if conversation is None:
            raise no_such_conversation(conversation_id)
        return conversation_turns(conversation), conversation.id
    if previous_response_id is None:
        return [], None
    stored = await stored_response(edge, key, previous_response_id)
    if stored is None:
        raise InvalidRequest(f"Previous response with id '{previous_response_id}' not found.",
                             param="previous_response_id", code="previous_response_not_found")
    chain = chain_of(stored)
    if chain is None:
        read_on_if_unread(edge, key, stored)
        raise InvalidRequest(f"Previous response with id '{previous_response_id}' is still in progress.",
                             param="previous_response_id", code="previous_response_in_progress")
    return chain, conversation_of(stored)


async def hold_conversation(edge: EdgeState, key: ApiKey, conversation_id: str, response_id: str) -> None:
    """Hold the conversation for this turn, where no other turn holds it (or one that no longer
    does): two turns at once would each be prompted without the other."""
    now_ms = int(time.time() * 1000)
    holder = await in_store(edge.conversations.hold_turn(key.tenant, conversation_id, response_id, now_ms))
    if holder is not None and holder.response_id != response_id and await holds_no_more(edge, key, holder, now_ms):
        holder = await in_store(edge.conversations.hold_turn(key.tenant, conversation_id, response_id, now_ms,
                                                             replacing=holder.response_id))
    if holder is None:
        raise no_such_conversation(conversation_id)
    if holder.response_id != response_id:  # (as OpenAI refuses it)
        raise InvalidRequest("Another process is currently operating on this conversation. Please retry in a "
                             "few seconds.", param="conversation", code="conversation_locked")


def no_such_conversation(conversation_id: str) -> InvalidRequest:
    return InvalidRequest(f"Conversation with id '{conversation_id}' not found.", param="conversation",
                          code="conversation_not_found")


async def holds_no_more(edge: EdgeState, key: ApiKey, holder: TurnHolder, now_ms: int) -> bool:
    """Whether the turn holding a conversation no longer does: it has ended (whoever stored it was
    stopped before letting go), or it never got as far as being stored. One under way still does,
    and is read on here where no reader holds it: it ends, and lets go, without its client."""
    stored = await stored_response(edge, key, holder.response_id)
    if stored is None:
        return now_ms - holder.since_ms >= UNSTARTED_AFTER_S * 1000
    read_on_if_unread(edge, key, stored)
    return bool(json.loads(stored.body)["status"] != "in_progress")


async def responses_prompt(edge: EdgeState, key: ApiKey, asked: ResponsesRequest, chat: ChatCompletionRequest,
                           own: list[ChatMessage], earlier: list[StoredTurn]) -> list[ChatMessage]:
    """The messages the model sees: the chain's turns between the request's instructions and its
    input. With ``truncation: auto``, the oldest turns that do not fit the model's context window
    are left out; otherwise a prompt that does not fit is refused, as OpenAI refuses it."""
    if not earlier:
        return await prompt_messages(edge, key, chat, own)  # (a conversation's stored turns, where it asks)
    if chat.server_history:
        raise InvalidRequest("A turn continues a previous response or a conversation's stored history, not both.",
                             param="previous_response_id", code="invalid_value")
    if asked.truncation == "auto" and edge.context.limits(chat.model):
        prompt, _ = edge.context.with_history(chat.model, own, History(earlier), chat.token_limit)
        return prompt
    lead = 1 if asked.instructions else 0
    prompt = [*own[:lead], *(m for t in earlier for m in t.messages), *own[lead:]]
    edge.context.check_messages(chat.model, prompt, chat.token_limit, param="input")
    return prompt
