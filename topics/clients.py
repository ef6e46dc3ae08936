"""aiokafka clients, tuned for the kind of broker they talk to (``BusSettings.broker``).

Kafka long-polls: a fetch waits up to ``fetch_max_wait_ms`` but returns as soon as a record
arrives, so a long wait costs no latency and keeps an idle consumer at a couple of fetches a
second. The embedded broker does not: a fetch that finds no record is held for its whole wait
and not answered when one arrives (a record waits half the wait on average for the next
fetch), so a latency-sensitive reader there must ask for a few milliseconds; and it makes
group joins wait half the session timeout, so its groups use a short one. Each profile
below names, per kind of reader, the fetch wait it gets. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.protocol.commit import OffsetCommitRequest
from aiokafka.protocol.group import JoinGroupRequest
from aiokafka.structs import OffsetAndMetadata

from tokenbus.topics.catalog import TopicCatalog
from tokenbus.topics.doorbell import Doorbell
from tokenbus.topics.holes import wait_at_holes
from tokenbus.topics.settings import BusSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientProfile:
    fetch_max_wait_ms: int  # readers on the request path: the next token, the next request
    background_fetch_max_wait_ms: int  # readers that may lag a little: cancels, queue depth
    session_timeout_ms: int
    heartbeat_interval_ms: int
    # A request-path reader that has seen nothing for `idle_after_s` fetches with this wait (FetchPacer).
    idle_fetch_max_wait_ms: int
    idle_after_s: float
    # With a doorbell (topics/doorbell.py) an idle reader stops fetching, but for one fetch every
    # `idle_poll_s`, and writers ring at most every `ring_every_s` (less than `idle_after_s`).
    idle_poll_s: float = 0.0
    ring_every_s: float = 0.0
    # The embedded broker answers a fetch with nothing when listing the partition's record batches
    # outlasts the fetch wait (that cost grows with the log): a reader left behind its log end
    # raises its wait (FetchPacer). A Kafka broker never starves a reader that way.
    raise_wait_when_starved: bool = False
    # How long aiokafka's fetch routine sleeps when it has nothing to fetch (every partition
    # paused) before it looks again; aiokafka's default is 200 ms. Resuming a partition wakes it
    # at once, so the embedded profile, whose idle readers are paused, lets it sleep longer: five
    # wake-ups a second per idle consumer were a good part of an idle process's CPU.
    fetcher_timeout_ms: int = 200
    # A request-path reader serving one or two requests or streams (FetchPacer.serving) fetches
    # with this wait instead (0: fetch_max_wait_ms). On the embedded broker a record waits half the
    # wait for the next fetch, on each hop; a shorter wait costs fetches, which a machine serving
    # one or two requests has the CPU for and a busy one has not (2 ms for all readers made
    # concurrency 32 slower).
    light_fetch_max_wait_ms: int = 0
    # A light reader whose records also come by the express lane (topics/doorbell.py), every one
    # lately, fetches with this wait instead (0: the light wait): its fetches only back the lane up,
    # and a lane that misses a record brings the light wait back (FetchPacer). The embedded broker
    # holds a fetch about half its wait while records flow, so this sets how often such a reader
    # fetches (at concurrency 1 the GPU consumer's request reader: 21 a second at 50 ms, 11 at 100),
    # and how long a record the lane missed waits at most before the light wait is back (about half).
    express_fetch_max_wait_ms: int = 0
    # A reader's background topics, whose records may wait (the processors' completions and
    # moderation decisions), are fetched in short spells this often rather than at its busy wait
    # all along (0: with the rest). A spell, not a long wait: a fetch the embedded broker holds for
    # its whole wait would hold up the reader's other topics just as long.
    background_spell_every_s: float = 0.0
    # A rotating reply router writes each rotation to a new topic, deleted once done with
    # (topics/replies.py): the embedded broker scans a partition's whole log on every fetch and
    # only gives memory back when a topic is deleted. On Kafka, retention bounds the logs.
    roll_reply_logs: bool = False
    # The embedded broker can show a reader a partition's later batch before an earlier one,
    # written at the same moment by another producer, is stored: its readers wait at such a hole
    # rather than pass it (topics/holes.py). Kafka shows no such hole.
    wait_at_holes: bool = False


PROFILES = {
    # Kafka's own fetch wait; a crashed GPU consumer's partitions move after 10 s (Kafka's
    # default of 45 s would hold its requests that long).
    "kafka": ClientProfile(fetch_max_wait_ms=500, background_fetch_max_wait_ms=500,
                           session_timeout_ms=10_000, heartbeat_interval_ms=3_000,
                           idle_fetch_max_wait_ms=500, idle_after_s=0.0),
    # A record reaches a reader ~2.5 ms after it is written (~1 ms while it serves one or two);
    # a cancel or a queue depth within ~100 ms (a 20 ms wait cost a fifth of a broker core per
    # idle reader).
    # An idle reader pauses and is woken by the doorbell, or, in a stack without one, backs off
    # to 100 ms: ~20 fetches a second instead of hundreds, and up to ~50 ms more per hop for the
    # first record after a quiet spell.
    "embedded": ClientProfile(fetch_max_wait_ms=5, background_fetch_max_wait_ms=200,
                              session_timeout_ms=6_000, heartbeat_interval_ms=1_000,
                              idle_fetch_max_wait_ms=100, light_fetch_max_wait_ms=2, express_fetch_max_wait_ms=100,
                              background_spell_every_s=0.1, idle_after_s=2.0, idle_poll_s=10.0,
                              ring_every_s=0.5, raise_wait_when_starved=True, fetcher_timeout_ms=1000,
                              roll_reply_logs=True, wait_at_holes=True),
}


def profile(settings: BusSettings) -> ClientProfile:
    return PROFILES[settings.broker]


def doorbell_on(settings: BusSettings) -> bool:
    """Only the embedded broker needs one (Kafka long-polls)."""
    return settings.broker == "embedded" and bool(settings.doorbell_url)


def express_lane_on(settings: BusSettings) -> bool:
    """Whether writers hand records over, and readers take them, on the doorbell's express lane."""
    return doorbell_on(settings) and settings.express_lane


FORGET_TOPIC_AFTER_S = 60.0  # an embedded producer stops naming a topic in its metadata requests


class EmbeddedProducer(AIOKafkaProducer):  # type: ignore[misc]  # aiokafka ships no types
    """The embedded broker's producer.

    It forgets topics it has not written to for ``FORGET_TOPIC_AFTER_S``: aiokafka names every
    topic a producer ever wrote to in each metadata refresh, and the embedded broker creates a
    topic a metadata request names, so a writer of rolled reply logs (topics/replies.py) would
    bring each one back after its router deleted it.

    With a doorbell it rings as it writes (rate-limited, topics/doorbell.py), but not for
    ``quiet_topics``: what nobody waits for must not wake every reader of an idle stack; and with
    ``express`` it hands over the records its writer asks it to (``hand_over``)."""

    def __init__(self, doorbell: Doorbell | None, quiet_topics: frozenset[str] = frozenset(), express: bool = False,
                 **options: Any) -> None:
        super().__init__(**options)
        self._doorbell = doorbell
        self._express = doorbell if express else None
        self._quiet_topics = quiet_topics
        self._written: dict[str, float] = {}  # topic -> when last written
        self._forget_at = time.monotonic() + FORGET_TOPIC_AFTER_S

    def _forget_unwritten(self) -> None:
        """Before a write, which may refresh the metadata of every topic the producer knows."""
        now = time.monotonic()
        if now >= self._forget_at:
            self._forget_at = now + FORGET_TOPIC_AFTER_S
            self._written = {t: at for t, at in self._written.items() if now - at < FORGET_TOPIC_AFTER_S}
            self.client.set_topics(list(self._written))

    def _wrote(self, topic: str) -> None:
        if topic not in self._written:  # new, or forgotten a while ago: its metadata is wanted again
            self.client.add_topic(topic)
        self._written[topic] = time.monotonic()
        if self._doorbell is not None and topic not in self._quiet_topics:
            self._doorbell.ring(topic)

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        self._forget_unwritten()
        delivery = await super().send(topic, *args, **kwargs)
        self._wrote(topic)
        return delivery

    async def send_batch(self, batch: Any, topic: str, *, partition: int) -> Any:
        self._forget_unwritten()
        delivery = await super().send_batch(batch, topic, partition=partition)
        self._wrote(topic)
        return delivery

    def hand_over(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes) -> None:
        """The acknowledged record ``key``, ``value`` at ``offset``, to the readers waiting for it
        (the express lane, topics/doorbell.py); nothing without one."""
        if self._express is not None:
            self._express.hand_over(topic, partition, offset, key, value)

    async def stop(self) -> None:
        await super().stop()
        if self._doorbell is not None:
            await self._doorbell.close()


def make_producer(settings: BusSettings, **overrides: Any) -> AIOKafkaProducer:
    # On Kafka a write is acknowledged once every in-sync replica has it, and the idempotent
    # producer keeps a retried send from being written twice. The embedded broker has one node
    # and no idempotent producer (consumers dedup by (request_id, seq) either way).
    on_kafka = settings.broker == "kafka"
    options: dict[str, Any] = dict(
        bootstrap_servers=settings.bootstrap_servers,
        acks="all" if on_kafka else 1,
        linger_ms=0,
        enable_idempotence=on_kafka,
        request_timeout_ms=10_000,
        max_batch_size=256 * 1024,
    )
    options.update(overrides)
    if on_kafka:
        return AIOKafkaProducer(**options)
    doorbell = None
    if doorbell_on(settings):
        assert settings.doorbell_url
        doorbell = Doorbell(settings.doorbell_url, settings.topic_prefix, profile(settings).ring_every_s)
    # GPU consumers' cache reports (a snapshot every 10 s each, idle or not): a paused router
    # reads them within its idle poll, and a stale index costs only a cache miss.
    quiet = frozenset({TopicCatalog(settings).cache_reports})
    return EmbeddedProducer(doorbell, quiet, express_lane_on(settings), **options)


def make_consumer(settings: BusSettings, *topics: str, group_id: str | None = None, background: bool = False,
                  **overrides: Any) -> AIOKafkaConsumer:
    """A consumer tuned for ``settings.broker``; ``background`` for a reader that may lag a little."""
    tuned = profile(settings)
    if tuned.wait_at_holes:
        wait_at_holes()
    options: dict[str, Any] = dict(
        bootstrap_servers=settings.bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=tuned.background_fetch_max_wait_ms if background else tuned.fetch_max_wait_ms,
        session_timeout_ms=tuned.session_timeout_ms,
        heartbeat_interval_ms=tuned.heartbeat_interval_ms,
        consumer_timeout_ms=tuned.fetcher_timeout_ms,
    )
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


async def topic_partitions(consumer: AIOKafkaConsumer, *topics: str) -> list[TopicPartition]:
    """Every partition of ``topics`` that exist. A started client knows only the topics its
    bootstrap answer listed: the embedded broker lists them all, a Kafka cluster need not, so
    ``partitions_for_topic`` alone may answer None (and a reader assign nothing) for a topic
    that exists. Topics it does not know yet are looked up first."""
    unknown = [topic for topic in topics if consumer.partitions_for_topic(topic) is None]
    if unknown:
        client = consumer._client  # aiokafka's own metadata tracking, as its producer's partitions_for
        for topic in unknown:
            client.add_topic(topic)
        await client.force_metadata_update()
    return [TopicPartition(topic, p) for topic in topics for p in sorted(consumer.partitions_for_topic(topic) or ())]


async def committed_offsets(consumer: AIOKafkaConsumer, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
    """The group's committed offsets of ``partitions`` (0 where none), in one request:
    ``consumer.committed`` asks once per partition. ``consumer`` carries the group's id."""
    found = await consumer._coordinator.fetch_committed_offsets(partitions)  # what committed() calls
    return {tp: found[tp].offset if tp in found and found[tp].offset >= 0 else 0 for tp in partitions}


async def commit_as_member(consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> bool:
    """Commit ``offsets`` for the consumer's group, once, as a member of its current generation.
    Sends nothing and answers False where the consumer is no member (its partitions were lost,
    not revoked: what Kafka's Java consumer calls ``onPartitionsLost``, where no commit is allowed).

    aiokafka's ``commit`` retries until it succeeds, each try with the generation the consumer
    has by then; a try that outlives the membership goes out as a commit from outside the group
    (generation -1), which a broker takes while the group has no members. After the embedded
    broker restarted, such a commit from before the restart put an offset past the end of the
    re-created log, and a worker skipped the requests below it. A failed commit raises at once
    (the next one carries the offsets)."""
    coordinator = consumer._coordinator  # what commit() calls, without its retries
    async with coordinator._commit_lock:
        # Checked with the lock held and nothing awaited before the request is built from them.
        if coordinator.generation == OffsetCommitRequest.DEFAULT_GENERATION_ID or \
                coordinator.member_id == JoinGroupRequest.UNKNOWN_MEMBER_ID:
            return False
        await coordinator._do_commit_offsets(None, {tp: OffsetAndMetadata(offset, "") for tp, offset in offsets.items()})
    return True


async def cancel_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task (a reader, a watch, a timer) and wait until it has ended."""
    if task:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def stop_reader(task: asyncio.Task[Any] | None, consumer: AIOKafkaConsumer | None) -> None:
    """Stop a background task that reads with ``consumer``, then the consumer."""
    await cancel_task(task)
    if consumer:
        await consumer.stop()


async def rewind_recreated(consumer: AIOKafkaConsumer) -> list[TopicPartition]:
    """Read again from the beginning each assigned partition whose log now ends before the
    consumer's position: the log was emptied and created anew (a broker without storage
    restarted, a topic deleted and re-created), so everything in it is new. Kafka answers a
    fetch past the log end with OFFSET_OUT_OF_RANGE and the consumer resets itself; the
    embedded broker answers it with no records, and a reader that never checks waits forever.
    Returns the partitions rewound; cheap enough to call about once a second."""
    rewound = []
    for tp in consumer.assignment():
        highwater = consumer.highwater(tp)  # from the last fetch response: the log end right now
        if highwater is not None and highwater < await consumer.position(tp):
            log.warning("%s-%s ends at %d, before this reader's position: the log was re-created, reading it from the start",
                        tp.topic, tp.partition, highwater)
            consumer.seek(tp, 0)
            rewound.append(tp)
    return rewound


def known_position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The offset of the next record ``consumer`` returns from ``tp``, without a round trip
    (``consumer.position`` may make one); None where it has none (yet, or any more)."""
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except AttributeError:  # no assignment (yet, or any more)
        return None
    return state.position if state is not None and state.has_valid_position else None
