"""The edge's keep-alive during a long gap in an SSE client's stream: an SSE parser (the official
openai client's among them) must read the stream as if there were none. A heartbeat ending in a
blank line would dispatch an empty event, and because such a client keeps the last ``id:`` it has
seen, it would then fail to parse that event's (empty) data mid-stream. A data-only stream (the
default) has no heartbeat at all: it is not a ``data:`` line. And how the streaming response ends
when the client goes away."""

from __future__ import annotations

import asyncio
import json

from openai._streaming import SSEDecoder

from tokenbus.sse_edge.plumbing.relay import frame
from tokenbus.sse_edge.plumbing.stream_response import HEARTBEAT, StreamFormat, sse_response


def decoded(raw: bytes) -> list[str]:
    return [event.data for event in SSEDecoder().iter_bytes(iter([raw]))]


def test_a_blank_line_after_a_comment_would_dispatch_an_empty_event():
    # The failure this guards against, shown with the openai client's own decoder.
    raw = frame({"n": 1}, "0-1") + b": ping\n\n" + frame({"n": 2}, "0-2")
    assert decoded(raw) == ['{"n":1}', "", '{"n":2}']


def test_the_heartbeat_between_events_dispatches_nothing():
    raw = frame({"n": 1}, "0-1") + HEARTBEAT + HEARTBEAT + frame({"n": 2}, "0-2") + frame("[DONE]")
    assert decoded(raw) == ['{"n":1}', '{"n":2}', "[DONE]"]


def http_scope() -> dict:
    return {"type": "http", "method": "POST", "asgi": {"spec_version": "2.4"}, "headers": []}


async def served(stream_format: StreamFormat) -> bytes:
    async def frames():
        yield frame({"n": 1}, "0-1" if stream_format.event_ids else None)
        await asyncio.sleep(0.35)  # several heartbeat intervals with nothing to send
        yield frame({"n": 2}, "0-2" if stream_format.event_ids else None)
        yield frame("[DONE]")

    sent: list[bytes] = []
    finished = asyncio.Event()

    async def receive() -> dict:
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    response = sse_response(frames(), 0.1, stream_format)
    await asyncio.wait_for(response(http_scope(), receive, send), 5)
    return b"".join(sent)


async def test_a_stream_with_a_long_gap_sends_heartbeats_the_client_reads_through():
    body = await served(StreamFormat(event_ids=True))
    assert HEARTBEAT in body  # the gap was bridged by heartbeats
    assert [json.loads(d) if d != "[DONE]" else d for d in decoded(body)] == [{"n": 1}, {"n": 2}, "[DONE]"]


async def test_a_data_only_stream_has_no_heartbeat():
    body = await served(StreamFormat())
    assert body == b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'


async def test_a_client_that_goes_away_ends_the_stream_and_its_cleanup_runs():
    """The disconnect cancels the frames' wait (no further frame is written) and the response
    returns quietly; the generator's cleanup (where the edge cancels an abandoned generation) runs."""
    cleaned_up = asyncio.Event()
    waiting = asyncio.Event()

    async def frames():
        try:
            yield frame({"n": 1})
            waiting.set()
            await asyncio.sleep(30)  # a token that never comes
            yield frame({"n": 2})
        finally:
            cleaned_up.set()

    sent: list[bytes] = []

    async def receive() -> dict:
        await waiting.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    response = sse_response(frames(), 15, StreamFormat(event_ids=True))
    await asyncio.wait_for(response(http_scope(), receive, send), 5)
    assert cleaned_up.is_set()
    assert sent == [b'data: {"n":1}\n\n']


async def test_a_server_cancelling_the_stream_is_not_taken_for_a_disconnect():
    """A cancellation that is not the client's (the server stopping) still propagates."""
    async def frames():
        yield frame({"n": 1})
        await asyncio.sleep(30)

    async def receive() -> dict:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    response = sse_response(frames(), 0, StreamFormat())
    task = asyncio.create_task(response(http_scope(), receive, send))
    await asyncio.sleep(0.05)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert task.cancelled()


async def test_a_streams_body_is_written_after_the_middleware_has_returned():
    """The edge's app writes a token stream's body once the middleware and routing have returned,
    so that their frames are not held for the stream's life: the middleware sees the response
    start, the body goes to the server afterwards, every frame of it."""
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from tokenbus.sse_edge.app import EdgeApp

    inside = [False]
    seen_by_middleware: list[str] = []

    class Watching:
        def __init__(self, app) -> None:
            self.app = app

        async def __call__(self, scope, receive, send) -> None:
            async def watched(message: dict) -> None:
                seen_by_middleware.append(message["type"])
                await send(message)

            inside[0] = True
            try:
                await self.app(scope, receive, watched)
            finally:
                inside[0] = False

    async def frames():
        yield frame({"n": 1})
        yield frame("[DONE]")

    async def endpoint(request):
        return sse_response(frames(), 0, StreamFormat())

    app = EdgeApp(routes=[Route("/stream", endpoint, methods=["POST"])], middleware=[Middleware(Watching)])
    at_server: list[tuple[dict, bool]] = []
    finished = asyncio.Event()

    async def receive() -> dict:
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        at_server.append((message, inside[0]))
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    scope = {**http_scope(), "path": "/stream", "raw_path": b"/stream", "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000)}
    await asyncio.wait_for(app(scope, receive, send), 5)
    assert seen_by_middleware == ["http.response.start"]
    (start, start_inside), *body = at_server
    assert start["type"] == "http.response.start" and start["status"] == 200 and start_inside
    assert not any(was_inside for _, was_inside in body)
    assert b"".join(m.get("body", b"") for m, _ in body) == b'data: {"n":1}\n\ndata: [DONE]\n\n'
