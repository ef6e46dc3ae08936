"""The reply side: one consumer per process reads its reply partition(s) of ``tokens``
and hands each request's events, in seq order and without duplicates, to that
request's bounded queue.

Why one shared consumer and not a topic per request: creating and deleting a topic
per request costs broker round trips and metadata that grows with traffic, while a
partition that the requester owns needs nothing per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from schemas import AvroCodec, DecodeError, TokenEvent
from topics import BusSettings, TopicCatalog, make_consumer, stop_reader

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 4096


class ReplyStreamError(RuntimeError):
    """The stream cannot continue: its reader fell too far behind, nothing arrived in time,
    or the bus went away. ``code`` says which, for the client's error event."""

    def __init__(self, message: str, code: str = "stream_timeout") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ReplyEvent:
    """A token event and where it sits in the log."""

    event: TokenEvent
    partition: int
    offset: int

    @property
    def event_id(self) -> str:
        """Locates the event in the log (``partition-offset``): what the SSE ``id`` carries."""
        return f"{self.partition}-{self.offset}"


@dataclass(eq=False)
class ReplyStream:
    """One request's token events, delivered in ``seq`` order exactly once."""

    request_id: str
    queue_size: int = DEFAULT_QUEUE_SIZE
    next_seq: int = 0
    _queue: asyncio.Queue[ReplyEvent | ReplyStreamError] = field(init=False)
    _early: dict[int, ReplyEvent] = field(init=False, default_factory=dict)
    _done: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._queue = asyncio.Queue(maxsize=self.queue_size)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def backlog(self) -> int:
        """Events delivered to this stream and not read yet."""
        return self._queue.qsize()

    def offer(self, reply: ReplyEvent) -> None:
        """Accept an event from the router; drop repeats, hold events that arrive early."""
        if reply.event.truncate:
            self._truncate(reply)
            return
        seq = reply.event.seq
        if self._done or seq < self.next_seq or seq in self._early:
            return
        self._early[seq] = reply
        while self.next_seq in self._early and not self._done:
            self._push(self._early.pop(self.next_seq))

    def _truncate(self, reply: ReplyEvent) -> None:
        """Output moderation stops the stream where the reader is: what was delivered stays
        delivered, nothing after it is (events held for later seqs are dropped)."""
        if self._done:
            return
        self._early.clear()
        self._push(reply)

    def _push(self, reply: ReplyEvent) -> None:
        self.next_seq += 1
        if reply.event.is_final:
            self._done = True
        try:
            self._queue.put_nowait(reply)
        except asyncio.QueueFull:
            self.fail(ReplyStreamError(f"reply queue of {self.request_id} overflowed: reader too slow"))

    def fail(self, error: ReplyStreamError) -> None:
        self._done = True
        while self._queue.full():
            self._queue.get_nowait()
        self._queue.put_nowait(error)

    async def events(self, idle_timeout: float | None = None) -> AsyncIterator[ReplyEvent]:
        """Yield events up to and including the final one."""
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), idle_timeout)
            except TimeoutError:
                raise ReplyStreamError(f"no token event for {idle_timeout}s") from None
            if isinstance(item, ReplyStreamError):
                raise item
            yield item
            if item.event.is_final:
                return


class ReplyRouter:
    """Reads this process's reply partitions and routes events to open streams."""

    def __init__(
        self,
        settings: BusSettings,
        partitions: list[int],
        codec: AvroCodec | None = None,
        queue_size: int = DEFAULT_QUEUE_SIZE,
    ) -> None:
        self.settings = settings
        self.topic = TopicCatalog(settings).tokens
        self.partitions = partitions
        self._codec = codec or AvroCodec()
        self._queue_size = queue_size
        self._streams: dict[str, ReplyStream] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._positions: dict[int, int] = {}
        self.undecodable = 0

    @property
    def reply_partition(self) -> int:
        return self.partitions[0]

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._consumer = make_consumer(self.settings)
        await self._consumer.start()
        tps = [TopicPartition(self.topic, p) for p in self.partitions]
        self._consumer.assign(tps)
        # Start from about now. On the embedded broker end offsets can point a batch
        # early; the extra events belong to no open request and are dropped.
        await self._consumer.seek_to_end(*tps)
        for tp in tps:
            self._positions[tp.partition] = await self._consumer.position(tp)
        self._task = asyncio.create_task(self._run(), name="reply-router")

    async def stop(self) -> None:
        await stop_reader(self._task, self._consumer)
        self.fail_all(ReplyStreamError("reply router stopped"))

    def fail_all(self, error: ReplyStreamError) -> int:
        """End every open stream with ``error``; returns how many there were."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.fail(error)
        self._streams.clear()
        return len(streams)

    def position(self, partition: int) -> int:
        """An offset no event published from now on can precede: where a new stream's replay starts."""
        return self._positions.get(partition, 0)

    def open(self, request_id: str) -> ReplyStream:
        """Register interest before publishing the request, so no event can be missed."""
        stream = ReplyStream(request_id, queue_size=self._queue_size)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    self._route(record)

    def _route(self, record: ConsumerRecord) -> None:
        self._positions[record.partition] = record.offset + 1
        request_id = record.key.decode(errors="replace") if record.key else ""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            event = self._codec.decode(record.value, TokenEvent)
        except DecodeError as exc:
            self.undecodable += 1
            log.warning("undecodable token event at %s-%s: %s", record.partition, record.offset, exc.reason)
            return
        stream.offer(ReplyEvent(event, record.partition, record.offset))
        if stream.done:
            self._streams.pop(request_id, None)
