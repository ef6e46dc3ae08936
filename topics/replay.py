"""Read one request's token stream back from the log, from any process: resuming a stream
on another edge, or attaching to it again from the start. Replay continues into the live
tail until the final event, in seq order and without duplicates. ``record_at`` reads the one
record at a known place (a published request, which a stream record names)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence

from aiokafka import TopicPartition

from tokenbus.schemas import AvroCodec, DecodeError, TokenEvent
from tokenbus.topics.catalog import TopicCatalog
from tokenbus.topics.clients import make_consumer, stop_reader
from tokenbus.topics.framing import make_codec
from tokenbus.topics.reply_group import ReplyGroup
from tokenbus.topics.reply_stream import ReplyEvent, ReplyStream
from tokenbus.topics.settings import BusSettings

HIGH_WATER = 1024  # events waiting for the reader before the replay pauses reading


async def replay(
    settings: BusSettings,
    request_id: str,
    partition: int,
    from_offset: int,
    delivered_through: int | None = None,
    idle_timeout: float | None = 60.0,
    codec: AvroCodec | None = None,
    topic: str | None = None,
    members: Sequence[str] = (),
) -> AsyncGenerator[ReplyEvent, None]:
    """Events of ``request_id`` on ``partition`` of ``topic`` (``tokens`` if not given) from
    ``from_offset``; with ``members``, the events of those requests instead, read as one stream
    (the choices of ``request_id``, reply_group.py). Events at offsets up to
    ``delivered_through`` (a Last-Event-ID) were delivered already: they are read to learn
    where the stream stands but not yielded again; if the final event was among them, the
    replay ends with nothing more to yield."""
    codec = codec or make_codec(settings)
    tp = TopicPartition(topic or TopicCatalog(settings).tokens, partition)
    streams = {member.encode(): ReplyStream(member) for member in members or [request_id]}
    reader: ReplyStream | ReplyGroup = ReplyGroup(request_id, streams.values()) if members else streams[
        request_id.encode()]
    consumer = make_consumer(settings)
    await consumer.start()
    consumer.assign([tp])
    consumer.seek(tp, from_offset)

    async def pump() -> None:
        while not reader.done:
            if reader.backlog >= HIGH_WATER:
                await asyncio.sleep(0.01)
                continue
            for record in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                stream = streams.get(record.key)
                if stream is None:
                    continue
                try:
                    event = codec.decode(record.value, TokenEvent)
                except DecodeError:
                    continue
                if delivered_through is not None and record.offset <= delivered_through:
                    stream.next_seq = max(stream.next_seq, event.seq + 1)
                    if event.is_final:
                        stream.end()
                    continue
                stream.offer(ReplyEvent(event, record.partition, record.offset))

    pumping = asyncio.create_task(pump(), name=f"replay-{request_id}")
    try:
        async for reply in reader.events(idle_timeout):
            yield reply
    finally:
        await stop_reader(pumping, consumer)


async def record_at(settings: BusSettings, topic: str, partition: int, offset: int,
                    timeout_s: float = 5.0) -> bytes | None:
    """The value of the record at ``offset`` of ``topic``'s ``partition``; None where the log no
    longer holds it (retention) or nothing came within ``timeout_s``."""
    tp = TopicPartition(topic, partition)
    consumer = make_consumer(settings)
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, offset)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            for record in (await consumer.getmany(tp, timeout_ms=200)).get(tp, []):
                if record.offset == offset:
                    value: bytes = record.value
                    return value
                if record.offset > offset:  # deleted by retention: the log starts after it
                    return None
        return None
    finally:
        await consumer.stop()
