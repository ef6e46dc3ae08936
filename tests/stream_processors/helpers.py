"""Reading the stack's topics and the processors' web pages from tests."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from aiokafka import ConsumerRecord

from tokenbus.topics import BusSettings, make_consumer, make_producer, topic_partitions

T = TypeVar("T")


async def read_topic(bus: BusSettings, topic: str, idle_polls: int = 3) -> list[ConsumerRecord]:
    """Every record of ``topic`` (read until the partitions stay quiet: end offsets are unreliable here)."""
    consumer = make_consumer(bus)
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, topic)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[ConsumerRecord] = []
        quiet = 0
        while quiet < idle_polls:
            batch = await consumer.getmany(timeout_ms=200)
            got = [r for rs in batch.values() for r in rs]
            quiet = 0 if got else quiet + 1
            records += got
        return records
    finally:
        await consumer.stop()


async def produce(bus: BusSettings, topic: str, value: bytes, key: bytes, partition: int | None = None,
                  headers: list | None = None) -> tuple[int, int]:
    """Publish one record; returns (partition, offset)."""
    producer = make_producer(bus)
    await producer.start()
    try:
        meta = await (await producer.send(topic, value, key=key, partition=partition, headers=headers))
        return meta.partition, meta.offset
    finally:
        await producer.stop()


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 20.0, interval: float = 0.2) -> T:
    """Poll until ``check`` returns something truthy; fail with its last answer."""
    deadline = time.monotonic() + timeout
    result = await check()
    while not result and time.monotonic() < deadline:
        await asyncio.sleep(interval)
        result = await check()
    assert result, f"not true within {timeout}s: {result!r}"
    return result


class Processors:
    """The processors' own pages: /usage (billing, from ClickHouse) and /metrics."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def get(self, path: str, **params: str) -> Any:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(f"{self.url}{path}", params=params)
        response.raise_for_status()
        return response.json() if path != "/metrics" else response.text

    async def usage_rows(self, request_id: str) -> list[dict]:
        return (await self.get("/usage", request_id=request_id))["rows"]

    async def totals(self) -> dict:
        return await self.get("/usage", check="1")

    async def metric(self, name: str, **labels: str) -> float:
        text = await self.get("/metrics")
        selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            match = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
            if match and all(part in (match.group(1) or "") for part in selector.split(",") if part):
                total += float(match.group(2))
        return total
