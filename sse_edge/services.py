"""Everything one edge process holds: the bus, Redis, keys, limits, stream records, queue depths."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis

from schemas import Control, ControlAction
from sse_edge.admission import QueueDepthMonitor
from sse_edge.auth import Authenticator
from sse_edge.bus import EdgeBus
from sse_edge.keys import KeyStore
from sse_edge.metrics import EdgeMetrics
from sse_edge.ratelimit import RateLimiter
from sse_edge.settings import EdgeSettings
from sse_edge.streams import StreamRegistry
from stream_processors.transcripts.store import TranscriptStore, open_store

log = logging.getLogger(__name__)


class EdgeServices:
    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.bus = EdgeBus(settings)
        self.redis = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
        self.keys = KeyStore(self.redis, settings.redis_prefix)
        self.auth = Authenticator(self.keys, settings.key_cache_ttl_s)
        self.limiter = RateLimiter(self.redis, settings.redis_prefix, settings.redis_failure_mode)
        self.streams = StreamRegistry(self.redis, settings.redis_prefix, settings.stream_ttl_s)
        self.queues = QueueDepthMonitor(settings.bus)
        self.metrics = EdgeMetrics()
        self._background: set[asyncio.Task[None]] = set()
        self._transcripts: TranscriptStore | None = None

    def transcripts(self) -> TranscriptStore:
        """Opened on first read: an edge that serves no transcript reads needs no store."""
        if self._transcripts is None:
            self._transcripts = open_store(self.settings.transcripts)
        return self._transcripts

    async def start(self) -> None:
        await self.bus.start()
        await self.queues.start()

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.queues.stop()
        await self.bus.stop()
        await self.redis.aclose()
        if self._transcripts is not None:
            await self._transcripts.close()

    def in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def cancel_generation(self, request_id: str, reason: str) -> None:
        control = Control(request_id, ControlAction.CANCEL, reason)
        delivery = await self.bus.producer.send(self.bus.catalog.control, self.bus.codec.encode(control),
                                                key=request_id.encode())
        await delivery

    async def cancel_unless_resumed(self, request_id: str) -> None:
        """After a client went away: wait out the grace window, then cancel unless it came back."""
        grace = self.settings.disconnect_grace_s
        try:
            await self.streams.detach(request_id, grace)
            await asyncio.sleep(grace)
            resumed = not await self.streams.still_detached(request_id)
        except (redis.RedisError, OSError):
            await asyncio.sleep(grace)
            resumed = False  # cannot tell without Redis: stop the work nobody may want
        if not resumed:
            await self.cancel_generation(request_id, "client went away")
            self.metrics.cancelled.inc()
