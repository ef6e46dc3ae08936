"""Relay a Responses API turn's token events to its client as the Responses API's named SSE events
(protocol/response_objects.py's ``ResponseEvents``). The turn is a chat turn on the bus; what
differs from relay.py's chunks is only how its events are written, and that the response, as it
ended, is handed to ``on_end`` (to be stored) before the client hears that it ended: a client
that sends its next turn at once finds it."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from tokenbus.schemas import TokenEvent
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.relay import RelayHooks, generation_error, stream_error
from tokenbus.sse_edge.plumbing.stream_response import StreamEnd
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


async def response_frames(events: AsyncGenerator[ReplyEvent, None], writer: ResponseEvents, hooks: RelayHooks,
                          metrics: EdgeMetrics, started: float, on_end: ResponseEnded) -> AsyncGenerator[bytes, None]:
    """The frames of one streamed response: ``response.created`` and ``.in_progress`` with the
    first event's (one write, as relay.py writes a chat's role chunk), then each event's pieces,
    then the items' done events and the response's end."""
    finished = False
    pending = writer.started()
    last_sent: float | None = None
    metrics.open_streams.inc()
    try:
        async for reply in events:
            event = reply.event
            out = [pending] if pending else []
            pending = b""
            if event.text:
                out.append(writer.text(event.text, logprobs_of(content_logprobs(event)) if writer.logprobs else None))
            for piece in event.tool_calls:
                out.append(writer.call(piece.index, piece.id, piece.name, piece.arguments))
            if event.text or event.tool_calls:
                now = time.perf_counter()
                (metrics.ttft if last_sent is None else metrics.itl).observe(now - (last_sent or started))
                last_sent = now
            if event.is_final:
                finished = True
                await hooks.on_final(event)
                written, response = ended(writer, event)
                await on_end(response)
                metrics.e2e.observe(time.perf_counter() - started)
                yield StreamEnd(b"".join(out) + written)
                return
            if out:
                yield b"".join(out)
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


def ended(writer: ResponseEvents, final: TokenEvent) -> tuple[bytes, dict[str, Any]]:
    """The events that end a response with its final token event, and the response as it ended."""
    error = generation_error(final)
    status = status_of(final.finish_reason, error is not None)
    usage = usage_of(final.prompt_tokens or 0, final.completion_tokens or 0, final.cached_tokens or 0)
    return writer.ended(status, usage, error.body()["error"] if error is not None else None,
                        INCOMPLETE_BECAUSE.get(final.finish_reason or ""))
