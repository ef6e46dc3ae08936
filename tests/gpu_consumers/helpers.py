"""A GPU consumer run in-process against the session's broker, the waits its tests share, and TensorRT-LLM's fake."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from tests.conftest import MODEL
from tokenbus.gpu_consumers.engines import SimulatedEngine, SimulatedEngineSettings
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.worker import GpuWorker
from tokenbus.topics import BusSettings, make_consumer, topic_partitions

FAKES = Path(__file__).parent.parent / "fakes"


@contextlib.contextmanager
def fake_tensorrt_llm() -> Iterator[None]:
    """``import tensorrt_llm`` finds tests/fakes/tensorrt_llm (TensorRT-LLM cannot be installed
    here) while this lasts; afterwards it is forgotten, for a real one where there is one."""
    sys.path.insert(0, str(FAKES))
    try:
        yield
    finally:
        sys.path.remove(str(FAKES))
        for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
            del sys.modules[name]


@contextlib.asynccontextmanager
async def running_worker(bus: BusSettings, max_num_seqs: int = 8, worker_id: str = "w-test",
                         engine_type: type[SimulatedEngine] = SimulatedEngine,
                         worker_settings: dict[str, Any] | None = None, **engine_settings) -> AsyncIterator[GpuWorker]:
    settings = WorkerSettings(bus=bus, model=MODEL, max_num_seqs=max_num_seqs, worker_id=worker_id,
                              **(worker_settings or {}))
    engine_settings.setdefault("ttft_ms", 1)
    engine_settings.setdefault("tokens_per_s", 1000)
    worker = GpuWorker(settings, engine_type(SimulatedEngineSettings(**engine_settings)))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), 30)
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def reading_from_the_beginning(bus: BusSettings, topic: str) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer of every partition of ``topic``, at its first record."""
    consumer = make_consumer(bus)
    await consumer.start()
    try:
        consumer.assign(await topic_partitions(consumer, topic))
        await consumer.seek_to_beginning()
        yield consumer
    finally:
        await consumer.stop()


async def read_all(bus: BusSettings, topic: str, expected: int = 10**9, timeout: float = 10.0,
                   until: Callable[[list], bool] | None = None) -> list:
    """Every record of ``topic`` from the beginning, once ``expected`` have arrived or ``until``
    holds for what has (or at the timeout)."""
    async with reading_from_the_beginning(bus, topic) as consumer:
        records = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        done = until or (lambda records: len(records) >= expected)
        finished = done(records)
        while not finished and loop.time() < deadline:
            fetched = [r for batch in (await consumer.getmany(timeout_ms=200)).values() for r in batch]
            if fetched:  # ``until`` is asked again only when there is more to look at
                records.extend(fetched)
                finished = done(records)
        return records


async def read_written(bus: BusSettings, topic: str, timeout: float = 60.0) -> list:
    """Every record written to ``topic`` before the call: read up to the end offsets it has then,
    however long that takes a busy machine (an error past ``timeout``). What a test reads to
    show that something happened only once."""
    async with reading_from_the_beginning(bus, topic) as consumer:
        ends = await consumer.end_offsets(list(consumer.assignment()))
        records = []
        deadline = asyncio.get_running_loop().time() + timeout
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            assert asyncio.get_running_loop().time() < deadline, f"{topic} not read to its end in {timeout} s"
            records.extend(r for batch in (await consumer.getmany(timeout_ms=200)).values() for r in batch)
        return records
