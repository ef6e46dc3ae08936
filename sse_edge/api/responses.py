"""OpenAI's Responses API: ``POST /v1/responses`` (a turn, streamed as named events or answered
whole, or in the background), and a stored response's ``GET`` (its stream again, resumed),
``DELETE``, ``cancel`` and ``input_items``.

A turn is served as a chat turn is (chat.py's ``start_turn``): the request reads as a chat
completion's (protocol/responses.py), goes on the bus under the response's id, and is billed,
moderated and transcribed as any turn is. What the Responses API adds is kept here, at the edge:
a stored response (``store``, its default) holds its context, which a turn naming it as
``previous_response_id`` is prompted with before its own input (the previous turn's
``instructions`` are not carried over, as OpenAI's are not)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.schemas import ChatMessage
from tokenbus.sse_edge.api.chat import (
    REQUEST_ID_HEADER,
    Turn,
    check_model,
    claim_idempotency_key,
    prompt_messages,
    start_turn,
    to_bus_request,
)
from tokenbus.sse_edge.api.conversations import in_store
from tokenbus.sse_edge.api.resume import find_stream
from tokenbus.sse_edge.errors import ApiError, ClientClosed, Conflict, InvalidRequest, NotFound, ServerError, Unavailable
from tokenbus.sse_edge.plumbing.history import History, StoredTurn
from tokenbus.sse_edge.plumbing.kept_responses import (
    KeptResponse,
    chain_of,
    conversation_of,
    conversation_turns,
    listed_items,
)
from tokenbus.sse_edge.plumbing.relay import collect_choices, unless_disconnected
from tokenbus.sse_edge.plumbing.response_readers import ReaderLease, read_to_the_end, served_frames, serving
from tokenbus.sse_edge.plumbing.response_relay import Ending, response_frames
from tokenbus.sse_edge.plumbing.stream_response import StreamEnd, StreamFormat, sse_response
from tokenbus.sse_edge.protocol.batches import list_body
from tokenbus.sse_edge.protocol.chat import ChatCompletionRequest
from tokenbus.sse_edge.protocol.response_objects import (
    ResponseEvents,
    ended_as,
    output_items,
    response_object,
)
from tokenbus.sse_edge.protocol.responses import InputItem, ResponsesRequest
from tokenbus.sse_edge.protocol.validation import body_hash, cursor_page, list_order, parse_responses_request, read_body
from tokenbus.sse_edge.state import EdgeState, TurnHooks
from tokenbus.stores.conversations import TurnHolder
from tokenbus.stores.keys import ApiKey
from tokenbus.stores.responses import StoredResponse, new_response_id
from tokenbus.topics import replay

CANCEL_WAIT_S = 3.0  # for a cancelled turn's stream to end and store it
UNSTARTED_AFTER_S = 60  # a turn that holds its conversation but was not stored as started this long never will be
# The Responses API's clients read SSE: its heartbeat comments are theirs too.
EVENT_STREAM = StreamFormat(event_ids=True)


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
    if asked.conversation_id is None:
        turn, in_progress, kept, lease = await start_response(request, edge, key, asked, items, chat, response_id,
                                                              digest)
    else:  # one turn at a time: held from before its items are read until it is stored ended
        await hold_conversation(edge, key, asked.conversation_id, response_id)
        try:
            turn, in_progress, kept, lease = await start_response(request, edge, key, asked, items, chat,
                                                                  response_id, digest)
        except BaseException:
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
    in_progress = response_object(turn.response_id, bus_request.created_at_ms // 1000, turn.model, asked.echoed())
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


async def nothing_kept(response: dict[str, Any]) -> None:
    """A response not stored (``store: false``) ends with nothing to keep."""


def handing_over(edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any],
                 logprobs: bool) -> Callable[[], None]:
    """What a client's reading of a stored response under way does when it stops before the end:
    this edge reads it on from the log (unless it is stopping: another edge will, when asked)."""
    def hand_over() -> None:
        if not edge.draining:
            edge.in_background(read_on(edge, key, response_id, response, logprobs))
    return hand_over


async def read_on(edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any], logprobs: bool) -> None:
    """A stored response under way that no reader holds (its client went, or its edge stopped):
    read its stream from the log to the end, here, and store it."""
    lease = ReaderLease(edge.responses, response_id, edge.settings.reader_lease_s)
    if not await lease.claim():
        return
    try:
        frames = await frames_from_log(edge, key, response_id, response, logprobs, -1, by_client=False)
    except ApiError:  # its stream cannot be found now: the response is answered as stored
        frames = None
    if frames is None:
        await lease.release()
        return
    await read_to_the_end(lease, frames)


def read_on_if_unread(edge: EdgeState, key: ApiKey, stored: StoredResponse) -> None:
    """A stored response found under way is read on here, where no reader holds it."""
    response = json.loads(stored.body)
    if response["status"] == "in_progress":
        edge.in_background(read_on(edge, key, stored.id, response, scores_asked(stored)))


async def answered_before(request: Request, edge: EdgeState, key: ApiKey, response_id: str,
                          stream: bool) -> Response:
    """The response an earlier request with this Idempotency-Key made, as this request asks for it:
    whole (once it has ended), or its stream, read again."""
    stored = await stored_response(edge, key, response_id)
    if stored is None:
        raise Conflict(f"The response bound to this Idempotency-Key, {response_id}, was not stored (store: false), "
                       "or is still starting; retry shortly.", param="Idempotency-Key", code="idempotency_key_in_use")
    response = json.loads(stored.body)
    if not stream:
        if response["status"] == "in_progress":
            stored = await waited_for(request, edge, key, stored)
        return Response(stored.body, media_type="application/json", headers={REQUEST_ID_HEADER: response_id})
    return await stream_again(request, edge, key, response_id, response, scores_asked(stored), -1)


async def waited_for(request: Request, edge: EdgeState, key: ApiKey, stored: StoredResponse) -> StoredResponse:
    """A stored response under way, once it has ended: its stream read from the log to the end by
    this client (a turn whose client went is not cancelled while one reads it), then read back."""
    response = json.loads(stored.body)
    frames = await frames_from_log(edge, key, stored.id, response, scores_asked(stored), -1)
    if frames is None:
        raise NotFound(f"The stream of '{stored.id}' is no longer kept and cannot be read again.",
                       param="response_id", code="stream_expired")
    await unless_disconnected(request, read_through(frames))
    ended = await stored_response(edge, key, stored.id)
    if ended is None or json.loads(ended.body)["status"] == "in_progress":
        raise ServerError(f"The response {stored.id} ended, but could not be stored; retrieve it later.")
    return ended


async def read_through(frames: AsyncGenerator[bytes, None]) -> None:
    async for _ in frames:
        pass


async def stream_again(request: Request, edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any],
                       logprobs: bool, starting_after: int) -> Response:
    """A response's stream again, after the event ``starting_after`` (OpenAI's resumption): read
    from the log while it holds the stream, and then live, numbered as it went out live; whoever
    reads it to the end stores the response ended, if it is not yet. Once the log no longer holds
    it, an ended response's stream is made from the stored response, each item in one piece."""
    headers = {REQUEST_ID_HEADER: response_id}
    frames = await frames_from_log(edge, key, response_id, response, logprobs, starting_after)
    if frames is not None:
        return sse_response(frames, edge.settings.heartbeat_s, EVENT_STREAM, headers)
    if response["status"] == "in_progress":
        raise NotFound(f"The stream of '{response_id}' is no longer kept and cannot be read again.",
                       param="response_id", code="stream_expired")
    writer = ResponseEvents(skeleton_of(response), logprobs, starting_after, response.get("completed_at"))
    return sse_response(one_frame(writer.replayed(response)), edge.settings.heartbeat_s, EVENT_STREAM, headers)


async def frames_from_log(edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any], logprobs: bool,
                          starting_after: int, by_client: bool = True) -> AsyncGenerator[bytes, None] | None:
    """A response's events after ``starting_after``, made from its token events as the log holds
    them (then live), storing the response ended if it is not yet; None once the log has let go.
    Read ``by_client`` (resumed), a turn is no longer abandoned, and is again if the client goes
    (and the reading handed over); read by an edge (``read_on``), it is neither."""
    record = await find_stream(edge, response_id, key.tenant, response_not_found)
    if record.topic and not await edge.bus.router.log_exists(record.topic):
        return None
    stored = await stored_response(edge, key, response_id)
    kept = KeptResponse.of_stored(edge.responses, stored, edge.settings.history_turns,
                                  edge.conversations) if stored else None
    if by_client:
        with contextlib.suppress(redis.RedisError, OSError):
            await edge.streams.attach(response_id)  # a client that went away is back: not cancelled
    events = replay(edge.settings.bus, response_id, record.partition, record.start_offset, topic=record.topic,
                    idle_timeout=edge.settings.stream_idle_timeout_s, codec=edge.bus.codec)
    hooks = TurnHooks(edge, response_id, background=not by_client or bool(response.get("background")))
    writer = ResponseEvents(skeleton_of(response), logprobs, starting_after, response.get("completed_at"))
    frames = response_frames(events, writer, hooks, edge.metrics, time.perf_counter(),
                             kept.ended if kept is not None else nothing_kept)
    if by_client and kept is not None:
        frames = served_frames(frames, kept, handing_over(edge, key, response_id, response, logprobs))
    return frames


def skeleton_of(response: dict[str, Any]) -> dict[str, Any]:
    """A response as it was when it began: what its stream's first events show."""
    return ended_as(response, "in_progress", [], None)


def scores_asked(stored: StoredResponse) -> bool:
    return bool(json.loads(stored.context).get("logprobs"))


async def one_frame(written: bytes) -> AsyncGenerator[bytes, None]:
    yield StreamEnd(written)


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


async def stored_response(edge: EdgeState, key: ApiKey, response_id: str) -> StoredResponse | None:
    try:
        return await edge.responses.get(key.tenant, response_id)
    except (redis.RedisError, OSError):
        raise Unavailable("Stored responses are unavailable right now; retry shortly.",
                          "responses_unavailable") from None


async def tenant_response(request: Request) -> tuple[EdgeState, ApiKey, StoredResponse]:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    response_id = request.path_params["response_id"]
    stored = await stored_response(edge, key, response_id)
    if stored is None:
        raise response_not_found(response_id)
    return edge, key, stored


def response_not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found")


async def retrieve_response(request: Request) -> Response:
    """A stored response; with ``stream=true``, its stream again, after ``starting_after`` if given.
    A response under way whose reader is gone (its edge stopped) is read on from here."""
    edge, key, stored = await tenant_response(request)
    if request.query_params.get("stream", "false").lower() in ("false", "0"):
        read_on_if_unread(edge, key, stored)
        return Response(stored.body, media_type="application/json")
    raw = request.query_params.get("starting_after", "-1")
    if not raw.lstrip("-").isdigit() or int(raw) < -1:
        raise InvalidRequest("starting_after must be the sequence number of an event received, like 12.",
                             param="starting_after", code="invalid_value")
    return await stream_again(request, edge, key, stored.id, json.loads(stored.body), scores_asked(stored), int(raw))


async def delete_response(request: Request) -> Response:
    edge, key, stored = await tenant_response(request)
    try:
        await edge.responses.delete(key.tenant, stored.id)
    except (redis.RedisError, OSError):
        raise Unavailable("Stored responses are unavailable right now; retry shortly.",
                          "responses_unavailable") from None
    return JSONResponse({"id": stored.id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """Stop a turn's generation now (OpenAI cancels background responses so; here any turn under
    way, as chat completions' ``cancel``). Answered with the response as it ended (stored, where it
    is), or, where it is not stored, with its id and ``cancelled``. A response that has ended is as
    it was."""
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    response_id = request.path_params["response_id"]
    stored = await stored_response(edge, key, response_id)
    if stored is None or json.loads(stored.body)["status"] == "in_progress":
        await find_stream(edge, response_id, key.tenant, response_not_found)
        await edge.bus.cancel(response_id, "cancelled by the client")
        if stored is not None:
            read_on_if_unread(edge, key, stored)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:  # its stream ends, and stores it
            await asyncio.sleep(0.05)
            stored = await stored_response(edge, key, response_id)
            if stored is not None and json.loads(stored.body)["status"] != "in_progress":
                break
    if stored is None:
        return JSONResponse({"id": response_id, "object": "response", "status": "cancelled"})
    return Response(stored.body, media_type="application/json")


async def list_input_items(request: Request) -> Response:
    _, _, stored = await tenant_response(request)
    items: list[dict[str, Any]] = json.loads(stored.input_items)
    if list_order(request) == "desc":
        items.reverse()
    page, has_more = cursor_page(items, [item["id"] for item in items], request, default_limit=20, max_limit=100)
    return JSONResponse(list_body(page, has_more))
