"""The edge's keep-alive during a long gap in a stream: the official openai client must read
the stream as if there were none. A heartbeat ending in a blank line would dispatch an empty
event, and because the client keeps the last ``id:`` it has seen, it would then fail to parse
that event's (empty) data mid-stream."""

from __future__ import annotations

import asyncio
import json

from openai._streaming import SSEDecoder

from tokenbus.sse_edge.plumbing.relay import HEARTBEAT, frame, sse_response


def decoded(raw: bytes) -> list[str]:
    return [event.data for event in SSEDecoder().iter_bytes(iter([raw]))]


def test_a_blank_line_after_a_comment_would_dispatch_an_empty_event():
    # The failure this guards against, shown with the openai client's own decoder.
    raw = frame({"n": 1}, "0-1") + b": ping\n\n" + frame({"n": 2}, "0-2")
    assert decoded(raw) == ['{"n":1}', "", '{"n":2}']


def test_the_heartbeat_between_events_dispatches_nothing():
    raw = frame({"n": 1}, "0-1") + HEARTBEAT + HEARTBEAT + frame({"n": 2}, "0-2") + frame("[DONE]")
    assert decoded(raw) == ['{"n":1}', '{"n":2}', "[DONE]"]


async def test_a_stream_with_a_long_gap_sends_heartbeats_the_client_reads_through():
    async def frames():
        yield frame({"n": 1}, "0-1")
        await asyncio.sleep(0.35)  # several heartbeat intervals with nothing to send
        yield frame({"n": 2}, "0-2")
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

    response = sse_response(frames(), heartbeat_s=0.1)
    scope = {"type": "http", "method": "GET", "asgi": {"spec_version": "2.4"}, "headers": []}
    await asyncio.wait_for(response(scope, receive, send), 5)
    body = b"".join(sent)
    assert HEARTBEAT in body  # the gap was bridged by heartbeats
    assert [json.loads(d) if d != "[DONE]" else d for d in decoded(body)] == [{"n": 1}, {"n": 2}, "[DONE]"]
