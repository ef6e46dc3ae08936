"""The edge's link to the bus: one producer, the request publisher and the reply router."""

from __future__ import annotations

from producers import ReplyRouter, RequestPublisher
from schemas import AvroCodec
from sse_edge.broker_watch import BrokerWatch
from sse_edge.settings import EdgeSettings
from topics import TopicCatalog, make_producer


class EdgeBus:
    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.catalog = TopicCatalog(settings.bus)
        self.codec = AvroCodec()
        self.producer = make_producer(settings.bus)
        self.publisher = RequestPublisher(self.producer, self.catalog, self.codec)
        self.router = ReplyRouter(settings.bus, settings.reply_partitions, self.codec,
                                  rotate_every_s=settings.reply_rotate_s)
        self.watch = BrokerWatch(self.producer, self.router, settings.broker_check_s, settings.broker_grace_s)

    async def start(self) -> None:
        await self.producer.start()
        await self.router.start()
        await self.watch.start()

    async def stop(self) -> None:
        await self.watch.stop()
        await self.router.stop()
        await self.producer.stop()
