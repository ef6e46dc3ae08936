"""Listen on `control` for cancels of requests this worker runs or holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer

from tokenbus.schemas import AvroCodec, Control, ControlAction, DecodeError
from tokenbus.topics import BusSettings, FetchPacer, TopicCatalog, make_consumer, rewind_recreated, stop_reader, topic_partitions

log = logging.getLogger(__name__)


class ControlListener:
    """Every worker reads every control partition: a cancel must reach whoever runs the request."""

    def __init__(self, settings: BusSettings, codec: AvroCodec, on_cancel: Callable[[str, str], None]) -> None:
        self._settings = settings
        self._codec = codec
        self._on_cancel = on_cancel
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._pacer = FetchPacer(settings, background=True)

    async def start(self) -> None:
        topic = TopicCatalog(self._settings).control
        # Cancels are rare and mostly follow a disconnect grace window of seconds.
        self._consumer = make_consumer(self._settings, background=True)
        await self._consumer.start()
        self._pacer.attach(self._consumer)
        tps = await topic_partitions(self._consumer, topic)
        self._consumer.assign(tps)
        # From about now: the embedded broker's end offset can be a batch early, and
        # re-reading a few old cancels is harmless (they name finished requests).
        await self._consumer.seek_to_end(*tps)
        self._task = asyncio.create_task(self._listen(), name="control-listener")

    async def stop(self) -> None:
        await self._pacer.close()
        await stop_reader(self._task, self._consumer)

    async def _listen(self) -> None:
        assert self._consumer is not None
        loop = asyncio.get_running_loop()
        check_at = loop.time() + 1.0
        while True:
            if loop.time() >= check_at:  # a control log re-created by a broker restart is read from its start
                check_at = loop.time() + 1.0
                await rewind_recreated(self._consumer)
            batches = await self._consumer.getmany(timeout_ms=500)
            self._pacer.observed(sum(map(len, batches.values())))
            for records in batches.values():
                for record in records:
                    try:
                        control = self._codec.decode(record.value, Control)
                    except DecodeError as exc:
                        log.warning("undecodable control record %s-%s: %s", record.partition, record.offset, exc.reason)
                        continue
                    if control.action is ControlAction.CANCEL:
                        self._on_cancel(control.request_id, control.reason)
