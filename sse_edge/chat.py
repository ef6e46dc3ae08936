"""``POST /v1/chat/completions``: validate, publish to the bus, relay the token stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producers import ReplyStream, ReplyStreamError, new_request_id
from schemas import ChatMessage, ChatRequest, TokenEvent
from sse_edge.bus import EdgeBus
from sse_edge.errors import ApiError, from_validation_error, model_not_found
from sse_edge.protocol import ChatCompletionRequest, ChunkWriter, completion_body

CLIENT_FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls"}


def frame(body: dict[str, Any] | str, event_id: str | None = None) -> ServerSentEvent:
    """One SSE event; JSON escapes newlines, so content can never break the framing."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return ServerSentEvent(data, id=event_id, sep="\n")


async def parse_chat_request(request: Request, max_body_bytes: int) -> ChatCompletionRequest:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError(413, f"Request body is larger than {max_body_bytes} bytes.", code="request_too_large")
    raw = await request.body()
    if len(raw) > max_body_bytes:
        raise ApiError(413, f"Request body is larger than {max_body_bytes} bytes.", code="request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "We could not parse the JSON body of your request.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def to_bus_request(chat: ChatCompletionRequest, bus: EdgeBus, tier: str) -> ChatRequest:
    return ChatRequest(
        request_id=new_request_id(),
        model=chat.model,
        tier=tier,
        messages=[ChatMessage(role=m.role, content=m.text()) for m in chat.messages],
        max_tokens=chat.token_limit,
        temperature=chat.temperature,
        top_p=chat.top_p,
        seed=chat.seed,
        stop=chat.stop_sequences,
        reply_topic=bus.router.topic,
        reply_partition=bus.router.reply_partition,
    )


def generation_error(event: TokenEvent) -> ApiError | None:
    if event.finish_reason in CLIENT_FINISH_REASONS:
        return None
    message = event.error or f"generation ended: {event.finish_reason}"
    return ApiError(500, f"The model could not complete the request: {message}", type="server_error", code="generation_failed")


async def chat_completions(request: Request) -> Response:
    bus: EdgeBus = request.app.state.bus
    settings = bus.settings
    chat = await parse_chat_request(request, settings.max_body_bytes)
    if chat.model not in settings.bus.models:
        raise model_not_found(chat.model)
    bus_request = to_bus_request(chat, bus, settings.default_tier)
    stream = bus.router.open(bus_request.request_id)
    try:
        await bus.publisher.publish(bus_request)
    except KafkaError as exc:
        bus.router.close(bus_request.request_id)
        raise ApiError(503, f"The request bus is unavailable: {type(exc).__name__}.", type="server_error",
                       code="service_unavailable", headers={"Retry-After": "1"}) from None
    if chat.stream:
        frames = sse_frames(bus, stream, ChunkWriter(bus_request.request_id, chat.model, chat.include_usage))
        return EventSourceResponse(frames, ping=settings.heartbeat_s, sep="\n")
    return await collect_completion(bus, stream, chat.model)


async def sse_frames(bus: EdgeBus, stream: ReplyStream, writer: ChunkWriter) -> AsyncIterator[ServerSentEvent]:
    """One SSE event per token event, its ``id`` locating the token event in the log."""
    try:
        yield frame(writer.role())
        async for reply in stream.events(bus.settings.stream_idle_timeout_s):
            event = reply.event
            error = generation_error(event) if event.is_final else None
            if error is not None:
                yield frame(error.body(), reply.event_id)
                return
            if event.text or event.is_final:
                yield frame(writer.delta(event.text, event.finish_reason), reply.event_id)
            if event.is_final and writer.include_usage:
                yield frame(writer.usage(event.prompt_tokens or 0, event.completion_tokens or 0))
        yield frame("[DONE]")
    except ReplyStreamError as exc:
        yield frame(ApiError(504, str(exc), type="server_error", code="stream_timeout").body())
    finally:
        bus.router.close(stream.request_id)


async def collect_completion(bus: EdgeBus, stream: ReplyStream, model: str) -> JSONResponse:
    text: list[str] = []
    try:
        async for reply in stream.events(bus.settings.stream_idle_timeout_s):
            text.append(reply.event.text)
            final = reply.event
    except ReplyStreamError as exc:
        raise ApiError(504, str(exc), type="server_error", code="stream_timeout") from None
    finally:
        bus.router.close(stream.request_id)
    error = generation_error(final)
    if error is not None:
        raise error
    body = completion_body(
        stream.request_id, model, "".join(text), final.finish_reason or "stop",
        final.prompt_tokens or 0, final.completion_tokens or 0,
    )
    return JSONResponse(body)
