"""Reading a topic live: every partition, from its end on, one decoded record at a time; or,
``catch_up``, what the topic still holds first (read before ``start`` returns), then live.

For readers that care about what happens from now (cancels, cache reports), not about history,
or about the little a short-lived topic keeps (a GPU consumer starting learns the cancels of the
last hour, so that it does not run what was cancelled before it came).
The embedded broker's end offset can be a batch early, so such a reader must take a few records
from just before it started in its stride. A log the broker lost and created again (a restart) is
read again from its start (``rewind_recreated``). Records that do not decode are logged and
skipped: they are not this reader's to dead-letter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from tokenbus.schemas import AvroCodec, DecodeError, Record
from tokenbus.topics.clients import make_consumer, rewind_recreated, stop_reader, topic_partitions
from tokenbus.topics.pacing import FetchPacer
from tokenbus.topics.settings import BusSettings

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)
REWIND_CHECK_S = 1.0
CATCH_UP_S = 30.0


class TopicTail(Generic[R]):
    def __init__(self, settings: BusSettings, codec: AvroCodec, topic: str, record_type: type[R],
                 on_record: Callable[[R], None], name: str, catch_up: bool = False) -> None:
        self._settings = settings
        self._codec = codec
        self._topic = topic
        self._record_type = record_type
        self._on_record = on_record
        self._name = name
        self._catch_up = catch_up
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._pacer = FetchPacer(settings, background=True)

    async def start(self) -> None:
        self._consumer = make_consumer(self._settings, background=True)
        await self._consumer.start()
        self._pacer.attach(self._consumer)
        tps = await topic_partitions(self._consumer, self._topic)
        self._consumer.assign(tps)
        if self._catch_up:
            await self._read_what_is_held(tps)
        else:
            await self._consumer.seek_to_end(*tps)
        self._task = asyncio.create_task(self._read(), name=self._name)

    async def _read_what_is_held(self, tps: list[TopicPartition]) -> None:
        """Every record the topic holds now, from each partition's start to its end as it is now
        (within ``CATCH_UP_S``: a topic that cannot be read so fast is read on live)."""
        assert self._consumer is not None
        consumer = self._consumer
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        deadline = asyncio.get_running_loop().time() + CATCH_UP_S
        while asyncio.get_running_loop().time() < deadline:
            behind = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
            if not behind:
                return
            batches = await consumer.getmany(*behind, timeout_ms=500)
            for records in batches.values():
                self._handle(records)
        log.warning("%s: %s not read to its end within %.0f s; reading on live", self._name, self._topic, CATCH_UP_S)

    async def stop(self) -> None:
        await self._pacer.close()
        await stop_reader(self._task, self._consumer)

    async def _read(self) -> None:
        assert self._consumer is not None
        loop = asyncio.get_running_loop()
        check_at = loop.time() + REWIND_CHECK_S
        while True:
            if loop.time() >= check_at:
                check_at = loop.time() + REWIND_CHECK_S
                await rewind_recreated(self._consumer)
            batches = await self._consumer.getmany(timeout_ms=500)
            self._pacer.observed(sum(map(len, batches.values())))
            for records in batches.values():
                self._handle(records)

    def _handle(self, records: list[ConsumerRecord]) -> None:
        for record in records:
            try:
                decoded = self._codec.decode(record.value, self._record_type)
            except DecodeError as exc:
                log.warning("%s: undecodable record %s-%s@%s: %s", self._name, record.topic, record.partition,
                            record.offset, exc.reason)
                continue
            self._on_record(decoded)
