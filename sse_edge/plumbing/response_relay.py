"""Relay a Responses API turn's token events to its client as the Responses API's named SSE events
(protocol/response_objects.py's ``ResponseEvents``). The turn is a chat turn on the bus; what
differs from relay.py's chunks is only how its events are written, and that the response, as it
ended, is handed to ``on_end`` (to be stored) before the client hears that it ended: a client
that sends its next turn at once finds it."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tokenbus.schemas import TokenEvent
from tokenbus.sse_edge.errors import ApiError, InvalidRequest
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.relay import RelayHooks, generation_error, stream_error
from tokenbus.sse_edge.plumbing.stream_response import DirectWrites, StreamEnd
from tokenbus.sse_edge.protocol.logprobs import content_logprobs
from tokenbus.sse_edge.protocol.response_objects import (
    INCOMPLETE_BECAUSE,
    ResponseEvents,
    logprobs_of,
    status_of,
    usage_of,
)
from tokenbus.topics import STREAM_IDLE, ReplyEvent, ReplyStreamError

ResponseEnded = Callable[[dict[str, Any]], Awaitable[None]]


class EventWrites:
    """What one stream writes for a token event that ends nothing: its text and calls as the
    Responses API's events, the time to the first and between them observed as they go. The
    stream's task and its direct writes share it."""

    __slots__ = ("writer", "metrics", "started", "last_sent")

    def __init__(self, writer: ResponseEvents, metrics: EdgeMetrics, started: float) -> None:
        self.writer = writer
        self.metrics = metrics
        self.started = started
        self.last_sent: float | None = None

    def of(self, reply: ReplyEvent) -> bytes:
        event, writer = reply.event, self.writer
        if not (event.text or event.tool_calls):
            return b""
        out = writer.text(event.text, logprobs_of(content_logprobs(event)) if writer.logprobs else None) \
            if event.text else b""
        for piece in event.tool_calls:
            out += writer.call(piece.index, piece.id, piece.name, piece.arguments)
        self.last_sent = self.metrics.content_sent(self.started, self.last_sent)
        return out


async def response_frames(events: AsyncGenerator[ReplyEvent, None], writer: ResponseEvents, hooks: RelayHooks,
                          metrics: EdgeMetrics, started: float, on_end: ResponseEnded,
                          direct: DirectWrites | None = None) -> AsyncGenerator[bytes, None]:
    """The frames of one streamed response: ``response.created`` and ``.in_progress`` with the
    first event's (one write, as relay.py writes a chat's role chunk), then each event's pieces,
    then the items' done events and the response's end. With ``direct`` (a live stream), the
    events after the first are written as they arrive, as relay.py's are, until one ends it."""
    finished = False
    pending = writer.started()
    writes = EventWrites(writer, metrics, started)
    metrics.open_streams.inc()
    try:
        async for reply in events:
            out = pending + writes.of(reply)
            pending = b""
            if reply.event.is_final:
                finished = True
                await hooks.on_final(reply.event)
                written, response = ended(writer, reply.event)
                await on_end(response)
                metrics.e2e.observe(time.perf_counter() - started)
                yield StreamEnd(out + written)
                return
            if out:
                yield out
            if direct is not None:
                direct.start(writes.of)  # the first event is out (and the stream registered): the rest may go direct
    except ReplyStreamError as exc:
        finished = True
        if exc.code == STREAM_IDLE:
            hooks.on_stalled()
        yield StreamEnd(pending + writer.error(stream_error(exc).body()["error"]))
    finally:
        metrics.open_streams.dec()
        await events.aclose()
        if not finished:
            hooks.on_abandoned()


@dataclass(frozen=True, slots=True)
class Ending:
    """How a response ends, read off its final token event: its status, usage, the error that
    ended it (``failure``, as the HTTP error a whole answer raises) and why it is incomplete."""

    status: str
    usage: dict[str, Any]
    failure: ApiError | None
    incomplete_reason: str | None

    @classmethod
    def of(cls, final: TokenEvent) -> Ending:
        failure = generation_error(final)
        return cls(status_of(final.finish_reason, failure is not None),
                   usage_of(final.prompt_tokens or 0, final.completion_tokens or 0, final.cached_tokens or 0),
                   failure, INCOMPLETE_BECAUSE.get(final.finish_reason or ""))

    @property
    def error(self) -> dict[str, Any] | None:
        """The response's ``error``, as OpenAI's are: one of its codes (clients that type them know
        no others: the edge's own code is the HTTP error's, ``failure``) and the message. None for
        a cancelled response, as OpenAI's: its status says it."""
        if self.failure is None or self.status == "cancelled":
            return None
        return {"code": "invalid_prompt" if isinstance(self.failure, InvalidRequest) else "server_error",
                "message": self.failure.message}


def ended(writer: ResponseEvents, final: TokenEvent) -> tuple[bytes, dict[str, Any]]:
    """The events that end a response with its final token event, and the response as it ended."""
    ending = Ending.of(final)
    return writer.ended(ending.status, ending.usage, ending.error, ending.incomplete_reason)
