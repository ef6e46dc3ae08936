"""``POST /v1/chat/completions/{id}/continue``: finish a turn whose stream ended incomplete (its
GPU consumer was lost with no one to take over, it was cancelled, it failed).

The continuation is a new request (its own id, stream and bill) that repeats the turn's request
and generates after everything the turn delivered, as a GPU consumer taking a request over does:
with the same seed, the text is what the uninterrupted turn would have written. Its client gets
the new text; the transcript stores the turn again, under the turn's own id and time, as one
completed reply; billing charges the continuation only for what it generated.
"""

from __future__ import annotations

import dataclasses
import time

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import Response

from tokenbus.producers import new_request_id
from tokenbus.schemas import INCOMPLETE_FINISH_REASONS, ChatRequest, TokenEvent, now_ms
from tokenbus.sse_edge.api.chat import serve
from tokenbus.sse_edge.api.resume import find_stream
from tokenbus.sse_edge.errors import ApiError, Conflict, InvalidRequest, NotFound, Unavailable
from tokenbus.sse_edge.plumbing.streams import StreamRecord
from tokenbus.sse_edge.protocol.chat import ContinueRequest
from tokenbus.sse_edge.protocol.validation import json_object, parse_body, read_body
from tokenbus.sse_edge.state import EdgeState

READ_IDLE_S = 2.0  # the turn's stream is read from the log; a live one would keep it waiting


async def continue_turn(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    started = time.perf_counter()
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    options = parse_options(await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s))
    request_id = request.path_params["completion_id"]
    record = await find_stream(edge, request_id, key.tenant)
    if record.several_choices:
        raise InvalidRequest(f"`{request_id}` has several choices: only a response of one can be continued.",
                             param="completion_id", code="several_choices")
    delivered = await turn_events(edge, record)
    turn = await edge.turn_request(record)
    if turn is None:
        raise NotFound(f"The request of `{request_id}` is no longer kept and cannot be continued.",
                       param="completion_id", code="stream_expired")
    continuation = continuation_of(turn, delivered, edge)
    try:
        earlier = await edge.streams.claim_continuation(request_id, continuation.request_id)
    except (redis.RedisError, OSError):
        raise Unavailable("Continuing is unavailable right now; retry shortly.", "streams_unavailable") from None
    if earlier is not None:
        raise Conflict(f"`{request_id}` was continued already by `{earlier}`; resume that stream.",
                       code="turn_continued")
    try:
        return await serve(request, edge, key, [continuation], options.stream, options.include_usage, "", started)
    except ApiError:
        await edge.streams.release_continuation(request_id, continuation.request_id)
        raise


def parse_options(raw: bytes) -> ContinueRequest:
    return parse_body(json_object(raw, empty_ok=True), ContinueRequest)


async def turn_events(edge: EdgeState, record: StreamRecord) -> list[TokenEvent]:
    """The turn's whole stream, which must have ended incomplete."""
    events, ended = await edge.read_stream(record, READ_IDLE_S)
    if not ended:
        raise Conflict(f"`{record.request_id}` is still being generated; resume its stream instead.",
                       code="turn_in_progress")
    final = events[-1]
    if final.finish_reason not in INCOMPLETE_FINISH_REASONS:
        raise Conflict(f"`{record.request_id}` finished ({final.finish_reason}): nothing to continue.",
                       code="turn_complete")
    return events


def continuation_of(turn: ChatRequest, delivered: list[TokenEvent], edge: EdgeState) -> ChatRequest:
    """The turn's request again, generating after what it delivered (and what it continued)."""
    return dataclasses.replace(
        turn,
        request_id=new_request_id(),
        reply_topic=edge.bus.router.reply_topic,
        reply_partition=edge.bus.router.reply_partition,
        created_at_ms=now_ms(),
        deadline_ms=None,
        continues_request_id=turn.continues_request_id or turn.request_id,
        continues_turn_at_ms=turn.continues_turn_at_ms or turn.created_at_ms,
        prefix_token_ids=[*turn.prefix_token_ids, *(t for e in delivered for t in e.token_ids)],
        prefix_text=turn.prefix_text + "".join(e.text if e.raw_text is None else e.raw_text for e in delivered),
    )
