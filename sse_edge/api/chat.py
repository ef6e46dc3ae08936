"""``POST /v1/chat/completions``: authenticate, validate, place the conversation's stored turns
(server-side history), admit (or fall back to another model), publish to the bus, relay the
token stream (and keep the completion where ``store`` asks: stored_completions.py). With an
``Idempotency-Key`` seen before (same body), the request is not published again: the client is
attached to the first one's stream. A text completion (completions.py) is served the same way
from ``answer`` on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as redis
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.producers import new_request_id
from tokenbus.schemas import (
    RESPONSE_JSON_SCHEMA,
    RESPONSE_REGEX,
    TOOL_CHOICE_AUTO,
    TOOL_CHOICE_FUNCTION,
    ChatMessage,
    ChatRequest,
    ToolSpec,
)
from tokenbus.sse_edge.api.resume import parse_last_event_id, relay_existing
from tokenbus.sse_edge.errors import (
    ApiError,
    ClientClosed,
    Conflict,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
    model_not_found,
)
from tokenbus.sse_edge.plumbing.history import ConversationNotFound
from tokenbus.sse_edge.plumbing.kept_completions import KeptCompletion
from tokenbus.sse_edge.plumbing.relay import Choices, sse_frames, whole_completion
from tokenbus.sse_edge.plumbing.stream_response import DirectWrites, StreamFormat, sse_response
from tokenbus.sse_edge.plumbing.streams import IdempotencyConflict, StreamRecord
from tokenbus.sse_edge.plumbing.summaries import ask_for_summary, needs_summary, summary_request
from tokenbus.sse_edge.protocol.chat import ChatCompletionRequest, GenerationRequest
from tokenbus.sse_edge.protocol.completion_bodies import ChunkWriter
from tokenbus.sse_edge.protocol.service_tiers import openai_name, tier_asked, tier_served
from tokenbus.sse_edge.protocol.stored_completions import stored_messages
from tokenbus.sse_edge.protocol.validation import body_hash, parse_chat_request, read_body
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.sse_edge.state import EdgeState, TurnHooks
from tokenbus.stores.keys import ApiKey
from tokenbus.topics import ReplyEvent, ReplyGroup, ReplyStream, tracing

IDEMPOTENT_WAIT_S = 3.0
REQUEST_ID_HEADER = "x-request-id"
Asked = TypeVar("Asked", bound=GenerationRequest)  # a chat's or a text completion's request


async def chat_completions(request: Request) -> Response:
    return await answer(request, parse_chat_request, "chatcmpl", chat_bus_request)


async def chat_bus_request(chat: ChatCompletionRequest, edge: EdgeState, key: ApiKey,
                           request_id: str) -> list[ChatRequest]:
    made = to_bus_request(chat, edge, key, request_id)
    made.messages = await prompt_messages(edge, key, chat, made.messages)
    return [made]


def check_model(edge: EdgeState, key: ApiKey, model: str) -> None:
    if model not in edge.settings.bus.models:
        raise model_not_found(model)
    if not key.allows(model):
        raise PermissionDenied(f"This API key may not use the model `{model}`.", param="model",
                               code="model_not_allowed")


async def answer(request: Request, parse: Callable[[bytes, EdgeSettings], Asked], kind: str,
                 bus_requests: Callable[[Asked, EdgeState, ApiKey, str], Awaitable[list[ChatRequest]]]) -> Response:
    """Serve a chat or text completion request: its key, its body as ``parse`` validates it, its
    model, then the bus request ``bus_requests`` makes under a new ``kind-...`` id (one a prompt:
    a text completion may send several), with its ``n`` choices; or, with an ``Idempotency-Key``
    seen before, the earlier one's stream."""
    edge: EdgeState = request.app.state.edge
    started = time.perf_counter()
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked = parse(raw, edge.settings)
    check_model(edge, key, asked.model)
    request_id = new_request_id(kind)
    digest = body_hash(raw)
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key:
        earlier = await claim_idempotency_key(edge, key, idempotency_key, digest, request_id)
        if earlier is not None:
            return await relay_existing(request, edge, key, earlier, parse_last_event_id(request), asked.stream)
    try:
        made = await bus_requests(asked, edge, key, request_id)
        kept = keeping(edge, key, asked, made[0])
        if len(made) == 1 and asked.n == 1:
            return await serve(request, edge, key, made, asked.stream, asked.include_usage, digest, started, kept=kept)
        return await serve(request, edge, key, choice_requests(made, asked.n, request_id), asked.stream,
                           asked.include_usage, digest, started, response_id=request_id, per_prompt=asked.n,
                           kept=kept)
    except ClientClosed:
        raise  # its turn goes on for the grace window: a retry with this key takes it up, whole
    except ApiError:
        if idempotency_key:  # not published, or failed: a retry with this key must be able to try again
            await edge.streams.release(key.tenant, idempotency_key, request_id)
        raise


async def serve(request: Request, edge: EdgeState, key: ApiKey, bus_requests: list[ChatRequest], stream: bool,
                include_usage: bool, digest: str, started: float, response_id: str | None = None,
                per_prompt: int = 1, kept: KeptCompletion | None = None) -> Response:
    """Start the turn of the response's ``bus_requests`` (``start_turn``) and relay its stream: as
    SSE, or as one chat.completion; and store it where ``kept`` says to."""
    first = bus_requests[0]
    turn = await start_turn(request, edge, key, bus_requests, include_usage, digest, response_id, per_prompt)
    text = first.text_prompt  # answered in a text completion's shapes
    service_tier = None if text else openai_name(first.tier, edge.settings.bus.tiers)
    if stream:
        writer = ChunkWriter(turn.response_id, turn.model, include_usage, first.created_at_ms // 1000, text=text,
                             service_tier=service_tier)
        stream_format = StreamFormat.for_request(request)
        events, direct = turn.events, turn.direct
        if kept is not None:  # (every event passes by to be kept: none is written directly)
            events, direct = kept.reading(events, turn.choices, turn.model, service_tier), None
        frames = sse_frames(events, writer, turn.hooks, edge.metrics, started, stream_format, direct=direct,
                            choices=turn.choices)
        return sse_response(frames, edge.settings.heartbeat_s, stream_format, turn.headers, direct)
    body = await whole_completion(request, turn.events, turn.response_id, turn.model, turn.hooks, text, turn.choices,
                                  service_tier)
    if kept is not None:
        await kept.keep(body)
    return JSONResponse(body, headers=turn.headers)


def keeping(edge: EdgeState, key: ApiKey, asked: GenerationRequest, first: ChatRequest) -> KeptCompletion | None:
    """How a chat completion that asks to be stored is kept (a deployment that stores nothing
    serves it as one that does not ask)."""
    if not (isinstance(asked, ChatCompletionRequest) and asked.store and edge.settings.store_responses):
        return None
    return KeptCompletion(edge.completions, key.tenant, first.request_id, first.created_at_ms, asked.metadata or {},
                          stored_messages(first.request_id, asked.messages))


@dataclasses.dataclass(slots=True)
class Turn:
    """A turn published and under way: the response's id, the model that answers (a fallback's,
    where admission chose one), the response headers, its events and what the relay reports to."""

    response_id: str
    model: str
    headers: dict[str, str]
    events: AsyncGenerator[ReplyEvent, None]
    hooks: TurnHooks
    choices: Choices
    direct: DirectWrites | None  # a live stream of one request: its events may be written as they arrive
    registered: asyncio.Future[None]  # the stream's record written: any edge can find the stream


async def start_turn(request: Request, edge: EdgeState, key: ApiKey, bus_requests: list[ChatRequest],
                     include_usage: bool, digest: str, response_id: str | None = None, per_prompt: int = 1) -> Turn:
    """Admit the response's ``bus_requests`` (one; or one a choice, ``per_prompt`` choices a
    prompt, of the response ``response_id``) and publish them. A response of several choices is
    admitted as one request with its prompts' tokens. The turn's trace (the client's, when it
    sends a ``traceparent``) goes on in the request records."""
    first = bus_requests[0]
    response_id = response_id or first.request_id
    span = tracing.start("chat", tracing.from_http(request.headers), tracing.SpanKind.SERVER,
                         {"tokenbus.request_id": response_id, "tokenbus.tenant": key.tenant})
    try:
        prompt_tokens = sum(r.estimated_prompt_tokens for r in bus_requests if r.prompt_billed_with is None)
        admitted = await edge.admission.admit(key, first.model, first.tier, prompt_tokens, first.offers_tools)
        for bus_request in bus_requests:
            bus_request.model = admitted.model  # a fallback's, when the requested model's queue is full
        with tracing.current(span):
            reply_stream, registering = await publish(edge, bus_requests, response_id, per_prompt, include_usage,
                                                      digest)
    except BaseException as exc:
        tracing.end(span, exc)
        raise
    choices = Choices(response_id, reply_stream.request_ids, per_prompt)
    # As OpenAI's responses say it (the openai client's ``_request_id``): here, the completion's id.
    headers = {**admitted.headers, REQUEST_ID_HEADER: response_id}
    return Turn(response_id, admitted.model, headers, live_events(edge, reply_stream, span, registering),
                TurnHooks(edge, response_id, admitted.token_buckets, choices), choices,
                DirectWrites(reply_stream) if isinstance(reply_stream, ReplyStream) else None, registering)


def choice_requests(prompts: list[ChatRequest], n: int, response_id: str) -> list[ChatRequest]:
    """A response of several choices (OpenAI's ``n``, a batch of prompts) as the requests that
    generate them, each of its own on the bus: ``{response_id}-{index}``, numbered prompt by prompt
    as OpenAI and vLLM number choices. A prompt's choices sample apart (a ``seed``: the next seed
    for each), and the first bills the prompt they share (``prompt_billed_with``)."""
    made = []
    for p, prompt in enumerate(prompts):
        for sample in range(n):
            made.append(dataclasses.replace(
                prompt, request_id=f"{response_id}-{p * n + sample}", seed=next_seed(prompt.seed, sample),
                prompt_billed_with=f"{response_id}-{p * n}" if sample else None))
    return made


def next_seed(seed: int | None, step: int) -> int | None:
    """The seed ``step`` after ``seed``, within a signed 64-bit integer (as request_checks wants it)."""
    return None if seed is None else (seed + step + 2**63) % 2**64 - 2**63


async def live_events(edge: EdgeState, stream: ReplyStream | ReplyGroup, span: tracing.Span | None = None,
                      registering: Awaitable[None] | None = None) -> AsyncGenerator[ReplyEvent, None]:
    """The request's events from this edge's reply router, the first once ``registering`` (the
    stream's record) is done; its entry there (and the turn's span at this edge) goes when this
    ends."""
    try:
        async for reply in stream.events(edge.settings.stream_idle_timeout_s):
            if registering is not None:
                await registering
                registering = None
            if span is not None and reply.event.seq == 0:
                span.add_event("first event")
            yield reply
    finally:
        for request_id in stream.request_ids:
            edge.bus.finish(request_id)
        tracing.end(span)


async def prompt_messages(edge: EdgeState, key: ApiKey, chat: ChatCompletionRequest,
                          messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages the model sees: with server-side history, the conversation's stored turns that
    fit its context window go before the request's own; a prompt that cannot fit is refused."""
    context = edge.context
    if chat.server_history:
        assert chat.conversation_id is not None  # validation requires it
        try:
            history = await edge.history.load(key.tenant, chat.conversation_id)
        except ConversationNotFound:
            raise NotFound(f"No conversation '{chat.conversation_id}'.", param="metadata.conversation_id",
                           code="conversation_not_found") from None
        prompt, dropped = context.with_history(chat.model, messages, history, chat.token_limit)
        summarizer = edge.settings.history_summaries.get(chat.model)
        if summarizer is not None and needs_summary(history, dropped):
            summary = summary_request(edge.bus, summarizer, key, chat.conversation_id, history, dropped,
                                      edge.settings.history_summary_max_tokens)
            edge.in_background(ask_for_summary(edge.bus, edge.history, summary))
        return prompt
    context.check_messages(chat.model, messages, chat.token_limit, truncate=chat.truncate_prompt_tokens)
    return messages


async def publish(edge: EdgeState, bus_requests: list[ChatRequest], response_id: str, per_prompt: int,
                  include_usage: bool, digest: str) -> tuple[ReplyStream | ReplyGroup, asyncio.Future[None]]:
    """Open the response's stream and publish its requests (the SDK's submit: no event can slip
    past), then record where the stream lives and where each request landed, so that any edge can
    find both: the stream's position is taken before the requests go out, and the records are
    written while the engines start on them. The returned future is that write: the stream's
    events wait for it (``live_events``), so the client hears of the stream only once any edge can
    find it. A response of several choices reads its requests' events as one stream, recorded
    under its own id with theirs (each request has its own record too)."""
    first = bus_requests[0]
    stream_offset = edge.bus.router.position(first.reply_partition, first.reply_topic)
    ingress = edge.bus.catalog.ingress if edge.settings.route == "ingress" else None
    stream: ReplyStream | ReplyGroup
    try:
        if len(bus_requests) == 1:
            stream, landed = await edge.bus.submission(first, topic=ingress)
            places = [landed]
        else:
            stream, places = await edge.bus.group_submission(response_id, bus_requests, topic=ingress)
    except KafkaError as exc:
        raise Unavailable(f"The request bus is unavailable: {type(exc).__name__}.", "service_unavailable") from None
    records = [stream_record(r, stream_offset, landed, include_usage, digest)
               for r, landed in zip(bus_requests, places, strict=True)]
    if len(bus_requests) > 1:
        records.append(dataclasses.replace(records[0], request_id=response_id, request_topic="", request_partition=-1,
                                           request_offset=-1, choices=[r.request_id for r in bus_requests],
                                           choices_per_prompt=per_prompt))
    registering = asyncio.ensure_future(register_streams(edge, records))
    if first.conversation_id is not None and first.continues_request_id is None:
        # The conversation's next turn waits for this one (a continuation rewrites a turn stored already).
        await edge.history.published(first.tenant, first.conversation_id, first.request_id)
    return stream, registering


async def claim_idempotency_key(edge: EdgeState, key: ApiKey, idempotency_key: str, digest: str,
                                request_id: str) -> StreamRecord | None:
    """None if this request now owns the key; the earlier request's stream if the key was used
    with the same body. A duplicate arriving while the first is still being admitted waits for it."""
    if len(idempotency_key) > 255:
        raise InvalidRequest("Idempotency-Key may be at most 255 characters.", param="Idempotency-Key")
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
                raise Conflict("The request bound to this Idempotency-Key is still being admitted.",
                               param="Idempotency-Key", code="idempotency_key_in_use")
            await asyncio.sleep(0.02)
    except IdempotencyConflict:
        raise Conflict("This Idempotency-Key was already used with a different request body.",
                       param="Idempotency-Key", code="idempotency_key_reused") from None
    except (redis.RedisError, OSError):
        raise Unavailable("Idempotent requests are unavailable right now; retry shortly.",
                          "idempotency_unavailable") from None


def generation_fields(asked: GenerationRequest, edge: EdgeState, key: ApiKey, request_id: str) -> dict[str, Any]:
    """The bus request's fields every request has: who asks, for what, at which tier, sampled how,
    answered where."""
    answer, guide = asked.answer_format
    tiers = edge.settings.bus.tiers
    tier = tier_served(tier_asked(asked.service_tier, tiers), key.tier, tiers)
    return dict(request_id=request_id, model=asked.model, tier=tier, tenant=key.tenant, key_id=key.key_id,
                max_tokens=asked.token_limit, temperature=asked.temperature, top_p=asked.top_p, seed=asked.seed,
                stop=asked.stop_sequences, ignore_eos=asked.ignore_eos,
                presence_penalty=asked.presence_penalty or 0.0, frequency_penalty=asked.frequency_penalty or 0.0,
                logprobs=asked.logprobs_asked[0], top_logprobs=asked.logprobs_asked[1],
                logit_bias=asked.logit_bias or {}, top_k=max(asked.top_k or 0, 0), min_p=asked.min_p or 0.0,
                repetition_penalty=asked.repetition_penalty or 1.0, min_tokens=asked.min_tokens,
                stop_token_ids=asked.stop_token_ids or [], allowed_token_ids=asked.allowed_token_ids or [],
                bad_words=asked.bad_words or [], prompt_cache_key=asked.prompt_cache_key,
                include_stop_str_in_output=asked.include_stop_str_in_output,
                truncate_prompt_tokens=asked.truncate_prompt_tokens,
                response_format=answer,
                json_schema=json.dumps(guide, separators=(",", ":")) if answer == RESPONSE_JSON_SCHEMA else "",
                guided_regex=guide if answer == RESPONSE_REGEX else "",
                reply_topic=edge.bus.router.reply_topic,
                reply_partition=edge.bus.router.reply_partition)


def to_bus_request(chat: ChatCompletionRequest, edge: EdgeState, key: ApiKey, request_id: str) -> ChatRequest:
    return ChatRequest(
        **generation_fields(chat, edge, key, request_id),
        conversation_id=chat.conversation_id,
        messages=[m.on_the_bus() for m in chat.messages],
        tools=[ToolSpec.of(t.function.name, t.function.description, t.function.parameters) for t in chat.tools or []],
        tool_choice=tool_choice_of(chat),
        tool_choice_name=None if isinstance(chat.tool_choice, str | None) else chat.tool_choice.function.name,
        parallel_tool_calls=chat.parallel_tool_calls is not False,
        echo=chat.echo,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
    )


def tool_choice_of(chat: ChatCompletionRequest) -> str:
    """OpenAI's default is ``auto`` when tools are given (``none`` without, where it does not matter)."""
    if chat.tool_choice is None:
        return TOOL_CHOICE_AUTO
    return chat.tool_choice if isinstance(chat.tool_choice, str) else TOOL_CHOICE_FUNCTION


def stream_record(bus_request: ChatRequest, stream_offset: int, landed: RecordMetadata | None, include_usage: bool,
                  digest: str) -> StreamRecord:
    """Where the stream is (from ``stream_offset``, taken before the request was published, so no
    event of it lies before it) and where the request landed (none when the policy refused it)."""
    return StreamRecord(bus_request.request_id, bus_request.tenant, bus_request.model, bus_request.reply_partition,
                        stream_offset, include_usage, digest,
                        request_topic=landed.topic if landed else "",
                        request_partition=landed.partition if landed else -1,
                        request_offset=landed.offset if landed else -1,
                        created_at_ms=bus_request.created_at_ms, topic=bus_request.reply_topic,
                        text_prompt=bus_request.text_prompt, tier=bus_request.tier)


async def register_streams(edge: EdgeState, records: list[StreamRecord]) -> None:
    try:
        await asyncio.gather(*(edge.streams.register(record) for record in records))
    except (redis.RedisError, OSError):
        pass  # the stream is served; it just cannot be resumed elsewhere
