"""Relay a request's token events to its client: as SSE frames, or collected into one
``chat.completion``. The events come from this edge's reply router (a new request) or from
the log (a resumed or re-attached stream).

Two ways to write a stream (:class:`StreamFormat`). By default, as OpenAI writes it: ``data:``
lines and blank lines only, which the simplest client reads (skip blank lines, strip
``data: ``, parse JSON until ``[DONE]``). A client that asks for ``text/event-stream`` in its
``Accept`` header speaks SSE (EventSource, SSE libraries) and also gets each event's ``id:``
(``partition-offset`` in the log, what makes a stream resumable on any edge; ``.k`` added on
the chunks of a token event written as several, such as a function call's pieces, but its
last) and heartbeat comments. Either client can resume: by ``Last-Event-ID``, or by the number of chunks it has.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Coroutine
from dataclasses import dataclass
from types import CoroutineType
from typing import Any, cast

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from tokenbus.schemas import TokenEvent, ToolCall, whole_tool_calls
from tokenbus.sse_edge.errors import ApiError, ClientClosed, InvalidRequest, ServerError, Unavailable
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.protocol.chat import ChunkWriter, completion_body
from tokenbus.topics import STREAM_IDLE, ReplyEvent, ReplyStream, ReplyStreamError
from tokenbus.topics.reply_stream import ROUTER_STOPPED

CLIENT_FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls"}


# A keep-alive for proxies: a comment line and no blank line after it. A blank line ends an event,
# and a client that has seen an ``id:`` keeps it and dispatches the empty event (the openai client
# then fails to parse its data); a lone comment line dispatches nothing in any SSE parser.
HEARTBEAT = b": ping\n"


def heartbeat() -> bytes:
    return HEARTBEAT


@dataclass(frozen=True, slots=True)
class StreamFormat:
    """How one client's stream is written: ``event_ids`` (and heartbeats) for SSE clients, and how
    many leading chunks to leave out because the client resuming already has them."""

    event_ids: bool = False
    skip_chunks: int = 0

    @classmethod
    def for_request(cls, request: Request, resuming_by_id: bool = False, skip_in_event: int = 0) -> StreamFormat:
        accepts_sse = "text/event-stream" in request.headers.get("accept", "").lower()
        return cls(event_ids=accepts_sse or resuming_by_id, skip_chunks=chunks_received(request) + skip_in_event)


def chunks_received(request: Request) -> int:
    raw = request.query_params.get("after_chunks")
    if raw is None:
        return 0
    if not raw.isdigit():
        raise InvalidRequest("after_chunks must be the number of chunks already received, like 12.",
                             param="after_chunks", code="invalid_value")
    return int(raw)


# Where the edge's app (sse_edge/app.py) offers, in the scope, to write a stream's body itself.
DEFERRED_BODY = "tokenbus.deferred_body"


class TokenStreamResponse(EventSourceResponse):
    """sse-starlette's response (its headers, its heartbeat settings) run leaner, because an edge
    holds thousands of these at once. sse-starlette runs each stream as a task group of three or four
    tasks (the frames, the heartbeat, the disconnect listener, the shutdown listener): about half
    the memory of an open stream. Here the frames are written by the request's own task, and one
    watcher task per stream waits for the client to go away (and cancels the writing) and sends
    the heartbeat. No send timeout and no shutdown listener: the edge drains its streams itself
    (sse_edge/server.py), letting them finish and telling the rest to resume elsewhere.

    Where the app offers it (``DEFERRED_BODY`` in the scope), the response sends its start and
    returns, leaving the body to be written once the middleware and routing have returned: they
    act on a response's start only, and would otherwise hold their frames for the whole stream."""

    _client_gone = False  # set by the watcher: a cancellation of the writing task is the client's
    direct: DirectWrites | None = None  # a live stream's events written as they arrive (set by sse_response)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() == "HEAD" or self.send_timeout is not None:
            return await super().__call__(scope, receive, send)
        self.__dict__.pop("_send_lock", None)  # sse-starlette's, for its own writing, unused here (~0.7 KiB)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.raw_headers = []  # sent: not held for the stream's life
        if DEFERRED_BODY in scope:
            scope[DEFERRED_BODY] = self.write_body
        else:
            await self.write_body(receive, send)

    async def write_body(self, receive: Receive, send: Send) -> None:
        """The frames until the stream ends or the client goes away, on the calling task."""
        body = cast(AsyncGenerator[bytes, None], self.body_iterator)
        writing = asyncio.current_task()
        assert writing is not None
        watcher = asyncio.create_task(self._watch(receive, send, writing))
        direct = self.direct
        if direct is not None:
            direct.attach(send)
        try:
            last = b""
            async for chunk in body:
                if isinstance(chunk, StreamEnd):
                    last = chunk  # written with the body's end, once the frames' generator has finished
                    continue
                if direct is not None:
                    await direct.settle()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.active = False
            if direct is not None:
                await direct.settle()
            await send({"type": "http.response.body", "body": last, "more_body": False})
        except asyncio.CancelledError:
            if not self._client_gone:
                raise
            writing.uncancel()  # the client went away: the stream ends here, quietly
        finally:
            self.active = False
            watcher.cancel()
            if direct is not None:
                direct.stop()
            await body.aclose()  # its cleanup runs now, also when a send was interrupted
        if self.background is not None:
            await self.background()

    async def _watch(self, receive: Receive, send: Send, writing: asyncio.Task) -> None:
        """Until the stream ends: a heartbeat every ``ping_interval`` (none at 0), and on the
        client's disconnect, the writing task cancelled."""
        interval = self.ping_interval or None
        heartbeat = self.ping_message_factory() if self.ping_message_factory and interval else b""
        while self.active:
            try:
                async with asyncio.timeout(interval):
                    message = await receive()
            except TimeoutError:
                if self.active:
                    await send({"type": "http.response.body", "body": heartbeat, "more_body": True})
                continue
            if message["type"] == "http.disconnect":
                if self.active:
                    self._client_gone = True
                    writing.cancel()
                return


def sse_response(frames: AsyncGenerator[bytes, None], heartbeat_s: float, stream_format: StreamFormat,
                 headers: dict[str, str] | None = None, direct: DirectWrites | None = None) -> EventSourceResponse:
    """The streaming response: ``frames`` as they come; for SSE clients a heartbeat every ``heartbeat_s``.
    ``direct``: the one ``frames`` was made with, for a live stream."""
    ping = heartbeat_s if stream_format.event_ids else 0  # 0: no heartbeat (a data-only stream has none)
    response = TokenStreamResponse(frames, ping=ping, sep="\n", headers=headers,
                                   ping_message_factory=heartbeat)  # type: ignore[arg-type]  # bytes pass as-is
    response.direct = direct
    return response


class DirectWrites:
    """A live stream's events after its first, written to the client as each arrives, from the reply
    router's callback (``ReplyStream.direct``), rather than by waking the stream's task to pass the
    event through its generators: a wake-up and that passage cost as much Python as the rest of
    relaying an event, and an edge relays one per token of every stream.

    A write runs ``send`` at once and, as uvicorn's does unless the client's socket is full, it
    completes without waiting. One that must wait is finished by a task, and until the stream's
    task has seen it done (``settle``) the events that come meanwhile are queued for that task: so
    the frames go out in order. What ends the stream (the final event, an error) is left to the
    stream's task, which runs the turn's hooks."""

    __slots__ = ("_stream", "_send", "_frames", "_waiting", "_failure")

    def __init__(self, stream: ReplyStream) -> None:
        self._stream = stream
        self._send: Send | None = None
        self._frames: EventFrames | None = None
        self._waiting: asyncio.Future[None] | None = None  # a write that had to wait, finishing
        self._failure: Exception | None = None

    def attach(self, send: Send) -> None:
        """Where the body is written (by the response, when it starts writing)."""
        self._send = send

    def start(self, frames: EventFrames) -> None:
        """Take the stream's events from now on (by its frames' generator, once the first is out)."""
        if self._frames is None and self._send is not None:
            self._frames = frames
            self._stream.direct = self._take

    def stop(self) -> None:
        self._stream.direct = None
        if self._waiting is not None:
            self._waiting.cancel()

    async def settle(self) -> None:
        """Before the stream's task writes: the direct write that had to wait is done (or its error raised)."""
        if self._waiting is not None:
            try:
                await self._waiting
            finally:
                self._waiting = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _take(self, reply: ReplyEvent) -> bool:
        if reply.event.finish_reason is not None or self._waiting is not None or self._failure is not None:
            return False
        assert self._frames is not None and self._send is not None
        try:
            written = self._frames.of(reply)
            if written:
                self._write(self._send({"type": "http.response.body", "body": written, "more_body": True}))
        except Exception as exc:  # raised by the stream's task, where the stream ends (never in the router)
            self._failure = exc
            return False
        return True

    def _write(self, sending: Awaitable[None]) -> None:
        if type(sending) is not CoroutineType:  # an ASGI server's send that is no coroutine function
            self._waiting = asyncio.ensure_future(sending)
            return
        try:
            waits_on = sending.send(None)
        except StopIteration:
            return  # written
        self._waiting = asyncio.ensure_future(_finish(sending, waits_on))


async def _finish(coroutine: Coroutine[Any, Any, None], waits_on: Any) -> None:
    """Run ``coroutine`` on from where it stopped, waiting on ``waits_on`` (a future, or nothing for a
    bare yield), as a task would have run it."""
    while True:
        try:
            if waits_on is None:
                await asyncio.sleep(0)
            else:
                waits_on._asyncio_future_blocking = False  # taken up, as a task takes up what a coroutine yields
                await waits_on
        except BaseException as exc:  # cancelled, or what the future raised: the coroutine's to handle
            try:
                waits_on = coroutine.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waits_on = coroutine.send(None)
        except StopIteration:
            return


class StreamEnd(bytes):
    """A stream's last frames ([DONE], or the error that ends it), which ``TokenStreamResponse``
    writes together with the end of the response body: one socket write, not two."""


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
    if event.finish_reason in CLIENT_FINISH_REASONS:
        return None
    if event.finish_reason == "cancelled" and not event.error:
        # OpenAI's chat completions know no cancelled finish: the stream ends with an error event
        # that says so, not with a server error (the client, or its disconnect, asked for it).
        return ApiError(409, "The generation was cancelled before it finished.", "invalid_request_error",
                        code="generation_cancelled")
    message = event.error or f"generation ended: {event.finish_reason}"
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


class EventFrames:
    """What one stream writes for its token events: each event's chunks as SSE frames (with their ids
    for SSE clients), less the chunks a resuming client has already; the time to the first content
    chunk and between them observed as they go. The stream's task and its direct writes share it."""

    __slots__ = ("writer", "metrics", "started", "ids", "skip", "last_sent")

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
            now = time.perf_counter()
            if self.last_sent is None:
                self.metrics.ttft.observe(now - self.started)
            else:
                self.metrics.itl.observe(now - self.last_sent)
            self.last_sent = now
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
) -> AsyncGenerator[bytes, None]:
    """The frames of one stream. Chunk for chunk the same live and replayed (the role chunk, one per
    event with text or the final one, the usage chunk), which is what lets a client resume by count.

    Each yield is what one socket write carries: a token event's chunks together, the role chunk
    with the first event's (as vLLM's server and OpenAI's send it: when the first token is there),
    and the usage chunk with ``[DONE]`` as the ``StreamEnd``. On a loopback or a busy host a write
    costs as much as the rest of relaying an event, and a turn of a few tokens made six of them.

    With ``direct`` (a live stream), the events after the first are written as they arrive, by
    ``direct``, until one ends the stream; they come here only when the client's socket is full."""
    finished = False
    frames = EventFrames(writer, metrics, started, stream_format)
    pending: list[bytes] = []  # frames not yet written: they go with the next ones
    metrics.open_streams.inc()
    try:
        if send_role:
            pending.append(frames.role())
        async for reply in events:
            event = reply.event
            error = generation_error(event) if event.is_final else None
            if error is not None:
                finished = True
                pending.append(frame(error.body(), reply.event_id if frames.ids else None))
                yield StreamEnd(b"".join(pending))
                return
            pending.append(frames.of(reply))
            written = b"".join(pending)
            pending = []
            if written:
                yield written
            if event.is_final:
                finished = True
                await hooks.on_final(event)
                if writer.include_usage and not frames.skip:
                    pending.append(frame(writer.usage(event.prompt_tokens or 0, event.completion_tokens or 0,
                                                      event.cached_tokens or 0)))
            elif direct is not None:
                direct.start(frames)  # the first event is out (and the stream registered): the rest may go direct
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
    """The chunks one token event becomes: its text with the finish reason, as one chunk; where
    the event holds function calls, its text, a chunk per piece of a call, and the finish."""
    if not event.tool_calls:
        return [writer.delta(event.text, event.finish_reason)] if event.text or event.is_final else []
    chunks = [writer.delta(event.text, None)] if event.text else []
    chunks += [writer.tool_call(d.index, d.id, d.name, d.arguments) for d in event.tool_calls]
    if event.is_final:
        chunks.append(writer.delta("", event.finish_reason))
    return chunks


async def collect_completion(
    request: Request, events: AsyncGenerator[ReplyEvent, None], request_id: str, model: str, hooks: RelayHooks,
    headers: dict[str, str],
) -> JSONResponse:
    """Wait for the whole completion; a client that disconnects first abandons it."""
    collecting = asyncio.ensure_future(_collect(events))
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    done, _ = await asyncio.wait({collecting, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    disconnected.cancel()
    if collecting not in done:
        collecting.cancel()
        hooks.on_abandoned()
        raise ClientClosed()
    try:
        text, calls, final = collecting.result()
    except ReplyStreamError as exc:
        if exc.code == STREAM_IDLE:
            hooks.on_stalled()
        raise stream_error(exc) from None
    await hooks.on_final(final)
    error = generation_error(final)
    if error is not None:
        raise error
    body = completion_body(request_id, model, text, final.finish_reason or "stop", final.prompt_tokens or 0,
                           final.completion_tokens or 0, [(c.id, c.name, c.arguments) for c in calls],
                           final.cached_tokens or 0)
    return JSONResponse(body, headers=headers)


async def _collect(events: AsyncGenerator[ReplyEvent, None]) -> tuple[str, list[ToolCall], TokenEvent]:
    delivered: list[TokenEvent] = []
    try:
        async for reply in events:
            delivered.append(reply.event)
    finally:
        await events.aclose()
    text = "".join(e.text for e in delivered)
    return text, whole_tool_calls(d for e in delivered for d in e.tool_calls), delivered[-1]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
