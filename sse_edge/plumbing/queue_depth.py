"""Queue depth per model and tier, for admission: refuse new work whose queue is too deep.

The queue of a request topic is the GPU consumer group's lag: the log end minus the group's
committed offsets. Consumers commit at the low-water mark of finished requests, so the lag
counts requests waiting and running (and, behind one long-running request, some already
finished): thresholds must leave room for what the consumers run at once. The log end comes
from fetch responses (the embedded broker's end_offsets() can be a batch short), so a reader
follows every request partition and discards what it reads; committed offsets come from a
consumer carrying the group's id that never joins the group.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer
from prometheus_client import Gauge

from tokenbus.topics import (
    BusSettings,
    FetchPacer,
    TopicCatalog,
    committed_offsets,
    make_consumer,
    stop_reader,
    topic_partitions,
)

log = logging.getLogger(__name__)

PAUSED_REFRESH_S = 5.0


class QueueDepthMonitor:
    def __init__(self, settings: BusSettings, interval_s: float = 0.5, gauge: Gauge | None = None) -> None:
        self._settings = settings
        self._gauge = gauge  # tokenbus:queue_depth{model,tier}, for dashboards and autoscalers
        self._catalog = TopicCatalog(settings)
        self._interval_s = interval_s
        self._tail: AIOKafkaConsumer | None = None
        self._committed: dict[str, AIOKafkaConsumer] = {}
        self._depth: dict[tuple[str, str], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._pacer = FetchPacer(settings, background=True)

    def depth(self, model: str, tier: str) -> int:
        return self._depth.get((model, tier), 0)

    async def start(self) -> None:
        self._tail = make_consumer(self._settings, background=True)  # depth, not latency
        await self._tail.start()
        self._pacer.attach(self._tail)
        topics = [topic for model in self._settings.models for topic in self._catalog.model_request_topics(model)]
        tps = await topic_partitions(self._tail, *topics)
        for model in self._settings.models:
            committed = make_consumer(self._settings, group_id=self._catalog.gpu_group(model))
            await committed.start()
            self._committed[model] = committed
        self._tail.assign(tps)
        await self._tail.seek_to_end(*tps)
        self._task = asyncio.create_task(self._follow(), name="queue-depth")

    async def stop(self) -> None:
        await self._pacer.close()
        await stop_reader(self._task, self._tail)
        for consumer in self._committed.values():
            await consumer.stop()

    async def _follow(self) -> None:
        assert self._tail is not None
        loop = asyncio.get_running_loop()
        refreshed_at = float("-inf")
        interval = self._interval_s
        while True:
            # Only the high-water marks matter; a record ends the wait at once.
            batches = await self._tail.getmany(timeout_ms=int(interval * 1000))
            self._pacer.observed(sum(map(len, batches.values())))
            # Nothing is published or finished while the stack is quiet (any traffic rings the
            # doorbell and wakes this reader): its committed offsets are read less often then.
            interval = PAUSED_REFRESH_S if self._pacer.paused else self._interval_s
            if loop.time() >= refreshed_at + interval:
                try:
                    await self._refresh()
                except Exception as exc:  # keep the last depths; the next refresh retries
                    log.warning("queue depth refresh failed: %s", exc)
                refreshed_at = loop.time()

    async def _refresh(self) -> None:
        assert self._tail is not None
        for model, committed in self._committed.items():
            topics = set(self._catalog.model_request_topics(model))
            tps = [tp for tp in self._tail.assignment() if tp.topic in topics]
            done = await committed_offsets(committed, tps)
            for tier in self._settings.tiers:
                topic = self._catalog.requests(model, tier)
                depth = 0
                for tp in (tp for tp in tps if tp.topic == topic):
                    end = self._tail.highwater(tp)
                    if end is not None:
                        depth += max(0, end - done[tp])
                self._depth[(model, tier)] = depth
                if self._gauge is not None:
                    self._gauge.labels(model, tier).set(depth)
