"""Whether the broker answers, asked once a second. While it does not, the edge refuses
new requests at once (503, instead of a produce that would wait out its timeout), and if
it stays away past a grace period, open streams end with an error event rather than
hanging until their idle timeout. The aiokafka clients reconnect by themselves when it
returns; the reply router is told first, so that on the embedded broker new requests write
to fresh reply logs (``ReplyRouter.broker_returned``)."""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from tokenbus.topics import ReplyRouter, ReplyStreamError, cancel_task

log = logging.getLogger(__name__)


class BrokerWatch:
    def __init__(self, producer: AIOKafkaProducer, router: ReplyRouter, interval_s: float = 1.0,
                 streams_grace_s: float = 5.0) -> None:
        self._producer = producer
        self._router = router
        self._interval_s = interval_s
        self._grace_s = streams_grace_s
        self.available = True
        self.down_since: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="broker-watch")

    async def stop(self) -> None:
        await cancel_task(self._task)

    async def answers(self) -> bool:
        try:
            async with asyncio.timeout(self._interval_s):  # wait_for can swallow a cancellation on 3.11
                await self._producer.client.fetch_all_metadata()
            return True
        except (KafkaError, OSError, TimeoutError):
            return False

    async def _watch(self) -> None:
        while True:
            answered = await self.answers()
            if answered and not self.available:
                await self._router.broker_returned()  # before new requests are let in again
            self._observe(answered, time.monotonic())
            await asyncio.sleep(self._interval_s)

    def _observe(self, answered: bool, now: float) -> None:
        if answered:
            if not self.available:
                log.warning("the broker answers again after %.1fs", now - (self.down_since or now))
            self.available, self.down_since = True, None
            return
        if self.available:
            log.warning("the broker does not answer: refusing new requests")
            self.available, self.down_since = False, now
        if self.down_since is not None and now - self.down_since >= self._grace_s:
            ended = self._router.fail_all(ReplyStreamError("The request bus is unavailable.", "bus_unavailable"))
            if ended:
                log.warning("ended %d open streams: the broker has been away %.1fs", ended, now - self.down_since)
