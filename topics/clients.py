"""aiokafka clients, tuned for the kind of broker they talk to (``BusSettings.broker``).

Kafka long-polls: a fetch waits up to ``fetch_max_wait_ms`` but returns as soon as a record
arrives, so a long wait costs no latency and keeps an idle consumer at a couple of fetches a
second. The embedded broker does not: it holds a fetch for about half of its wait even when
records arrive, so a latency-sensitive reader there must ask for a few milliseconds, and it
makes group joins wait half the session timeout, so its groups use a short one. Each profile
below names, per kind of reader, the fetch wait it gets. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

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


PROFILES = {
    # Kafka's own fetch wait; a crashed GPU consumer's partitions move after 10 s (Kafka's
    # default of 45 s would hold its requests that long).
    "kafka": ClientProfile(fetch_max_wait_ms=500, background_fetch_max_wait_ms=500,
                           session_timeout_ms=10_000, heartbeat_interval_ms=3_000,
                           idle_fetch_max_wait_ms=500, idle_after_s=0.0),
    # A record reaches a reader ~2.5 ms after it is written; a cancel or a queue depth within
    # ~100 ms (a 20 ms wait cost a fifth of a broker core per idle reader).
    # An idle reader backs off to 100 ms: ~20 fetches a second instead of hundreds, and the
    # first record after a quiet spell waits up to ~50 ms more per hop.
    "embedded": ClientProfile(fetch_max_wait_ms=5, background_fetch_max_wait_ms=200,
                              session_timeout_ms=6_000, heartbeat_interval_ms=1_000,
                              idle_fetch_max_wait_ms=100, idle_after_s=2.0),
}


def profile(settings: BusSettings) -> ClientProfile:
    return PROFILES[settings.broker]


def make_producer(settings: BusSettings, **overrides: Any) -> AIOKafkaProducer:
    options: dict[str, Any] = dict(
        bootstrap_servers=settings.bootstrap_servers,
        acks=1,
        linger_ms=0,
        enable_idempotence=False,  # not supported by the embedded broker; consumers dedup instead
        request_timeout_ms=10_000,
        max_batch_size=256 * 1024,
    )
    options.update(overrides)
    return AIOKafkaProducer(**options)


def make_consumer(settings: BusSettings, *topics: str, group_id: str | None = None, background: bool = False,
                  **overrides: Any) -> AIOKafkaConsumer:
    """A consumer tuned for ``settings.broker``; ``background`` for a reader that may lag a little."""
    tuned = profile(settings)
    options: dict[str, Any] = dict(
        bootstrap_servers=settings.bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=tuned.background_fetch_max_wait_ms if background else tuned.fetch_max_wait_ms,
        session_timeout_ms=tuned.session_timeout_ms,
        heartbeat_interval_ms=tuned.heartbeat_interval_ms,
    )
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


class FetchPacer:
    """The fetch wait of one request-path reader, fitted to its traffic.

    On the embedded broker such a reader asks for a few milliseconds (a fetch is held for
    about half its wait even when records arrive), so an idle one fetches hundreds of times a
    second. After ``idle_after_s`` with nothing read it asks for the profile's idle wait;
    the first record after that comes back on the next fetch, and from then on the short wait
    applies again. ``wake()`` is for a reader that knows records are coming (the edge, once it
    has published a request, about its replies). With the Kafka profile both waits are the
    same and the pacer changes nothing."""

    def __init__(self, settings: BusSettings, busy_wait_ms: int | None = None) -> None:
        tuned = profile(settings)
        self._busy_wait_ms = busy_wait_ms or tuned.fetch_max_wait_ms
        self._idle_wait_ms = max(self._busy_wait_ms, tuned.idle_fetch_max_wait_ms)
        self._idle_after_s = tuned.idle_after_s
        self._consumer: AIOKafkaConsumer | None = None
        self._last_active = time.monotonic()
        self._idle = False

    def attach(self, consumer: AIOKafkaConsumer) -> None:
        """The consumer to pace (it may run in another thread: the wait is one attribute)."""
        self._consumer = consumer

    @property
    def idle(self) -> bool:
        return self._idle

    def observed(self, records: int) -> None:
        """After each read: how many records it returned."""
        now = time.monotonic()
        if records:
            self._last_active = now
            self._set(idle=False)
        elif now - self._last_active >= self._idle_after_s:
            self._set(idle=True)

    def wake(self) -> None:
        self._last_active = time.monotonic()
        self._set(idle=False)

    def _set(self, idle: bool) -> None:
        if idle == self._idle:
            return
        self._idle = idle
        fetcher = getattr(self._consumer, "_fetcher", None)  # aiokafka reads it for every fetch request it builds
        if fetcher is not None:
            fetcher._fetch_max_wait_ms = self._idle_wait_ms if idle else self._busy_wait_ms


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
