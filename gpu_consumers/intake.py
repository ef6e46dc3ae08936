"""Where a GPU consumer's requests come from: its fetches of the model's request topics, and the
express lane.

Flow control lives in Kafka: fetched requests wait in a small per-tier buffer (the scheduler);
while a tier's buffer is full its partitions stay paused, so the backlog stays in the log
(consumer lag is the queue depth). A request fetched from before the partition became this
worker's may have been started elsewhere: it is looked up in the token log (`Pending.published`)
and continued after what was already published.

On the embedded broker with a doorbell, the edge also hands each request it publishes to the GPU
consumers on the express lane (topics/doorbell.py) once the broker has acknowledged it. A worker
takes it only where that is the record its next fetch of the partition would return, or the one
after the last it took so (so nothing is skipped or taken out of order), after one fetched since
the partition became its own (that one settles whether another worker may have started it), and
while its tier has room; the fetched copy is then passed over. While the worker is light and the
lane brings every request, its fetches only back the lane up and wait longer (``FetchPacer``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from tokenbus.gpu_consumers.offsets import OffsetTracker
from tokenbus.gpu_consumers.refusals import Refusals
from tokenbus.gpu_consumers.scheduler import Pending, TierScheduler
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.token_log import TokenLog
from tokenbus.schemas import AvroCodec, ChatRequest, DecodeError, SchemaRegistryError
from tokenbus.schemas.registry import READ_AGAIN_AFTER_S
from tokenbus.topics import FetchPacer, TopicCatalog, cancel_task, doorbell, known_position, tracing
from tokenbus.topics.clients import express_lane_on

log = logging.getLogger(__name__)


class RequestIntake:
    """Takes a worker's requests into its scheduler, each once, in partition order.

    ``in_flight`` says how many requests the worker has (running and waiting), which sets how
    long a fetch may wait; ``taken`` is called after a request arrived by the express lane, so
    that the worker admits it without waiting for its poll loop; ``stopping`` is the worker's."""

    def __init__(self, settings: WorkerSettings, codec: AvroCodec, scheduler: TierScheduler, offsets: OffsetTracker,
                 token_log: TokenLog, in_flight: Callable[[], int], taken: Callable[[], None],
                 stopping: asyncio.Event) -> None:
        self._settings = settings
        self._codec = codec
        self._scheduler = scheduler
        self._offsets = offsets
        self._token_log = token_log
        bus = settings.bus
        self._express_lane = express_lane_on(bus)
        self._pacer = FetchPacer(bus, express=self._express_lane)
        catalog = TopicCatalog(settings.bus)
        self._topics_by_tier = {t: catalog.requests(settings.model, t) for t in settings.bus.tiers}
        self._tiers_by_topic = {topic: tier for tier, topic in self._topics_by_tier.items()}
        self._in_flight = in_flight
        self._taken = taken
        self._stopping = stopping
        self._consumer: AIOKafkaConsumer | None = None
        self._refusals: Refusals | None = None
        self._express: asyncio.Task[None] | None = None
        # The first offset of each partition fetched after it became this worker's, learnt from
        # the first fetch's high-water mark: a request before it may have been started elsewhere.
        self._fresh_from: dict[TopicPartition, int | None] = {}
        # When each partition became this worker's (time.monotonic()): its previous owner wrote
        # every token of its requests before then (it flushes before letting a partition go).
        self._assigned_at: dict[TopicPartition, float] = {}
        self._handed_until: dict[TopicPartition, int] = {}  # a fetch passes over records before this: handed over
        self._enqueuing = False  # a fetch's records are being taken: no hand-over comes between them
        self._releasing: set[TopicPartition] = set()  # partitions being given back: no hand-over is taken there

    @property
    def topics(self) -> list[str]:
        return list(self._topics_by_tier.values())

    def start(self, consumer: AIOKafkaConsumer, refusals: Refusals) -> None:
        """Fetch with ``consumer`` (started, not subscribed yet), and listen on the express lane
        where the stack has one."""
        self._consumer = consumer
        self._refusals = refusals
        self._pacer.attach(consumer)
        bus = self._settings.bus
        if self._express_lane:
            assert bus.doorbell_url
            self._express = asyncio.create_task(doorbell.listen_express(
                bus.doorbell_url, os.path.commonprefix(self.topics), self._handed_over), name="express-requests")

    async def close(self) -> None:
        """Stop listening for hand-overs and rings; the consumer is the worker's to stop."""
        await cancel_task(self._express)
        await self._pacer.close()

    # -- partitions --------------------------------------------------------------

    def assigned(self, partitions: set[TopicPartition]) -> None:
        self._releasing -= partitions
        for tp in partitions:
            self._fresh_from[tp] = None
            self._assigned_at[tp] = time.monotonic()
        self._pacer.wake()  # what they hold (another worker's requests, maybe) was announced to no one
        self._pacer.lane_missed()  # the lane's hand-overs wait for a first fetch of each

    def releasing(self, partitions: set[TopicPartition]) -> None:
        """The worker is giving ``partitions`` back: nothing more is taken from them by hand-over."""
        self._releasing |= partitions

    def released(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self._fresh_from.pop(tp, None)
            self._assigned_at.pop(tp, None)
            self._handed_until.pop(tp, None)
        self._releasing -= partitions

    # -- fetching ----------------------------------------------------------------

    async def fetch(self) -> bool:
        """One fetch, its requests taken into the scheduler; whether it returned any record."""
        assert self._consumer is not None
        full = {topic for tier, topic in self._topics_by_tier.items()
                if self._scheduler.waiting(tier) >= self._settings.prefetch_per_tier}
        # Through the pacer, which also pauses an idle worker's partitions (neither undoes the other).
        self._pacer.hold({tp for tp in self._consumer.assignment() if tp.topic in full})
        # A record ends the wait at once; the worker's loop itself only has to turn often while
        # sequences run (a finished one frees a slot for the next waiting request). At most a
        # tier's prefetch is taken at once: a partition resumed on a backlog (a batch's, its
        # waiting requests just cancelled) returns thousands of records, and decoding them all in
        # one pass held the engine's steps up (~150 ms for ~4,700). What the fetcher holds beyond
        # is taken by the next call, or dropped and fetched again once its tier has room.
        batches = await self._consumer.getmany(timeout_ms=50 if self._in_flight() else 500,
                                               max_records=self._settings.prefetch_per_tier)
        self._enqueuing = True
        watching_lane = self._pacer.watching_lane
        registry_away = False
        try:
            for tp, records in batches.items():
                handed_until = self._handed_until.pop(tp, 0)
                for record in records:
                    if record.offset >= handed_until:
                        if watching_lane:  # no hand-over had brought it (yet)
                            self._pacer.fetched_first(tp.topic, tp.partition, record.offset)
                        try:
                            await self._enqueue(tp, record)
                        except SchemaRegistryError as exc:  # the record is fine: it is fetched again
                            log.warning("request at %s-%s@%s waits for its schema registry: %s",
                                        tp.topic, tp.partition, record.offset, exc)
                            self._consumer.seek(tp, record.offset)
                            registry_away = True
                            break
                if records and records[-1].offset + 1 < handed_until:
                    self._handed_until[tp] = handed_until
        finally:
            self._enqueuing = False
        self._pacer.observed_by_topic(batches)  # a tier's topic is paused while it is quiet
        self._pacer.serving(self._in_flight())
        if registry_away:
            await asyncio.sleep(READ_AGAIN_AFTER_S)
        return bool(batches)

    async def _enqueue(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        assert self._consumer is not None and self._refusals is not None
        try:
            # Decoded before it is started: one whose schema registry does not answer is fetched again.
            request = self._codec.decode(record.value, ChatRequest)
        except DecodeError as exc:
            await self._refused(tp, record.offset, self._refusals.dead_letter(record, exc.reason, exc.detail))
            return
        refused = await self._refusals.problem(request, self._settings.model, self._tiers_by_topic.get(record.topic))
        if refused is not None:  # the express lane passes it over the same way
            await self._refused(tp, record.offset, self._refusals.refuse(record, request, *refused))
            return
        self._offsets.started(tp, record.offset)
        fresh_from = self._fresh_from.get(tp)
        if fresh_from is None:
            fresh_from = self._fresh_from[tp] = self._consumer.highwater(tp) or record.offset + 1
        maybe_seen = record.offset < fresh_from
        # Look up now, not at admission: the lookups of one fetch then share one scan of the log.
        published = self._token_log.lookup(request, self._assigned_at.get(tp)) if maybe_seen else None
        self._scheduler.add(Pending(request, tp, record.offset, published, tracing.from_record(record.headers)))
        log.debug("fetched %s from %s-%s@%s (maybe seen: %s)", request.request_id, tp.topic, tp.partition,
                  record.offset, maybe_seen)

    async def _refused(self, tp: TopicPartition, offset: int, refusal: Awaitable[None]) -> None:
        """Started and finished around its refusal, so that no commit passes it before it is out."""
        self._offsets.started(tp, offset)
        await refusal
        self._offsets.finished(tp, offset)

    # -- the express lane ----------------------------------------------------------

    def _handed_over(self, handed: doorbell.Handed) -> None:
        """A request the edge handed over: taken if it is the record the next fetch of its partition
        would return (or the one after the last taken so, which that fetch passes over), after one
        fetched since the partition became this worker's, and its tier has room; otherwise left to
        the fetch."""
        topic, partition, offset, _, value = handed
        self._pacer.handed_over(topic, partition, offset)
        tier = self._tiers_by_topic.get(topic)
        tp = TopicPartition(topic, partition)
        fresh_from = self._fresh_from.get(tp)
        if (tier is None or self._consumer is None or self._stopping.is_set() or self._enqueuing
                or tp in self._releasing or fresh_from is None or offset < fresh_from
                or (known_position(self._consumer, tp) != offset and self._handed_until.get(tp) != offset)
                or self._scheduler.waiting(tier) >= self._settings.prefetch_per_tier):
            return
        try:
            request = self._codec.decode(value, ChatRequest)
        except (DecodeError, SchemaRegistryError):
            return  # the fetch dead-letters it, or waits for the registry
        if self._refusals is None or self._refusals.route_problem(request, self._settings.model, tier) is not None:
            return
        self._handed_until[tp] = offset + 1
        self._offsets.started(tp, offset)
        self._scheduler.add(Pending(request, tp, offset))
        log.debug("handed over %s on %s-%s@%s", request.request_id, topic, partition, offset)
        self._taken()
