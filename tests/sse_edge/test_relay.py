"""Relaying releases what it holds when a client leaves early: the event source (a replay
holds a Kafka consumer) and the request's entry in the reply router."""

from types import SimpleNamespace

from tokenbus.schemas import TokenEvent
from tokenbus.sse_edge.api.chat import live_events
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.relay import RelayHooks, sse_frames
from tokenbus.sse_edge.protocol.chat import ChunkWriter
from tokenbus.topics import BusSettings, ReplyEvent, ReplyRouter


async def test_a_client_leaving_closes_the_event_source_and_reports_abandonment():
    closed, abandoned = [], []

    async def events():
        try:
            for seq in range(100):
                yield ReplyEvent(TokenEvent("r", seq, f"t{seq}"), 0, seq)
        finally:
            closed.append(True)

    async def on_final(event):
        raise AssertionError("the stream never finished")

    frames = sse_frames(events(), ChunkWriter("r", "m", False), RelayHooks(on_final, lambda: abandoned.append(1)),
                        EdgeMetrics(), started=0.0)
    assert b"assistant" in await anext(frames)
    assert b'"t0"' in await anext(frames)
    await frames.aclose()  # what the server does when the client disconnects
    assert closed == [True] and abandoned == [1]


async def test_a_closed_live_stream_leaves_the_router():
    router = ReplyRouter(BusSettings(), partitions=[0])
    stream = router.open("r")
    stream.offer(ReplyEvent(TokenEvent("r", 0, "first"), 0, 10))
    edge = SimpleNamespace(settings=SimpleNamespace(stream_idle_timeout_s=5), bus=SimpleNamespace(router=router))
    events = live_events(edge, stream)
    assert (await anext(events)).event.text == "first"
    assert router.open_streams == 1
    await events.aclose()
    assert router.open_streams == 0
