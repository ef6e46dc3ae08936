"""A doorbell for readers of the embedded broker, which has no long-poll.

Kafka answers a waiting fetch as soon as a record arrives, so an idle reader costs a couple
of fetches a second and loses nothing. The embedded broker does not: a reader that wants a
record within milliseconds must fetch every few milliseconds, and one that waits longer gets
its first record late, by an amount that varies (measured: 20 to 870 ms at a 2 s wait). With
a doorbell an idle reader stops fetching altogether (``FetchPacer`` pauses its partitions) and
the process that writes to the bus rings when it writes after a quiet spell: a Redis
publish, which reaches every reader within a millisecond. A ring that is lost (Redis away)
costs latency, never a record: a paused reader still fetches once every ``idle_poll_s``.

Rings are rate-limited per topic and process to one every ``ring_every_s``. That is enough
because a woken reader stays awake for ``idle_after_s`` (longer), so every record is written
either with a ring or less than ``ring_every_s`` after one that woke its readers.

One channel per stack (its topic prefix): a ring wakes every reader of the stack, not just
those of its topic. Simpler than a channel per topic, and what it costs is a few seconds of
short fetches in readers that had nothing to read.

The express lane: a writer may also hand a record, once the broker has acknowledged it, to the
readers waiting for it (``hand_over``, on a channel per topic), so that they have it without the
embedded broker's fetch cycle (a fetch in flight is answered only half-way through its wait or at
its end, and the next one returns the record: at concurrency 1, 2.7 ms p50 and 5.2 ms p99 from
the publish to the edge, BENCHMARKS.md §11). It carries the two records a client's first token
waits on: the edge hands each request it publishes to the GPU consumers (gpu_consumers/intake.py),
and the GPU consumer hands each request's token events to the edge's reply router
(topics/replies.py) and output moderation (topics/rolled_logs.py), each while it serves few (under
load fetches return records at once). The later tokens gain no latency by it (they hide behind the
engine's steps); with every record on the lane the readers' fetches only back it up, at a longer
wait (``FetchPacer``). What is handed over is the key and value the broker holds at that offset,
so a reader that also fetches it passes one of the two copies over, and a lost hand-over costs
latency only.

What a process rings and hands over in one pass of its event loop goes to Redis in one write, on
a connection nothing waits on (publish_connection.py): a hand-over alone costs its writer ~30-45 µs
of CPU and one of several in a pass a few, where a task and a round trip through redis-py cost
~110-140 µs (BENCHMARKS.md §18).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import redis.asyncio as redis

from tokenbus.topics.publish_connection import PublishConnection

log = logging.getLogger(__name__)

RECONNECT_S = 1.0
MAX_TOPICS_REMEMBERED = 256
EXPRESS = "tokenbus:express:"
_PLACE = struct.Struct(">iqi")  # a handed-over record's partition, offset and key length (-1: none), before its key and value


class Handed(NamedTuple):
    """A record handed over on the express lane: where the broker put it, and its bytes."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


def channel(topic_prefix: str) -> str:
    return f"tokenbus:doorbell:{topic_prefix}"


def express_channel(topic: str) -> str:
    return EXPRESS + topic


class Doorbell:
    """The ringing side, one per producer."""

    def __init__(self, url: str, topic_prefix: str, ring_every_s: float) -> None:
        self._publisher = PublishConnection(url)
        self._channel = channel(topic_prefix)
        self._ring_every_s = ring_every_s
        self._last_rung: dict[str, float] = {}

    def ring(self, topic: str) -> None:
        """A record was just written to ``topic``; tell the readers unless this was done lately."""
        now = time.monotonic()
        if now - self._last_rung.get(topic, float("-inf")) < self._ring_every_s:
            return
        if len(self._last_rung) > MAX_TOPICS_REMEMBERED:  # rolled reply logs come and go
            self._last_rung = {t: at for t, at in self._last_rung.items() if now - at < self._ring_every_s}
        self._last_rung[topic] = now
        self._publisher.publish(self._channel, topic.encode())

    def hand_over(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes) -> None:
        """The record ``key``, ``value`` was acknowledged at ``offset`` of ``topic``-``partition``:
        hand it to the readers listening on the topic's express lane."""
        place = _PLACE.pack(partition, offset, -1 if key is None else len(key))
        self._publisher.publish(express_channel(topic), place + (key or b"") + value)

    @property
    def publisher(self) -> PublishConnection:
        return self._publisher

    async def close(self) -> None:
        await self._publisher.close()


async def listen(url: str, topic_prefix: str, on_ring: Callable[[str], None]) -> None:
    """Call ``on_ring`` with the topic written to for every ring of the stack, until cancelled;
    reconnects when Redis goes away."""

    def ring(message: dict[str, Any]) -> None:
        data = message.get("data")
        on_ring(data.decode(errors="replace") if isinstance(data, bytes) else str(data))

    await _listen(url, lambda pubsub: pubsub.subscribe(channel(topic_prefix)), ring)


async def listen_express(url: str, topics_starting: str, on_record: Callable[[Handed], None]) -> None:
    """Call ``on_record`` with every record handed over on the express lane of a topic whose name
    starts with ``topics_starting``, until cancelled; reconnects when Redis goes away."""
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in express_channel(topics_starting))

    def handed_over(message: dict[str, Any]) -> None:
        data, name = message.get("data"), message.get("channel")
        if isinstance(data, bytes) and isinstance(name, bytes) and len(data) >= _PLACE.size:
            partition, offset, key_size = _PLACE.unpack_from(data)
            value_at = _PLACE.size + max(key_size, 0)
            key = data[_PLACE.size:value_at] if key_size >= 0 else None
            on_record(Handed(name.decode(errors="replace").removeprefix(EXPRESS), partition, offset, key, data[value_at:]))

    await _listen(url, lambda pubsub: pubsub.psubscribe(escaped + "*"), handed_over)


async def _listen(url: str, subscribe: Callable[[Any], Awaitable[Any]], handle: Callable[[dict[str, Any]], None]) -> None:
    while True:
        client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
        try:
            async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                await subscribe(pubsub)
                async for message in pubsub.listen():
                    handle(message)
        except (redis.RedisError, OSError) as exc:
            log.debug("doorbell: listening failed (%s); retrying", exc)
        finally:
            await client.aclose()
        await asyncio.sleep(RECONNECT_S)
