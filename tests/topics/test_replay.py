"""Replay of one request's token stream from the log (resuming on another edge), on both brokers:
from where the stream starts, and after what a client already has (its Last-Event-ID)."""

from __future__ import annotations

from tokenbus.schemas import AvroCodec, TokenEvent
from tokenbus.topics import TopicCatalog, make_producer, record_at, replay

PARTITION = 5


async def publish_interleaved(bus, request_id: str, other_id: str, count: int) -> list[int]:
    """``count`` events of ``request_id`` (the last final), each after one of ``other_id``, and
    one of them twice (at-least-once delivery); returns the offsets of ``request_id``'s events."""
    codec, topic = AvroCodec(), TopicCatalog(bus).tokens
    producer = make_producer(bus)
    await producer.start()
    offsets = []
    try:
        for seq in range(count):
            final = "stop" if seq == count - 1 else None
            other = TokenEvent(other_id, seq, f"x{seq}")
            await producer.send_and_wait(topic, codec.encode(other), key=other_id.encode(), partition=PARTITION)
            mine = TokenEvent(request_id, seq, f"t{seq} ", finish_reason=final, completion_tokens=count if final else None)
            sent = await producer.send_and_wait(topic, codec.encode(mine), key=request_id.encode(), partition=PARTITION)
            offsets.append(sent.offset)
            if seq == 2:  # a retried send: the same event again
                await producer.send_and_wait(topic, codec.encode(mine), key=request_id.encode(), partition=PARTITION)
    finally:
        await producer.stop()
    return offsets


async def test_replay_from_the_start_and_after_the_last_delivered_event(each_bus):
    offsets = await publish_interleaved(each_bus, "replayed", "bystander", 6)

    whole = [r async for r in replay(each_bus, "replayed", PARTITION, offsets[0], idle_timeout=20)]
    assert [r.event.seq for r in whole] == list(range(6))
    assert "".join(r.event.text for r in whole) == "t0 t1 t2 t3 t4 t5 "
    assert [r.offset for r in whole] == offsets

    rest = [r async for r in replay(each_bus, "replayed", PARTITION, offsets[0], delivered_through=offsets[3],
                                    idle_timeout=20)]
    assert [r.event.seq for r in rest] == [4, 5]

    done = [r async for r in replay(each_bus, "replayed", PARTITION, offsets[0], delivered_through=offsets[5],
                                    idle_timeout=20)]
    assert done == []  # the final event was delivered already: nothing more


async def test_one_record_is_read_back_at_its_place(each_bus):
    offsets = await publish_interleaved(each_bus, "placed", "neighbour", 3)
    topic = TopicCatalog(each_bus).tokens
    codec = AvroCodec()
    middle = await record_at(each_bus, topic, PARTITION, offsets[1])
    assert middle is not None
    event = codec.decode(middle, TokenEvent)
    assert (event.request_id, event.seq, event.text) == ("placed", 1, "t1 ")
    assert await record_at(each_bus, topic, PARTITION, offsets[-1] + 10, timeout_s=1.0) is None  # nothing there


async def publish_events(bus, events: list[TokenEvent]) -> list[int]:
    """``events`` in this order on the test partition; their offsets."""
    codec, topic = AvroCodec(), TopicCatalog(bus).tokens
    producer = make_producer(bus)
    await producer.start()
    try:
        return [(await producer.send_and_wait(topic, codec.encode(e), key=e.request_id.encode(),
                                              partition=PARTITION)).offset for e in events]
    finally:
        await producer.stop()


async def test_several_requests_replay_as_one_stream_in_log_order_each_exactly_once(each_bus):
    """A response's choices (reply_group.py): each member's repeats dropped, its order kept, the
    members' events in the order of the log, ending once every member has; a Last-Event-ID ends
    a member delivered whole before it."""
    a, b = "choices-0", "choices-1"
    log = [TokenEvent(a, 0, "a0"), TokenEvent(b, 0, "b0"), TokenEvent("bystander", 0, "x"),
           TokenEvent(a, 1, "a1", finish_reason="stop"), TokenEvent(b, 0, "b0"),  # b0 again: at-least-once
           TokenEvent(b, 1, "b1"), TokenEvent(b, 2, "b2", finish_reason="length")]
    offsets = await publish_events(each_bus, log)

    group = [r async for r in replay(each_bus, "choices", PARTITION, offsets[0], idle_timeout=20, members=[a, b])]
    assert [r.event.text for r in group] == ["a0", "b0", "a1", "b1", "b2"]
    assert [r.offset for r in group] == [offsets[i] for i in (0, 1, 3, 5, 6)]

    rest = [r async for r in replay(each_bus, "choices", PARTITION, offsets[0], idle_timeout=20, members=[a, b],
                                    delivered_through=offsets[3])]
    assert [r.event.text for r in rest] == ["b1", "b2"]  # a ended before: the group waits for b alone
