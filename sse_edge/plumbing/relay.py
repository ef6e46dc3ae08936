"""Relay a request's token events to its client: as SSE frames (in the format the client reads,
stream_response.py), or collected into one ``chat.completion`` (or ``text_completion``). The
events come from this edge's reply router (a new request) or from the log (a resumed or
re-attached stream); the frames go out through the streaming response (stream_response.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from tokenbus.schemas import TokenEvent, whole_tool_calls
from tokenbus.schemas.request_checks import INVALID_REQUEST
from tokenbus.sse_edge.errors import ApiError, ClientClosed, InvalidRequest, ServerError, Unavailable
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.stream_response import DirectWrites, StreamEnd, StreamFormat
from tokenbus.sse_edge.protocol.completion_bodies import ChunkWriter, choices_body, completion_body
from tokenbus.sse_edge.protocol.logprobs import content_logprobs
from tokenbus.topics import STREAM_IDLE, ReplyEvent, ReplyStreamError, cancel_task
from tokenbus.topics.reply_stream import ROUTER_STOPPED

CLIENT_FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls"}
REFUSED_AS_ASKED = f"{INVALID_REQUEST}: "
T = TypeVar("T")


def frame(body: dict[str, Any] | str, event_id: str | None = None) -> bytes:
    """One SSE event, encoded here (sse-starlette passes bytes through): the data is JSON or
    ``[DONE]`` and the id is ``partition-offset``, so neither can hold a newline that would
    break the framing."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"id: {event_id}\ndata: {data}\n\n".encode() if event_id else f"data: {data}\n\n".encode()


def chunk_id(event_id: str, index: int, chunks: int) -> str:
    """The SSE id of one chunk of an event: the event's id on its last chunk, ``id.index`` on the
    ones before, so that a client resuming in the middle of an event gets only what it lacks."""
    return event_id if index == chunks - 1 else f"{event_id}.{index}"


def generation_error(event: TokenEvent) -> ApiError | None:
    return finish_error(event.finish_reason, event.error)


def finish_error(finish_reason: str | None, error: str | None) -> ApiError | None:
    """The error a generation that ended so (a final event's, a Completion's) is answered with;
    None where it ended as a client expects."""
    if finish_reason in CLIENT_FINISH_REASONS:
        return None
    if finish_reason == "cancelled" and not error:
        # OpenAI's chat completions know no cancelled finish: the stream ends with an error event
        # that says so, not with a server error (the client, or its disconnect, asked for it).
        return ApiError(409, "The generation was cancelled before it finished.", "invalid_request_error",
                        code="generation_cancelled")
    if error and error.startswith(REFUSED_AS_ASKED):  # the engine cannot do what it asks
        return InvalidRequest(f"The model cannot serve the request as asked: {error[len(REFUSED_AS_ASKED):]}",
                              code=INVALID_REQUEST)
    message = error or f"generation ended: {finish_reason}"
    return ServerError(f"The model could not complete the request: {message}", code="generation_failed")


def stream_error(exc: ReplyStreamError) -> ApiError:
    if exc.code in ("bus_unavailable", ROUTER_STOPPED):
        return Unavailable(str(exc), exc.code)
    return ApiError(504, str(exc), "server_error", code=exc.code)


class RelayHooks:
    """What the relay reports back: usage when the stream ends, that the client went away first,
    or that nothing answered for the idle timeout. Here each does nothing; the edge's turns say
    what they do (``TurnHooks``, sse_edge/state.py). Methods of a slotted object rather than three
    callables: an open stream holds its hooks for its whole life, and three closures cost ~0.7 KiB."""

    __slots__ = ()

    async def on_final(self, event: TokenEvent) -> None:
        """The final event is out (its usage is what the turn generated)."""

    def on_abandoned(self) -> None:
        """The client went away before the final event."""

    def on_stalled(self) -> None:
        """Nothing arrived for the idle timeout: whatever generated the stream is gone."""


class Choices:
    """The choices of one response, each a request on the bus: one (the response's own id), or
    several (OpenAI's ``n``, a batch of prompts: ``ids`` in index order, their events read as one
    stream). Which choice an event is of, and the response's usage once every choice has ended:
    the sum of theirs, each prompt counted once however many choices share it (the first of each
    ``per_prompt`` bills it), as OpenAI's usage counts it and as billing does."""

    __slots__ = ("ids", "per_prompt", "_index", "_open", "prompt_tokens", "completion_tokens", "cached_tokens")

    def __init__(self, response_id: str, ids: Sequence[str] = (), per_prompt: int = 1) -> None:
        self.ids = list(ids) or [response_id]
        self.per_prompt = per_prompt
        self._index = {request_id: index for index, request_id in enumerate(self.ids)}  # (looked up each event)
        self._open = set(self.ids)
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    @property
    def several(self) -> bool:
        return len(self.ids) > 1

    def index_of(self, request_id: str) -> int:
        return self._index[request_id] if self.several else 0

    def unfinished(self) -> list[str]:
        """The choices whose final event has not been counted in."""
        return sorted(self._open)

    def ended(self, event: TokenEvent) -> bool:
        """Count a choice's final event in; whether every choice has now ended."""
        self._open.discard(event.request_id)
        if self.index_of(event.request_id) % self.per_prompt == 0:
            self.prompt_tokens += event.prompt_tokens or 0
            self.cached_tokens += event.cached_tokens or 0
        self.completion_tokens += event.completion_tokens or 0
        return not self._open


class EventFrames:
    """What one stream writes for its token events: each event's chunks as SSE frames (with their ids
    for SSE clients), less the chunks a resuming client has already; the time to the first content
    chunk and between them observed as they go. The stream's task and its direct writes share it."""

    __slots__ = ("writer", "metrics", "started", "ids", "skip", "last_sent")  # ``writer``: the choice's being written

    def __init__(self, writer: ChunkWriter, metrics: EdgeMetrics, started: float, stream_format: StreamFormat) -> None:
        self.writer = writer
        self.metrics = metrics
        self.started = started
        self.ids = stream_format.event_ids
        self.skip = stream_format.skip_chunks
        self.last_sent: float | None = None

    def role(self) -> bytes:
        if self.skip:
            self.skip -= 1
            return b""
        return frame(self.writer.role())

    def of(self, reply: ReplyEvent) -> bytes:
        """The frames of one event that ends nothing, or the final one that ends well (``b""``: none)."""
        event = reply.event
        chunks = event_chunks(event, self.writer)
        if len(chunks) > self.skip and (event.text or event.tool_calls):
            self.last_sent = self.metrics.content_sent(self.started, self.last_sent)
        if len(chunks) == 1 and not self.skip and not self.ids:  # nearly every event
            return frame(chunks[0])
        out = []
        for i, chunk in enumerate(chunks):
            if self.skip:
                self.skip -= 1
            else:
                out.append(frame(chunk, chunk_id(reply.event_id, i, len(chunks)) if self.ids else None))
        return b"".join(out)


async def sse_frames(
    events: AsyncGenerator[ReplyEvent, None], writer: ChunkWriter, hooks: RelayHooks, metrics: EdgeMetrics,
    started: float, stream_format: StreamFormat, send_role: bool = True, direct: DirectWrites | None = None,
    choices: Choices | None = None, delivered_through: int = -1,
) -> AsyncGenerator[bytes, None]:
    """The frames of one stream. Chunk for chunk the same live and replayed (the role chunk, one per
    event with text or the final one, the usage chunk), which is what lets a client resume by count.

    Each yield is what one socket write carries: a token event's chunks together, the role chunk
    with the first event's (as vLLM's server and OpenAI's send it: when the first token is there),
    and the usage chunk with ``[DONE]`` as the ``StreamEnd``. On a loopback or a busy host a write
    costs as much as the rest of relaying an event, and a turn of a few tokens made six of them.

    With ``direct`` (a live stream), the events after the first are written as they arrive, by
    ``direct``, until one ends the stream; they come here only when the client's socket is full.

    With several ``choices`` (never written directly), each event is written as its choice's
    (a chat's role chunks, one a choice, lead), and the stream ends once every choice has: with
    the response's usage. A choice that fails ends the stream with its error. Such a stream is
    resumed by id from its start, its events up to ``delivered_through`` (an offset) read for
    the usage and not written again."""
    finished = False
    choices = choices or Choices(writer.request_id)
    writers = [writer.for_choice(i) for i in range(len(choices.ids))] if choices.several else [writer]
    frames = EventFrames(writer, metrics, started, stream_format)
    pending: list[bytes] = []  # frames not yet written: they go with the next ones
    metrics.open_streams.inc()
    try:
        if send_role and not writer.text:  # a text completion's choices have no role
            for choice_writer in writers:
                frames.writer = choice_writer
                pending.append(frames.role())
        async for reply in events:
            event = reply.event
            if choices.several:
                frames.writer = writers[choices.index_of(event.request_id)]
            error = generation_error(event) if event.is_final else None
            if error is not None:
                finished = True
                if choices.several:
                    hooks.on_abandoned()  # the other choices' generations are not wanted
                pending.append(frame(error.body(), reply.event_id if frames.ids else None))
                yield StreamEnd(b"".join(pending))
                return
            if reply.offset > delivered_through:
                pending.append(frames.of(reply))
            written = b"".join(pending)
            pending = []
            if written:
                yield written
            if event.is_final:
                await hooks.on_final(event)
                if not choices.ended(event):
                    continue
                finished = True
                if writer.include_usage and not frames.skip:
                    pending.append(frame(writer.usage(choices.prompt_tokens, choices.completion_tokens,
                                                      choices.cached_tokens)))
            elif direct is not None:
                direct.start(frames.of)  # the first event is out (and the stream registered): the rest may go direct
        pending.append(frame("[DONE]"))
        metrics.e2e.observe(time.perf_counter() - started)
        yield StreamEnd(b"".join(pending))
    except ReplyStreamError as exc:
        finished = True
        if exc.code == STREAM_IDLE:
            hooks.on_stalled()
        pending.append(frame(stream_error(exc).body()))
        yield StreamEnd(b"".join(pending))
    finally:
        metrics.open_streams.dec()
        await events.aclose()  # a replayed stream holds a Kafka consumer: release it now, not at GC
        if not finished:
            hooks.on_abandoned()


def event_chunks(event: TokenEvent, writer: ChunkWriter) -> list[str]:
    """The chunks one token event becomes: its text (after its echo, on a first event) with the
    finish reason (and its tokens' log probabilities, where asked: a chunk for them even where a stop
    sequence holds the text back), as one chunk; where the event holds function calls, its text, a
    chunk per piece of a call, and the finish."""
    # (A first event may carry an echo: the prompt, or the final message, given back before the text.)
    text = event.text if event.echo is None else event.echo + event.text
    if not event.tool_calls:
        scored = content_logprobs(event)
        if text or event.is_final or scored or event.prompt_logprobs:
            return [writer.delta(text, event.finish_reason, scored, event.prompt_logprobs)]
        return []
    chunks = [writer.delta(text, None)] if text else []
    chunks += [writer.tool_call(d.index, d.id, d.name, d.arguments) for d in event.tool_calls]
    if event.is_final:
        chunks.append(writer.delta("", event.finish_reason))
    return chunks


async def collect_completion(
    request: Request, events: AsyncGenerator[ReplyEvent, None], request_id: str, model: str, hooks: RelayHooks,
    headers: dict[str, str], text_completion: bool = False, choices: Choices | None = None,
    service_tier: str | None = None,
) -> JSONResponse:
    """Wait for the whole completion (a ``text_completion`` for a text prompt), every one of its
    ``choices``; a client that disconnects first abandons it."""
    return JSONResponse(await whole_completion(request, events, request_id, model, hooks, text_completion, choices,
                                               service_tier), headers=headers)


async def whole_completion(
    request: Request, events: AsyncGenerator[ReplyEvent, None], request_id: str, model: str, hooks: RelayHooks,
    text_completion: bool = False, choices: Choices | None = None, service_tier: str | None = None,
) -> dict[str, Any]:
    """The body ``collect_completion`` answers with (naming ``service_tier``, where given)."""
    choices = choices or Choices(request_id)
    collected = await collect_choices(request, events, choices, hooks)
    for choice in collected:
        error = generation_error(choice.final)
        if error is not None:
            raise error
    return completion_of(collected, request_id, model, choices, text_completion, service_tier=service_tier)


def completion_of(collected: list[CollectedChoice], request_id: str, model: str, choices: Choices,
                  text_completion: bool = False, created: int | None = None,
                  service_tier: str | None = None) -> dict[str, Any]:
    """One completion of its ``collected`` choices (each of ``choices``, in index order)."""
    bodies = [choice.body(request_id, model, text_completion, created, service_tier) for choice in collected]
    if not choices.several:
        return bodies[0]
    tally = Choices(request_id, choices.ids, choices.per_prompt)  # (``choices`` may have counted them already)
    for choice in collected:
        tally.ended(choice.final)
    return choices_body(bodies, tally.prompt_tokens, tally.completion_tokens, tally.cached_tokens)


async def collect_choices(request: Request, events: AsyncGenerator[ReplyEvent, None], choices: Choices,
                          hooks: RelayHooks) -> list[CollectedChoice]:
    """Every choice's events, delivered whole once each has ended (the hooks told of each final
    event); a client that disconnects first abandons them (``ClientClosed``)."""
    try:
        collected = await unless_disconnected(request, _collect(events, choices))
    except ClientClosed:
        hooks.on_abandoned()
        raise
    except ReplyStreamError as exc:
        if exc.code == STREAM_IDLE:
            hooks.on_stalled()
        raise stream_error(exc) from None
    for choice in collected:
        await hooks.on_final(choice.final)
    return collected


class CollectedChoice:
    """One choice's events, delivered whole: its text and calls, its content tokens' scores, its
    final event and its first (an echo's prompt and its scores are there)."""

    def __init__(self, delivered: list[TokenEvent]) -> None:
        self.first, self.final = delivered[0], delivered[-1]
        self.text = "".join(e.text for e in delivered)
        self.calls = whole_tool_calls(d for e in delivered for d in e.tool_calls)
        self.scored = [t for e in delivered for t in content_logprobs(e)]

    def body(self, request_id: str, model: str, text_completion: bool, created: int | None = None,
             service_tier: str | None = None) -> dict[str, Any]:
        final = self.final
        return completion_body(request_id, model, (self.first.echo or "") + self.text, final.finish_reason or "stop",
                               final.prompt_tokens or 0, final.completion_tokens or 0,
                               [(c.id, c.name, c.arguments) for c in self.calls], final.cached_tokens or 0,
                               text_completion, self.scored, self.first.prompt_logprobs, created, service_tier)


async def _collect(events: AsyncGenerator[ReplyEvent, None], choices: Choices) -> list[CollectedChoice]:
    """Every choice's events, in index order."""
    delivered: dict[str, list[TokenEvent]] = {request_id: [] for request_id in choices.ids}
    try:
        async for reply in events:
            delivered[reply.event.request_id if choices.several else choices.ids[0]].append(reply.event)
    finally:
        await events.aclose()
    return [CollectedChoice(events_of) for events_of in delivered.values()]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """What ``work`` comes to, for a client that waits for it whole; ``ClientClosed`` (the work
    cancelled) if the client goes first."""
    working = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    done, _ = await asyncio.wait({working, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    disconnected.cancel()
    if working not in done:
        await cancel_task(working)
        raise ClientClosed()
    return working.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
