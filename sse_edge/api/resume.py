"""Resuming a stream: ``GET /v1/chat/completions/{id}/stream`` with ``Last-Event-ID`` (or a
retried POST with the same Idempotency-Key) continues right after the last event the client
got, on any edge process, replayed from the log and then live. A client that reads the plain
data-only stream has no event ids: it says how many chunks it has (``?after_chunks=N``) and gets
the ones after them. Only the tenant that made the request can resume it; anyone else is told it
does not exist."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import Response

from tokenbus.sse_edge.errors import ApiError, InvalidRequest, NotFound, Unavailable
from tokenbus.sse_edge.plumbing.relay import Choices, collect_completion, sse_frames
from tokenbus.sse_edge.plumbing.stream_response import StreamFormat, sse_response
from tokenbus.sse_edge.plumbing.streams import StreamRecord
from tokenbus.sse_edge.protocol.completion_bodies import ChunkWriter
from tokenbus.sse_edge.protocol.service_tiers import openai_name
from tokenbus.sse_edge.state import EdgeState, TurnHooks
from tokenbus.stores.keys import ApiKey
from tokenbus.topics import replay


@dataclass(frozen=True, slots=True)
class LastEvent:
    """Where an SSE client stands: the event at ``offset`` of ``partition``, all of it, or (an
    event written as several chunks, such as a function call's pieces) up to its chunk ``chunk``."""

    partition: int
    offset: int
    chunk: int | None = None

    @property
    def delivered_through(self) -> int:
        """The last offset whose event the client has whole."""
        return self.offset if self.chunk is None else self.offset - 1

    @property
    def chunks_to_skip(self) -> int:
        """Chunks of the first event replayed that the client has."""
        return 0 if self.chunk is None else self.chunk + 1


LAST_EVENT_ID = re.compile(r"(\d+)-(\d+)(?:\.(\d+))?")


def parse_last_event_id(request: Request) -> LastEvent | None:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if not raw:
        return None
    match = LAST_EVENT_ID.fullmatch(raw)
    if match is None:
        raise InvalidRequest("Last-Event-ID must be an event id from this stream, like '3-1042'.",
                             param="Last-Event-ID", code="invalid_last_event_id")
    partition, offset, chunk = match.groups()
    return LastEvent(int(partition), int(offset), int(chunk) if chunk is not None else None)


def not_found(request_id: str) -> NotFound:
    return NotFound(f"No stream `{request_id}` exists for this API key.", param="completion_id",
                    code="stream_not_found")


async def find_stream(edge: EdgeState, request_id: str, tenant: str | None = None,
                      missing: Callable[[str], ApiError] = not_found) -> StreamRecord:
    """The stream record of ``request_id`` (``tenant``'s only, where named; otherwise the
    caller's to check), or the 404 ``missing`` says."""
    try:
        record = await edge.streams.get(request_id)
    except (redis.RedisError, OSError):
        raise Unavailable("Stream lookup is unavailable; retry shortly.", "streams_unavailable") from None
    if record is None or (tenant is not None and record.tenant != tenant):
        raise missing(request_id)
    return record


async def resume_stream(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    record = await find_stream(edge, request.path_params["completion_id"])
    return await relay_existing(request, edge, key, record, parse_last_event_id(request), stream=True)


async def relay_existing(request: Request, edge: EdgeState, key: ApiKey, record: StreamRecord,
                         last_event: LastEvent | None, stream: bool) -> Response:
    """Serve an existing request's stream again from the log, after ``last_event`` if given."""
    if record.tenant != key.tenant:
        raise not_found(record.request_id)
    if last_event is not None and last_event.partition != record.partition:
        raise InvalidRequest("Last-Event-ID does not belong to this stream.", param="Last-Event-ID",
                             code="invalid_last_event_id")
    if record.topic and not await edge.bus.router.log_exists(record.topic):
        raise NotFound(f"The stream `{record.request_id}` is no longer kept and cannot be read again.",
                       param="completion_id", code="stream_expired")
    try:
        await edge.streams.attach(record.request_id)
    except (redis.RedisError, OSError):
        pass
    edge.metrics.resumed.inc()
    # Read after what the client has; a response of several choices from its start, for a usage
    # counted from every choice, what the client has left out as the frames are written.
    delivered_through = last_event.delivered_through if last_event else -1
    replayed_after, written_after = (-1, delivered_through) if record.several_choices else (delivered_through, -1)
    events = replay(edge.settings.bus, record.request_id, record.partition, record.start_offset, topic=record.topic,
                    delivered_through=replayed_after if replayed_after >= 0 else None,
                    idle_timeout=edge.settings.stream_idle_timeout_s, codec=edge.bus.codec, members=record.choices)
    choices = Choices(record.request_id, record.choices, record.choices_per_prompt)
    # Nothing to charge: the edge that admitted the turn does.
    hooks = TurnHooks(edge, record.request_id, choices=choices)
    # As the stream first went (a record from before tiers were kept names none).
    service_tier = openai_name(record.tier, edge.settings.bus.tiers) if record.tier and not record.text_prompt else None
    if stream:
        created_at_ms = record.created_at_ms
        if not created_at_ms and record.request:  # a record written before the request's time was kept
            turn = await edge.turn_request(record)
            created_at_ms = turn.created_at_ms if turn is not None else 0
        created = created_at_ms // 1000 if created_at_ms else None
        writer = ChunkWriter(record.request_id, record.model, record.include_usage, created, text=record.text_prompt,
                             service_tier=service_tier)
        stream_format = StreamFormat.for_request(request, resuming_by_id=last_event is not None,
                                                 skip_in_event=last_event.chunks_to_skip if last_event else 0)
        frames = sse_frames(events, writer, hooks, edge.metrics, time.perf_counter(), stream_format,
                            send_role=last_event is None, choices=choices, delivered_through=written_after)
        return sse_response(frames, edge.settings.heartbeat_s, stream_format)
    return await collect_completion(request, events, record.request_id, record.model, hooks, {},
                                    text_completion=record.text_prompt, choices=choices, service_tier=service_tier)

