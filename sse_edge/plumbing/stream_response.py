"""How a stream's frames reach the client: the streaming response (``TokenStreamResponse``), its
heartbeat, and for a live stream the events written as they arrive (``DirectWrites``). The frames
themselves are made by the relay (relay.py).

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
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import CoroutineType
from typing import Any, cast

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.topics import ReplyEvent, ReplyStream

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
        self._frames: Callable[[ReplyEvent], bytes] | None = None  # what an event is written as
        self._waiting: asyncio.Future[None] | None = None  # a write that had to wait, finishing
        self._failure: Exception | None = None

    def attach(self, send: Send) -> None:
        """Where the body is written (by the response, when it starts writing)."""
        self._send = send

    def start(self, frames: Callable[[ReplyEvent], bytes]) -> None:
        """Take the stream's events from now on, written as ``frames`` makes them (by the stream's
        frames' generator, once the first is out)."""
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
            written = self._frames(reply)
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
