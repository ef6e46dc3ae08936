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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as redis

log = logging.getLogger(__name__)

RECONNECT_S = 1.0
MAX_TOPICS_REMEMBERED = 256


def channel(topic_prefix: str) -> str:
    return f"tokenbus:doorbell:{topic_prefix}"


class Doorbell:
    """The ringing side, one per producer."""

    def __init__(self, url: str, topic_prefix: str, ring_every_s: float) -> None:
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
        self._channel = channel(topic_prefix)
        self._ring_every_s = ring_every_s
        self._last_rung: dict[str, float] = {}
        self._ringing: set[asyncio.Task[None]] = set()

    def ring(self, topic: str) -> None:
        """A record was just written to ``topic``; tell the readers unless this was done lately."""
        now = time.monotonic()
        if now - self._last_rung.get(topic, float("-inf")) < self._ring_every_s:
            return
        if len(self._last_rung) > MAX_TOPICS_REMEMBERED:  # rolled reply logs come and go
            self._last_rung = {t: at for t, at in self._last_rung.items() if now - at < self._ring_every_s}
        self._last_rung[topic] = now
        task = asyncio.get_running_loop().create_task(self._publish(topic))
        self._ringing.add(task)
        task.add_done_callback(self._ringing.discard)

    async def _publish(self, topic: str) -> None:
        try:
            await self._redis.publish(self._channel, topic)
        except (redis.RedisError, OSError) as exc:
            log.debug("doorbell: ring for %s lost (%s); readers catch up by polling", topic, exc)

    async def close(self) -> None:
        await asyncio.gather(*self._ringing, return_exceptions=True)
        await self._redis.aclose()


async def listen(url: str, topic_prefix: str, on_ring: Callable[[str], None]) -> None:
    """Call ``on_ring`` with the topic written to for every ring of the stack, until cancelled;
    reconnects when Redis goes away."""
    while True:
        client = redis.Redis.from_url(url, socket_connect_timeout=1.0)
        try:
            async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                await pubsub.subscribe(channel(topic_prefix))
                async for message in pubsub.listen():
                    data = message.get("data")
                    on_ring(data.decode(errors="replace") if isinstance(data, bytes) else str(data))
        except (redis.RedisError, OSError) as exc:
            log.debug("doorbell: listening failed (%s); retrying", exc)
        finally:
            await client.aclose()
        await asyncio.sleep(RECONNECT_S)
