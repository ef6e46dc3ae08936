"""What the express-lane tests share (tests/topics/test_express_lane.py, the lane and its readers;
tests/gpu_consumers/test_hand_overs.py, the GPU consumer's hand-overs): the bus as the embedded
profile sees it, and a listener for what is handed over."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as redis

from tokenbus.schemas import AvroCodec
from tokenbus.topics import BusSettings
from tokenbus.topics.doorbell import Handed, express_channel, listen_express

codec = AvroCodec()


@contextlib.asynccontextmanager
async def handed_over(settings: BusSettings, topics_starting: str) -> AsyncIterator[list[Handed]]:
    """What is handed over on the express lanes of topics whose names start with ``topics_starting``."""
    assert settings.doorbell_url
    got: list[Handed] = []
    probe, listening = topics_starting + "~listening", asyncio.Event()

    def heard(handed: Handed) -> None:
        if handed.topic == probe:
            listening.set()
        else:
            got.append(handed)

    client = redis.Redis.from_url(settings.doorbell_url)
    task = asyncio.create_task(listen_express(settings.doorbell_url, topics_starting, heard))
    try:
        for _ in range(500):  # listening once a probe of its own comes back
            await client.publish(express_channel(probe), bytes(16))  # partition, offset, an empty key
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listening.wait(), 0.01)
            if listening.is_set():
                break
        assert listening.is_set(), "the test's express listener never subscribed"
        yield got
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
