"""A stored response's stream read again from the log (its token events, then live), as the
Responses API's events: by its client (``GET ...?stream=true``, resumed after an event, or a
request repeated with its Idempotency-Key), or by an edge reading on a turn whose reader went
(``read_on``: its client left, or its edge stopped), so that whoever reads it to the end stores
it as it ended."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import redis.asyncio as redis
from starlette.requests import Request
from starlette.responses import Response

from tokenbus.sse_edge.api.chat import REQUEST_ID_HEADER
from tokenbus.sse_edge.api.resume import find_stream
from tokenbus.sse_edge.errors import ApiError, Conflict, NotFound, ServerError, Unavailable
from tokenbus.sse_edge.plumbing.kept_responses import KeptResponse
from tokenbus.sse_edge.plumbing.relay import unless_disconnected
from tokenbus.sse_edge.plumbing.response_readers import ReaderLease, read_to_the_end, served_frames
from tokenbus.sse_edge.plumbing.response_relay import response_frames
from tokenbus.sse_edge.plumbing.stream_response import StreamEnd, StreamFormat, sse_response
from tokenbus.sse_edge.protocol.response_objects import ResponseEvents, ended_as
from tokenbus.sse_edge.state import EdgeState, TurnHooks
from tokenbus.stores.keys import ApiKey
from tokenbus.stores.responses import StoredResponse
from tokenbus.topics import replay

# The Responses API's clients read SSE: its heartbeat comments are theirs too.
EVENT_STREAM = StreamFormat(event_ids=True)


async def nothing_kept(response: dict[str, Any]) -> None:
    """A response not stored (``store: false``) ends with nothing to keep."""


def handing_over(edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any],
                 logprobs: bool) -> Callable[[], None]:
    """What a client's reading of a stored response under way does when it stops before the end:
    this edge reads it on from the log (unless it is stopping: another edge will, when asked)."""
    def hand_over() -> None:
        if not edge.draining:
            edge.in_background(read_on(edge, key, response_id, response, logprobs))
    return hand_over


async def read_on(edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any], logprobs: bool) -> None:
    """A stored response under way that no reader holds (its client went, or its edge stopped):
    read its stream from the log to the end, here, and store it."""
    lease = ReaderLease(edge.responses, response_id, edge.settings.reader_lease_s)
    if not await lease.claim():
        return
    try:
        frames = await frames_from_log(edge, key, response_id, response, logprobs, -1, by_client=False)
    except ApiError:  # its stream cannot be found now: the response is answered as stored
        frames = None
    if frames is None:
        await lease.release()
        return
    await read_to_the_end(lease, frames)


def read_on_if_unread(edge: EdgeState, key: ApiKey, stored: StoredResponse) -> None:
    """A stored response found under way is read on here, where no reader holds it."""
    response = json.loads(stored.body)
    if response["status"] == "in_progress":
        edge.in_background(read_on(edge, key, stored.id, response, scores_asked(stored)))


async def answered_before(request: Request, edge: EdgeState, key: ApiKey, response_id: str,
                          stream: bool) -> Response:
    """The response an earlier request with this Idempotency-Key made, as this request asks for it:
    whole (once it has ended), or its stream, read again."""
    stored = await stored_response(edge, key, response_id)
    if stored is None:
        raise Conflict(f"The response bound to this Idempotency-Key, {response_id}, was not stored (store: false), "
                       "or is still starting; retry shortly.", param="Idempotency-Key", code="idempotency_key_in_use")
    response = json.loads(stored.body)
    if not stream:
        if response["status"] == "in_progress":
            stored = await waited_for(request, edge, key, stored)
        return Response(stored.body, media_type="application/json", headers={REQUEST_ID_HEADER: response_id})
    return await stream_again(request, edge, key, response_id, response, scores_asked(stored), -1)


async def waited_for(request: Request, edge: EdgeState, key: ApiKey, stored: StoredResponse) -> StoredResponse:
    """A stored response under way, once it has ended: its stream read from the log to the end by
    this client (a turn whose client went is not cancelled while one reads it), then read back."""
    response = json.loads(stored.body)
    frames = await frames_from_log(edge, key, stored.id, response, scores_asked(stored), -1)
    if frames is None:
        raise NotFound(f"The stream of '{stored.id}' is no longer kept and cannot be read again.",
                       param="response_id", code="stream_expired")
    await unless_disconnected(request, read_through(frames))
    ended = await stored_response(edge, key, stored.id)
    if ended is None or json.loads(ended.body)["status"] == "in_progress":
        raise ServerError(f"The response {stored.id} ended, but could not be stored; retrieve it later.")
    return ended


async def read_through(frames: AsyncGenerator[bytes, None]) -> None:
    async for _ in frames:
        pass


async def stream_again(request: Request, edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any],
                       logprobs: bool, starting_after: int) -> Response:
    """A response's stream again, after the event ``starting_after`` (OpenAI's resumption): read
    from the log while it holds the stream, and then live, numbered as it went out live; whoever
    reads it to the end stores the response ended, if it is not yet. Once the log no longer holds
    it, an ended response's stream is made from the stored response, each item in one piece."""
    headers = {REQUEST_ID_HEADER: response_id}
    frames = await frames_from_log(edge, key, response_id, response, logprobs, starting_after)
    if frames is not None:
        return sse_response(frames, edge.settings.heartbeat_s, EVENT_STREAM, headers)
    if response["status"] == "in_progress":
        raise NotFound(f"The stream of '{response_id}' is no longer kept and cannot be read again.",
                       param="response_id", code="stream_expired")
    writer = ResponseEvents(skeleton_of(response), logprobs, starting_after, response.get("completed_at"))
    return sse_response(one_frame(writer.replayed(response)), edge.settings.heartbeat_s, EVENT_STREAM, headers)


async def frames_from_log(edge: EdgeState, key: ApiKey, response_id: str, response: dict[str, Any], logprobs: bool,
                          starting_after: int, by_client: bool = True) -> AsyncGenerator[bytes, None] | None:
    """A response's events after ``starting_after``, made from its token events as the log holds
    them (then live), storing the response ended if it is not yet; None once the log has let go.
    Read ``by_client`` (resumed), a turn is no longer abandoned, and is again if the client goes
    (and the reading handed over); read by an edge (``read_on``), it is neither."""
    record = await find_stream(edge, response_id, key.tenant, response_not_found)
    if record.topic and not await edge.bus.router.log_exists(record.topic):
        return None
    stored = await stored_response(edge, key, response_id)
    kept = KeptResponse.of_stored(edge.responses, stored, edge.settings.history_turns,
                                  edge.conversations) if stored else None
    if by_client:
        with contextlib.suppress(redis.RedisError, OSError):
            await edge.streams.attach(response_id)  # a client that went away is back: not cancelled
    events = replay(edge.settings.bus, response_id, record.partition, record.start_offset, topic=record.topic,
                    idle_timeout=edge.settings.stream_idle_timeout_s, codec=edge.bus.codec)
    hooks = TurnHooks(edge, response_id, background=not by_client or bool(response.get("background")))
    writer = ResponseEvents(skeleton_of(response), logprobs, starting_after, response.get("completed_at"))
    frames = response_frames(events, writer, hooks, edge.metrics, time.perf_counter(),
                             kept.ended if kept is not None else nothing_kept)
    if by_client and kept is not None:
        frames = served_frames(frames, kept, handing_over(edge, key, response_id, response, logprobs))
    return frames


def skeleton_of(response: dict[str, Any]) -> dict[str, Any]:
    """A response as it was when it began: what its stream's first events show."""
    return ended_as(response, "in_progress", [], None)


def scores_asked(stored: StoredResponse) -> bool:
    return bool(json.loads(stored.context).get("logprobs"))


async def one_frame(written: bytes) -> AsyncGenerator[bytes, None]:
    yield StreamEnd(written)


async def stored_response(edge: EdgeState, key: ApiKey, response_id: str) -> StoredResponse | None:
    try:
        return await edge.responses.get(key.tenant, response_id)
    except (redis.RedisError, OSError):
        raise Unavailable("Stored responses are unavailable right now; retry shortly.",
                          "responses_unavailable") from None


def response_not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found")
