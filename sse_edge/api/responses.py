"""OpenAI's Responses API: ``POST /v1/responses`` (a turn, streamed as named events or answered
whole), and a stored response's ``GET``, ``DELETE`` and ``input_items``.

A turn is served as a chat turn is (chat.py's ``start_turn``): the request reads as a chat
completion's (protocol/responses.py), goes on the bus under the response's id, and is billed,
moderated and transcribed as any turn is. What the Responses API adds is kept here, at the edge:
a stored response (``store``, its default) holds its context, which a turn naming it as
``previous_response_id`` is prompted with before its own input (the previous turn's
``instructions`` are not carried over, as OpenAI's are not)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.schemas import ChatMessage, ToolCall
from tokenbus.sse_edge.api.chat import (
    REQUEST_ID_HEADER,
    check_model,
    claim_idempotency_key,
    prompt_messages,
    start_turn,
    to_bus_request,
)
from tokenbus.sse_edge.errors import ApiError, Conflict, InvalidRequest, NotFound, Unavailable
from tokenbus.sse_edge.plumbing.history import History, StoredTurn, turn_from_json, turn_to_json
from tokenbus.sse_edge.plumbing.relay import collect_choices, generation_error
from tokenbus.sse_edge.plumbing.response_relay import response_frames
from tokenbus.sse_edge.plumbing.stream_response import StreamEnd, StreamFormat, sse_response
from tokenbus.sse_edge.protocol.batches import list_body
from tokenbus.sse_edge.protocol.chat import ChatCompletionRequest
from tokenbus.sse_edge.protocol.response_objects import (
    INCOMPLETE_BECAUSE,
    ResponseEvents,
    item_id,
    output_items,
    response_object,
    status_of,
    usage_of,
)
from tokenbus.sse_edge.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    ResponsesRequest,
)
from tokenbus.sse_edge.protocol.validation import body_hash, cursor_page, list_order, parse_responses_request, read_body
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.keys import ApiKey
from tokenbus.stores.responses import StoredResponse, new_response_id

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 3.0  # for a cancelled turn's stream to end and store it
# The Responses API's clients read SSE: its heartbeat comments are theirs too.
EVENT_STREAM = StreamFormat(event_ids=True)


async def create_response(request: Request) -> Response:
    """A turn. With an ``Idempotency-Key`` seen before (same body), the turn is not published
    again: the response it made is answered, once it has ended and been stored."""
    edge: EdgeState = request.app.state.edge
    started = time.perf_counter()
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked, items, chat = parse_responses_request(raw, edge.settings)
    check_model(edge, key, chat.model)
    response_id, digest = new_response_id(), body_hash(raw)
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key:
        earlier = await claim_idempotency_key(edge, key, idempotency_key, digest, response_id)
        if earlier is not None:
            return await answered_before(edge, key, earlier.request_id, asked)
    try:
        return await respond(request, edge, key, asked, items, chat, response_id, digest, started)
    except ApiError:
        if idempotency_key:  # never published: a retry with this key must be able to try again
            await edge.streams.release(key.tenant, idempotency_key, response_id)
        raise


async def respond(request: Request, edge: EdgeState, key: ApiKey, asked: ResponsesRequest, items: list[InputItem],
                  chat: ChatCompletionRequest, response_id: str, digest: str, started: float) -> Response:
    earlier = await previous_turns(edge, key, asked)
    bus_request = to_bus_request(chat, edge, key, response_id)
    own = bus_request.messages
    bus_request.messages = await responses_prompt(edge, key, asked, chat, own, earlier)
    turn = await start_turn(request, edge, key, [bus_request], include_usage=True, digest=digest)
    in_progress = response_object(turn.response_id, bus_request.created_at_ms // 1000, turn.model, asked.echoed(),
                                  "in_progress", [])
    this_turn = own[1:] if asked.instructions else own  # a turn continuing it gets its own instructions

    async def on_end(response: dict[str, Any]) -> None:
        if asked.store:
            await store(edge, key, response, items, earlier, StoredTurn(turn.response_id, bus_request.created_at_ms,
                                                                         (*this_turn, answer_message(response))))

    if asked.stream:
        writer = ResponseEvents(in_progress, asked.logprobs)
        frames = response_frames(turn.events, writer, turn.hooks, edge.metrics, started, on_end, turn.direct)
        return sse_response(frames, edge.settings.heartbeat_s, EVENT_STREAM, turn.headers, turn.direct)
    [choice] = await collect_choices(request, turn.events, turn.choices, turn.hooks)
    final = choice.final
    error = generation_error(final)
    status = status_of(final.finish_reason, failed=error is not None)
    calls = [(c.id, c.name, c.arguments) for c in choice.calls]
    response = response_object(
        turn.response_id, in_progress["created_at"], turn.model, asked.echoed(), status,
        output_items(choice.text, calls, status, choice.scored if asked.logprobs else None),
        usage_of(final.prompt_tokens or 0, final.completion_tokens or 0, final.cached_tokens or 0),
        error=error.body()["error"] if error is not None else None,
        incomplete_reason=INCOMPLETE_BECAUSE.get(final.finish_reason or ""))
    await on_end(response)  # a failed one too: retrieving it says how it ended
    if error is not None:
        raise error
    return JSONResponse(response, headers=turn.headers)


async def answered_before(edge: EdgeState, key: ApiKey, response_id: str, asked: ResponsesRequest) -> Response:
    """The response an earlier request with this Idempotency-Key made, as this request asks for it."""
    stored = await stored_response(edge, key, response_id)
    if stored is None:
        raise Conflict(f"The response bound to this Idempotency-Key, {response_id}, has not ended yet or was not "
                       "stored; retrieve it once it has ended.", param="Idempotency-Key", code="idempotency_key_in_use")
    headers = {REQUEST_ID_HEADER: response_id}
    if not asked.stream:
        return Response(stored.body, media_type="application/json", headers=headers)
    response = json.loads(stored.body)
    writer = ResponseEvents({**response, "status": "in_progress", "output": [], "usage": None, "error": None,
                             "incomplete_details": None, "completed_at": None}, asked.logprobs)
    return sse_response(one_frame(writer.replayed(response)), edge.settings.heartbeat_s, EVENT_STREAM, headers)


async def one_frame(written: bytes) -> AsyncGenerator[bytes, None]:
    yield StreamEnd(written)


async def previous_turns(edge: EdgeState, key: ApiKey, asked: ResponsesRequest) -> list[StoredTurn]:
    """The turns of the chain ``previous_response_id`` ends (none without one)."""
    if asked.previous_response_id is None:
        return []
    stored = await stored_response(edge, key, asked.previous_response_id)
    if stored is None:
        raise InvalidRequest(f"Previous response with id '{asked.previous_response_id}' not found.",
                             param="previous_response_id", code="previous_response_not_found")
    return [turn_from_json(t) for t in json.loads(stored.context)["turns"]]


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


def answer_message(response: dict[str, Any]) -> ChatMessage:
    """A response's output as the assistant message a turn continuing it is prompted with."""
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = tuple(ToolCall(item["call_id"], item["name"], item["arguments"]) for item in response["output"]
                  if item["type"] == "function_call")
    return ChatMessage("assistant", text, calls)


async def store(edge: EdgeState, key: ApiKey, response: dict[str, Any], items: list[InputItem],
                earlier: list[StoredTurn], turn: StoredTurn) -> None:
    """Keep the response, its input items and its context (the chain's newest ``history_turns``
    turns, this one last). The response has been answered either way: one that cannot be stored
    (Redis down) is only missing later, which a retrieval or continuation says."""
    chain = [*earlier, turn][-edge.settings.history_turns:]
    stored = StoredResponse(response["id"], key.tenant, json.dumps(response, separators=(",", ":")),
                            json.dumps(listed_items(items), separators=(",", ":")),
                            json.dumps({"turns": [turn_to_json(t) for t in chain]}, separators=(",", ":")))
    try:
        await edge.responses.put(stored)
    except (redis.RedisError, OSError) as exc:
        log.warning("could not store response %s: %s", response["id"], type(exc).__name__)


def listed_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as the input item list shows them: each with an id, a message's content as parts."""
    listed = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            listed.append({"id": item_id("fc"), **item.model_dump(), "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else [p.model_dump() for p in item.output]
            listed.append({"id": item_id("fco"), "type": item.type, "call_id": item.call_id, "output": output,
                           "status": "completed"})
        else:
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = ([{"type": kind, "text": item.content}] if isinstance(item.content, str)
                       else [p.model_dump() for p in item.content])
            listed.append({"id": item_id("msg"), "type": "message", "role": item.role, "content": content,
                           "status": "completed"})
    return listed


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
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise InvalidRequest("A stored response cannot be streamed again: OpenAI streams only background responses "
                             "so, which tokenbus does not serve.", param="stream", code="unsupported_parameter")
    _, _, stored = await tenant_response(request)
    return Response(stored.body, media_type="application/json")


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
    if stored is None:
        try:
            record = await edge.streams.get(response_id)
        except (redis.RedisError, OSError):
            raise Unavailable("Stream lookup is unavailable; retry shortly.", "streams_unavailable") from None
        if record is None or record.tenant != key.tenant:
            raise response_not_found(response_id)
        await edge.bus.cancel(response_id, "cancelled by the client")
        deadline = time.monotonic() + CANCEL_WAIT_S
        while stored is None and time.monotonic() < deadline:  # its stream ends, and stores it
            await asyncio.sleep(0.05)
            stored = await stored_response(edge, key, response_id)
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
