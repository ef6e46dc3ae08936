"""aiokafka clients configured for low latency on the embedded broker.

The broker holds fetches for about half of ``fetch_max_wait_ms`` under steady
traffic, so every latency-sensitive consumer asks for a small value; group joins
wait half the session timeout, so local runs use a short one. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from tokenbus.topics.settings import BusSettings

LATENCY_FETCH_MAX_WAIT_MS = 5
GROUP_SESSION_TIMEOUT_MS = 6000
GROUP_HEARTBEAT_INTERVAL_MS = 1000


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


def make_consumer(settings: BusSettings, *topics: str, group_id: str | None = None, **overrides: Any) -> AIOKafkaConsumer:
    options: dict[str, Any] = dict(
        bootstrap_servers=settings.bootstrap_servers,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=LATENCY_FETCH_MAX_WAIT_MS,
        session_timeout_ms=GROUP_SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=GROUP_HEARTBEAT_INTERVAL_MS,
    )
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


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
