"""The reply side: one consumer per process reads its reply partition(s) of ``tokens``
and hands each request's events, in seq order and without duplicates, to that
request's bounded queue.

Why one shared consumer and not a topic per request: creating and deleting a topic
per request costs broker round trips and metadata that grows with traffic, while a
partition that the requester owns needs nothing per request.

Why new requests move to the next owned partition once the current one has been written for
``rotate_every_s`` (and after ``rotate_after_streams`` new streams, whichever comes first): a
broker without retention (the embedded one) scans a partition's whole list of record batches on
every fetch, so each event read costs more as the log grows (at concurrency 1, time to first
token rose ~1.5 ms over a 15 s rotation), and a fetch whose scan outlasts ``fetch_max_wait_ms``
returns nothing, so one ever-growing hot partition eventually stops delivering. Rotating keeps
the partition being written small and reads only the partitions that still have open streams.
Only the seconds in which the partition was written count: a GPU consumer writes a batch per
engine step whatever the number of streams, so written seconds bound the batches, and a quiet
router makes no new logs (but one every ``FRESH_LOGS_AFTER_S``: routers take each other's logs
that old for abandoned).

Why, on the embedded broker, each rotation writes a new topic instead (a *rolled reply log*,
``tokens.<router>.<created ms>``, one partition): rotating through partitions only spreads the
growth, and once every owned partition has been written a few times each fetch scans them all
again (a steady 10-minute soak's broker CPU doubled as the laps went by). A topic can be
deleted, and that is the only way the embedded broker gives memory back: a rolled log is
deleted once it has taken no new stream for ``keep_s`` (how long its streams stay resumable
there), none of its streams is open and nothing arrived on it lately. Kafka's retention does
that job on a cluster, where the router rotates through partitions of ``tokens``.

A router of rolled logs also takes the records a GPU consumer hands over on their express lane
(each request's first token event, and every event while the consumer is light,
topics/doorbell.py): offered to the stream like a fetched record, so whichever of the two copies
comes second is dropped as a repeat. While the router is light and the lane brings every event
(before or just after the fetch), its fetches only back the lane up and wait longer
(``FetchPacer``'s express wait).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from tokenbus.schemas import AvroCodec, DecodeError, SchemaRegistryError, TokenEvent
from tokenbus.schemas.registry import READ_AGAIN_AFTER_S
from tokenbus.topics import doorbell
from tokenbus.topics.catalog import ROLLED_REPLY_LOG_PARTITIONS, TopicCatalog
from tokenbus.topics.clients import cancel_task, express_lane_on, make_consumer, rewind_recreated, stop_reader
from tokenbus.topics.framing import make_codec
from tokenbus.topics.pacing import FetchPacer
from tokenbus.topics.provision import TopicAdmin, TopicProvisioningError
from tokenbus.topics.reply_stream import DEFAULT_QUEUE_SIZE, ROUTER_STOPPED, ReplyEvent, ReplyStream, ReplyStreamError
from tokenbus.topics.settings import BusSettings

log = logging.getLogger(__name__)

RECREATED_CHECK_S = 1.0  # how often the router looks for a reply log that was re-created
# A rolled reply log is deleted only after nothing arrived on it for this long, so that no writer
# still names it in its metadata (the embedded broker creates a topic a metadata request names).
ROLLED_LOG_QUIET_S = 120.0
SWEEP_EVERY_S = 60.0  # how often a router looks for rolled logs nobody deletes (re-created, or a dead router's)
ABANDONED_AFTER_S = 3600.0  # another router's rolled log this much older than keep_s is taken for abandoned
# A router that stayed on one rolled log this long (a quiet one: it moves on by written seconds)
# moves to logs made now, so that no other router's sweep takes a log it still uses for abandoned.
FRESH_LOGS_AFTER_S = ABANDONED_AFTER_S / 2


class ReplyRouter:
    """Reads this process's reply partitions and routes events to open streams.

    New requests go to the reply partition of the moment (``reply_topic``, ``reply_partition``);
    the consumer reads that one and every partition that still has an open stream, from the
    position it last routed. With ``roll_logs`` each rotation moves to a new rolled reply log
    instead of the next owned partition (module docstring)."""

    def __init__(
        self,
        settings: BusSettings,
        partitions: list[int],
        codec: AvroCodec | None = None,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        rotate_every_s: float = 0.0,
        rotate_after_streams: int = 0,
        roll_logs: bool = False,
        keep_s: float = 600.0,
    ) -> None:
        if not partitions:
            raise ValueError("a reply router needs at least one partition")
        self.settings = settings
        self.catalog = TopicCatalog(settings)
        self.partitions = partitions
        self.rotate_every_s = rotate_every_s
        self.rotate_after_streams = rotate_after_streams
        self.roll_logs = roll_logs
        self.keep_s = keep_s
        self._owner = secrets.token_hex(4)  # names this router's rolled logs
        self._created_ms = 0  # when its latest rolled log was made, the other half of that log's name
        self._opened_here = 0  # streams opened on the current partition since it became current
        self._current_written_at = float("-inf")  # when events last arrived on the current partition
        self._written_s = 0.0  # the rotation ticks in which they did, in seconds
        self._codec = codec or make_codec(settings)
        self._queue_size = queue_size
        self._streams: dict[str, ReplyStream] = {}
        self._stream_partitions: dict[str, TopicPartition] = {}
        self._current = TopicPartition(self.catalog.tokens, partitions[0])
        self._next: TopicPartition | None = None  # the rolled log the next rotation moves to, made in advance
        self._reading: set[TopicPartition] = set()
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: TopicAdmin | None = None
        self._reader: asyncio.Task[None] | None = None
        self._rotation: asyncio.Task[None] | None = None
        self._express: asyncio.Task[None] | None = None
        self._moving = asyncio.Lock()  # one move to the next partition or log at a time
        self._positions: dict[TopicPartition, int] = {}
        self._retired: dict[str, float] = {}  # this router's earlier rolled logs: when each stopped taking streams
        self._last_event: dict[str, float] = {}  # rolled log: when an event last arrived on it
        self._express_lane = roll_logs and express_lane_on(settings)
        self._pacer = FetchPacer(settings, express=self._express_lane)
        self.undecodable = 0
        self.rotations = 0

    @property
    def reply_topic(self) -> str:
        """Where a request published now should have its events written: this topic..."""
        topic: str = self._current.topic
        return topic

    @property
    def reply_partition(self) -> int:
        """...and this partition of it."""
        partition: int = self._current.partition
        return partition

    @property
    def reading(self) -> set[TopicPartition]:
        """The partitions the consumer reads now."""
        return set(self._reading)

    @property
    def rolled_logs(self) -> list[str]:
        """This router's rolled reply logs that still exist, oldest first."""
        if not self.roll_logs:
            return []
        return [*self._retired, self._current.topic, *([self._next.topic] if self._next is not None else [])]

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._consumer = make_consumer(self.settings)
        await self._consumer.start()
        self._pacer.attach(self._consumer)
        if self.roll_logs:
            self._admin = TopicAdmin(self.settings.bootstrap_servers)
            await self._admin.start()
            self._current = await self._new_rolled_log()
            self._next = await self._new_rolled_log()
        else:
            self._positions[self._current] = await self._end_offset(self._current)
        self._read({self._current})
        self._reader = asyncio.create_task(self._run(), name="reply-router")
        if self._express_lane:
            assert self.settings.doorbell_url
            self._express = asyncio.create_task(doorbell.listen_express(
                self.settings.doorbell_url, self.catalog.rolled_reply_logs_of(self._owner), self._handed_over),
                name="reply-express")
        if self.roll_logs or ((self.rotate_every_s > 0 or self.rotate_after_streams > 0) and len(self.partitions) > 1):
            self._rotation = asyncio.create_task(self._rotate(), name="reply-rotation")

    async def stop(self) -> None:
        await cancel_task(self._express)
        await cancel_task(self._rotation)
        await self._pacer.close()
        await stop_reader(self._reader, self._consumer)
        if self._admin is not None:
            # Rolled logs outlive the router: another edge may still resume one of their streams.
            await self._admin.close()
        self.fail_all(ReplyStreamError("reply router stopped", ROUTER_STOPPED))

    def fail_all(self, error: ReplyStreamError) -> int:
        """End every open stream with ``error``; returns how many there were."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.fail(error)
        self._streams.clear()
        self._stream_partitions.clear()
        return len(streams)

    async def log_exists(self, topic: str) -> bool:
        """Whether ``topic`` still exists (rolled reply logs are deleted once done with); True when
        the broker cannot say: a reader of the log finds out for itself."""
        assert self._consumer is not None
        try:
            return topic in await self._consumer.topics()  # a listing of every topic creates none
        except KafkaError:
            return True

    def position(self, partition: int, topic: str | None = None) -> int:
        """An offset no event published from now on can precede: where a new stream's replay starts."""
        return self._positions.get(TopicPartition(topic or self.catalog.tokens, partition), 0)

    def open(self, request_id: str, partition: int | None = None, topic: str | None = None) -> ReplyStream:
        """Register interest before publishing the request, so no event can be missed.
        ``topic``, ``partition``: where the request's events are written (the current reply
        partition if not given; ``topic`` defaults to ``tokens``)."""
        stream = ReplyStream(request_id, queue_size=self._queue_size)
        self._pacer.wake()  # its events are on the way
        tp = self._current if partition is None else TopicPartition(topic or self.catalog.tokens, partition)
        self._streams[request_id] = stream
        self._stream_partitions[request_id] = tp
        if tp == self._current:
            self._opened_here += 1
        if tp not in self._reading and self._consumer is not None:
            self._read(self._wanted())
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._stream_partitions.pop(request_id, None)

    async def _end_offset(self, tp: TopicPartition) -> int:
        assert self._consumer is not None
        # On the embedded broker this can point a batch early; the extra events belong to no
        # open request and are dropped.
        offsets: dict[TopicPartition, int] = await self._consumer.end_offsets([tp])
        return offsets[tp]

    def _wanted(self) -> set[TopicPartition]:
        return {self._current, *self._stream_partitions.values()}

    def _read(self, partitions: set[TopicPartition]) -> None:
        """Read exactly ``partitions``, each from the position last routed (nothing skipped)."""
        assert self._consumer is not None
        tps = sorted(partitions)
        self._consumer.assign(tps)
        for tp in tps:
            self._consumer.seek(tp, self._positions.get(tp, 0))
        self._reading = set(partitions)

    async def _rotate(self) -> None:
        """Once the current partition was written in ticks adding up to ``rotate_every_s``, or
        once ``rotate_after_streams`` were opened on it (checked each tick): move new requests to
        the next owned partition (from its end) or a new rolled log; stop reading partitions
        whose streams have all ended; delete rolled logs done with."""
        timed = self.rotate_every_s > 0  # either rule may be off (0); the task runs for the other
        tick = min(1.0, self.rotate_every_s) if timed else 1.0
        loop = asyncio.get_running_loop()
        sweep_at = loop.time() + SWEEP_EVERY_S
        while True:
            tick_began = time.monotonic()
            await asyncio.sleep(tick)
            if self._current_written_at >= tick_began:
                self._written_s += tick
            crowded = 0 < self.rotate_after_streams <= self._opened_here
            try:
                if (timed and self._written_s >= self.rotate_every_s) or crowded:
                    await self._move_on()
                elif self.roll_logs and self._current_log_age_s() >= FRESH_LOGS_AFTER_S:
                    await self._move_to_fresh_logs()
                if self.roll_logs:
                    await self._delete_rolled_logs(sweep=loop.time() >= sweep_at)
                    sweep_at = sweep_at if loop.time() < sweep_at else loop.time() + SWEEP_EVERY_S
            except (KafkaError, TopicProvisioningError) as exc:  # the broker is away: keep writing where we are
                log.warning("reply partition not rotated: %s", exc)
            if self._wanted() != self._reading:
                self._read(self._wanted())

    async def broker_returned(self) -> None:
        """The broker answers again after an outage. On the embedded broker new requests then move
        to rolled logs made now: it kept nothing, and it takes writes to a topic it no longer knows
        (a late writer of the current log) yet creates that topic afresh, from offset 0, once a
        metadata request names it, so every later write there collides with the earlier ones
        and fails until the offsets pass them. A cluster kept its logs: nothing to do."""
        if not self.roll_logs:
            return
        try:
            await self._move_to_fresh_logs()
        except (KafkaError, TopicProvisioningError) as exc:
            log.warning("no fresh reply log after the broker returned: %s", exc)
        else:
            log.info("the broker returned: new requests write to %s", self._current.topic)

    def _current_log_age_s(self) -> float:
        _, created_ms = self.catalog.parse_rolled_reply_log(self._current.topic) or ("", self._created_ms)
        return time.time() - created_ms / 1000

    async def _move_to_fresh_logs(self) -> None:
        """New requests move to a rolled log made now, with another made now to follow it (not
        the one made ahead at the last rotation)."""
        lost = self._next
        self._next = await self._new_rolled_log()
        if lost is not None:
            self._retired[lost.topic] = time.monotonic()
        await self._move_on()

    async def _move_on(self) -> None:
        async with self._moving:
            await self._move_to_next()

    async def _move_to_next(self) -> None:
        if self.roll_logs:
            # Each log is made a rotation before it is used: readers of every log (topics/rolled_logs.py)
            # list the topics only every few seconds, and the broker's listing slows as topics come and go.
            assert self._next is not None
            following, self._next = self._next, await self._new_rolled_log()
            self._retired[self._current.topic] = time.monotonic()
        else:
            index = self.partitions.index(self._current.partition)
            following = TopicPartition(self._current.topic, self.partitions[(index + 1) % len(self.partitions)])
            if following not in self._reading:
                self._positions[following] = await self._end_offset(following)
        self._current = following
        self._opened_here = 0
        self._current_written_at, self._written_s = float("-inf"), 0.0
        self.rotations += 1

    async def _new_rolled_log(self) -> TopicPartition:
        assert self._admin is not None
        # Names must differ even for logs made within one millisecond (at start, after the broker returned).
        self._created_ms = max(int(time.time() * 1000), self._created_ms + 1)
        name = self.catalog.rolled_reply_log(self._owner, self._created_ms)
        await self._admin.create(name, partitions=ROLLED_REPLY_LOG_PARTITIONS)
        tp = TopicPartition(name, 0)
        self._positions[tp] = 0  # a new log: every event of it is new
        self._last_event[name] = time.monotonic()
        return tp

    async def _delete_rolled_logs(self, sweep: bool) -> None:
        """Delete this router's rolled logs that are done with; on a ``sweep``, also rolled logs
        of this router it no longer knows (re-created by a late writer) and other routers' logs
        abandoned long ago (their router died)."""
        assert self._admin is not None
        now = time.monotonic()
        open_logs = {tp.topic for tp in self._stream_partitions.values()}
        done = [name for name, retired_at in self._retired.items()
                if now - retired_at >= self.keep_s and name not in open_logs
                and now - self._last_event.get(name, 0.0) >= ROLLED_LOG_QUIET_S]
        if sweep:
            mine = set(self.rolled_logs)
            cutoff_ms = (time.time() - self.keep_s - ABANDONED_AFTER_S) * 1000
            for name in await self._admin.names():
                rolled = self.catalog.parse_rolled_reply_log(name)
                if rolled is None or name in mine:
                    continue
                owner, created_ms = rolled
                if owner == self._owner or created_ms < cutoff_ms:
                    done.append(name)
        if not done:
            return
        await self._admin.delete(done)
        for name in done:
            self._retired.pop(name, None)
            self._last_event.pop(name, None)
            for tp in [tp for tp in self._positions if tp.topic == name]:
                del self._positions[tp]
        log.info("deleted %d rolled reply log(s)", len(done))

    async def _run(self) -> None:
        assert self._consumer is not None
        loop = asyncio.get_running_loop()
        check_at = loop.time() + RECREATED_CHECK_S
        while True:
            batches = await self._consumer.getmany(timeout_ms=500)
            now = time.monotonic()
            watching_lane = self._pacer.watching_lane
            registry_away = False
            for tp, records in batches.items():
                if records:
                    if self.roll_logs:
                        self._last_event[tp.topic] = now
                    if tp == self._current:
                        self._current_written_at = now
                for record in records:
                    try:
                        news = self._route(tp, record)
                    except SchemaRegistryError as exc:  # the event is fine: it is fetched again
                        log.warning("token event at %s-%s@%s waits for its schema registry: %s",
                                    tp.topic, tp.partition, record.offset, exc)
                        self._consumer.seek(tp, record.offset)
                        self._positions[tp] = record.offset
                        registry_away = True
                        break
                    if news and watching_lane:  # news to its stream: the lane had not brought it
                        self._pacer.fetched_first(tp.topic, tp.partition, record.offset)
            if registry_away:
                await asyncio.sleep(READ_AGAIN_AFTER_S)
            # An open stream is as good as traffic: its next event may come at any moment.
            self._pacer.observed(sum(map(len, batches.values())) or len(self._streams))
            self._pacer.serving(len(self._streams))
            if loop.time() >= check_at:
                check_at = loop.time() + RECREATED_CHECK_S
                for tp in await rewind_recreated(self._consumer):
                    self._positions[tp] = 0

    def _handed_over(self, handed: doorbell.Handed) -> None:
        """A record of one of this router's rolled logs, handed over by its writer once acknowledged."""
        tp, offset = TopicPartition(handed.topic, handed.partition), handed.offset
        self._pacer.handed_over(handed.topic, handed.partition, offset)
        if offset < self._positions.get(tp, 0):  # fetched already
            return
        # By key first, as a fetched record: events of requests no one here reads (a batch's) stay undecoded.
        request_id = handed.key.decode(errors="replace") if handed.key else ""
        stream = self._streams.get(request_id)
        if stream is None or self._stream_partitions.get(request_id) != tp:
            return
        try:
            event = self._codec.decode(handed.value, TokenEvent)
        except (DecodeError, SchemaRegistryError):
            return  # the fetch brings it too, and counts it (or waits for the registry)
        if stream.forward is not None:
            # One of a group's (a response's choices): it takes fetched records alone, so that the
            # group's events come in the log's order, which its resume by one event id relies on
            # (a hand-over from one writer can overtake another writer's records fetched later).
            return
        stream.offer(ReplyEvent(event, handed.partition, offset))
        if stream.done:
            self.close(request_id)

    def _route(self, tp: TopicPartition, record: ConsumerRecord) -> bool:
        """Offer a fetched record to its stream; whether it was news to the stream."""
        self._positions[tp] = record.offset + 1
        request_id = record.key.decode(errors="replace") if record.key else ""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        try:
            event = self._codec.decode(record.value, TokenEvent)
        except DecodeError as exc:
            self.undecodable += 1
            log.warning("undecodable token event at %s-%s-%s: %s", tp.topic, tp.partition, record.offset, exc.reason)
            return False
        fresh = stream.offer(ReplyEvent(event, record.partition, record.offset))
        if stream.done:
            self.close(request_id)
        return fresh
