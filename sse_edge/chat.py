"""``POST /v1/chat/completions``: authenticate, validate, admit, rate-limit, publish to the
bus, relay the token stream. With an ``Idempotency-Key`` seen before (same body), the
request is not published again: the client is attached to the first one's stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import redis.asyncio as redis
from aiokafka.errors import KafkaError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from producers import ReplyEvent, ReplyStream, new_request_id
from schemas import ChatMessage, ChatRequest, TokenEvent
from sse_edge.errors import ApiError, model_not_found
from sse_edge.keys import ApiKey
from sse_edge.protocol import ChatCompletionRequest, ChunkWriter
from sse_edge.ratelimit import Bucket, Decision, RedisUnavailable
from sse_edge.relay import RelayHooks, collect_completion, sse_frames
from sse_edge.resume import parse_last_event_id, relay_existing
from sse_edge.services import EdgeServices
from sse_edge.streams import IdempotencyConflict, StreamRecord
from sse_edge.validation import body_hash, estimate_prompt_tokens, parse_chat_request, read_body

IDEMPOTENT_WAIT_S = 3.0


async def chat_completions(request: Request) -> Response:
    edge: EdgeServices = request.app.state.edge
    settings = edge.settings
    started = time.perf_counter()
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    chat = parse_chat_request(raw, settings)
    if chat.model not in settings.bus.models:
        raise model_not_found(chat.model)
    if not key.allows(chat.model):
        raise ApiError(403, f"This API key may not use the model `{chat.model}`.", type="permission_error",
                       param="model", code="model_not_allowed")

    request_id = new_request_id()
    digest = body_hash(raw)
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key:
        earlier = await claim_idempotency_key(edge, key, idempotency_key, digest, request_id)
        if earlier is not None:
            return await relay_existing(request, edge, key, earlier, parse_last_event_id(request), chat.stream)
    try:
        check_bus(edge)
        check_queue_depth(edge, chat.model, key.tier)
        buckets = await rate_limit_buckets(edge, key, chat)
        decision = await admit(edge, buckets)
        bus_request = to_bus_request(chat, edge, key, request_id)
        stream = await publish(edge, bus_request, chat, digest)
    except ApiError:
        if idempotency_key:  # never published: a retry with this key must be able to try again
            await edge.streams.release(key.tenant, idempotency_key, request_id)
        raise

    hooks = relay_hooks(edge, request_id, buckets)
    events = live_events(edge, stream)
    if chat.stream:
        writer = ChunkWriter(request_id, chat.model, chat.include_usage)
        return EventSourceResponse(sse_frames(events, writer, hooks, edge.metrics, started), ping=settings.heartbeat_s,
                                   sep="\n", headers=decision.headers)
    return await collect_completion(request, events, request_id, chat.model, hooks, decision.headers or {})


async def live_events(edge: EdgeServices, stream: ReplyStream) -> AsyncGenerator[ReplyEvent, None]:
    """The request's events from this edge's reply router; its entry there goes when this ends."""
    try:
        async for reply in stream.events(edge.settings.stream_idle_timeout_s):
            yield reply
    finally:
        edge.bus.router.close(stream.request_id)


async def publish(edge: EdgeServices, bus_request: ChatRequest, chat: ChatCompletionRequest, digest: str):
    """Open the reply stream, record where it lives, then publish: no event can slip past."""
    stream = edge.bus.router.open(bus_request.request_id, bus_request.reply_partition)
    try:
        await register_stream(edge, bus_request, chat, digest)
        ingress = edge.bus.catalog.ingress if edge.settings.route == "ingress" else None
        await edge.bus.publisher.publish(bus_request, topic=ingress)
    except KafkaError as exc:
        edge.bus.router.close(bus_request.request_id)
        raise ApiError(503, f"The request bus is unavailable: {type(exc).__name__}.", type="server_error",
                       code="service_unavailable", headers={"Retry-After": "1"}) from None
    return stream


async def claim_idempotency_key(edge: EdgeServices, key: ApiKey, idempotency_key: str, digest: str,
                                request_id: str) -> StreamRecord | None:
    """None if this request now owns the key; the earlier request's stream if the key was used
    with the same body. A duplicate arriving while the first is still being admitted waits for it."""
    if len(idempotency_key) > 255:
        raise ApiError(400, "Idempotency-Key may be at most 255 characters.", param="Idempotency-Key")
    deadline = time.monotonic() + IDEMPOTENT_WAIT_S
    try:
        while True:
            earlier_id = await edge.streams.claim(key.tenant, idempotency_key, digest, request_id)
            if earlier_id is None:
                return None
            record = await edge.streams.get(earlier_id)
            if record is not None:
                return record
            if time.monotonic() > deadline:
                raise ApiError(409, "The request bound to this Idempotency-Key is still being admitted.",
                               param="Idempotency-Key", code="idempotency_key_in_use")
            await asyncio.sleep(0.02)
    except IdempotencyConflict:
        raise ApiError(409, "This Idempotency-Key was already used with a different request body.",
                       param="Idempotency-Key", code="idempotency_key_reused") from None
    except (redis.RedisError, OSError):
        raise ApiError(503, "Idempotent requests are unavailable right now; retry shortly.", type="server_error",
                       code="idempotency_unavailable", headers={"Retry-After": "1"}) from None


def check_bus(edge: EdgeServices) -> None:
    if not edge.bus.watch.available:
        raise ApiError(503, "The request bus is unavailable; retry shortly.", type="server_error",
                       code="bus_unavailable", headers={"Retry-After": "2"})


def check_queue_depth(edge: EdgeServices, model: str, tier: str) -> None:
    limit = edge.settings.max_queue_depth.get(tier)
    if limit is not None and edge.queues.depth(model, tier) >= limit:
        edge.metrics.overloaded.labels(tier).inc()
        raise ApiError(503, f"The {tier} queue for `{model}` is full; retry shortly.", type="server_error",
                       code="overloaded", headers={"Retry-After": "2"})


async def rate_limit_buckets(edge: EdgeServices, key: ApiKey, chat: ChatCompletionRequest) -> list[Bucket]:
    prompt = estimate_prompt_tokens(chat)
    tenant = await edge.auth.tenant_limits(key.tenant)
    route = await edge.auth.route_limits(chat.model, key.tier)
    levels = [(f"key:{key.key_id}", key.limits), (f"tenant:{key.tenant}", tenant),
              (f"route:{chat.model}:{key.tier}", route)]
    buckets = []
    for name, limits in levels:
        buckets.append(Bucket(f"{name}:rpm", "requests", limits.rpm, 1))
        buckets.append(Bucket(f"{name}:tpm", "tokens", limits.tpm, prompt))
    return buckets


async def admit(edge: EdgeServices, buckets: list[Bucket]) -> Decision:
    try:
        decision = await edge.limiter.admit(buckets)
    except RedisUnavailable:
        raise ApiError(503, "Rate limiting is unavailable; retry shortly.", type="server_error",
                       code="rate_limiter_unavailable", headers={"Retry-After": "1"}) from None
    if decision.allowed:
        return decision
    limited = decision.limited_by
    assert limited is not None
    edge.metrics.rate_limited.labels(limited.name.split(":")[0]).inc()
    retry_after = max(1, int(decision.retry_after_s + 0.999))
    raise ApiError(
        429,
        f"Rate limit reached for {limited.dimension} ({limited.name.rsplit(':', 1)[0]}): limit {limited.limit} per "
        f"minute. Please try again in {decision.retry_after_s:.1f}s.",
        type=limited.dimension, code="rate_limit_exceeded",
        headers={**(decision.headers or {}), "Retry-After": str(retry_after)},
    )


def to_bus_request(chat: ChatCompletionRequest, edge: EdgeServices, key: ApiKey, request_id: str) -> ChatRequest:
    return ChatRequest(
        request_id=request_id,
        model=chat.model,
        tier=key.tier,
        tenant=key.tenant,
        key_id=key.key_id,
        conversation_id=chat.conversation_id,
        messages=[ChatMessage(role=m.role, content=m.text()) for m in chat.messages],
        max_tokens=chat.token_limit,
        temperature=chat.temperature,
        top_p=chat.top_p,
        seed=chat.seed,
        stop=chat.stop_sequences,
        reply_topic=edge.bus.router.topic,
        reply_partition=edge.bus.router.reply_partition,
    )


async def register_stream(edge: EdgeServices, bus_request: ChatRequest, chat: ChatCompletionRequest, digest: str) -> None:
    """Record where the stream will be, before any event of it can exist."""
    partition = bus_request.reply_partition
    record = StreamRecord(bus_request.request_id, bus_request.tenant, bus_request.model, partition,
                          edge.bus.router.position(partition), chat.include_usage, digest)
    try:
        await edge.streams.register(record)
    except (redis.RedisError, OSError):
        pass  # the stream is served; it just cannot be resumed elsewhere


def relay_hooks(edge: EdgeServices, request_id: str, buckets: list[Bucket]) -> RelayHooks:
    async def on_final(event: TokenEvent) -> None:
        completion = [Bucket(b.name, b.dimension, b.limit, event.completion_tokens or 0)
                      for b in buckets if b.dimension == "tokens"]
        try:
            await edge.limiter.charge_completion(completion)
        except RedisUnavailable:
            pass

    def on_abandoned() -> None:
        edge.in_background(edge.cancel_unless_resumed(request_id))

    return RelayHooks(on_final, on_abandoned)

