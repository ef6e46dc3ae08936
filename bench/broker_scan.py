"""Scenario 10, the embedded broker's scan: why reply partitions rotate.

tansu's memory storage lists every record batch of a partition on each fetch that has data
to return, and a fetch whose scan outlasts ``fetch_max_wait_ms`` comes back empty. This fills
one partition with single-record batches (what a token stream writes: one batch per engine
step) and times a fetch of its last records, at each consumer fetch wait tokenbus could use.
Not in the default `make bench`: it measures the broker, not tokenbus."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tokenbus.infra.devstack.broker import broker_argv
from tokenbus.infra.devstack.processes import free_port, port_open

BATCH_COUNTS = (2_000, 8_000, 16_000, 32_000, 64_000)
FETCH_WAITS_MS = (5, 20, 50)
GIVE_UP_S = 3.0
TOPIC = "scan"


async def tail_fetch_ms(bootstrap: str, tp: TopicPartition, wait_ms: int, repeats: int = 5) -> float | None:
    """Median time to fetch the last few records; None when a fetch returns nothing in GIVE_UP_S."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=wait_ms)
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        times = []
        for _ in range(repeats):
            consumer.seek(tp, max(0, end - 5))
            started = time.perf_counter()
            if not (await consumer.getmany(tp, timeout_ms=int(GIVE_UP_S * 1000))).get(tp):
                return None
            times.append((time.perf_counter() - started) * 1000)
        return round(statistics.median(times), 1)
    finally:
        await consumer.stop()


async def measure(bootstrap: str) -> list[dict[str, Any]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(TOPIC, 1, 1)])
    await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    await producer.start()
    tp, stored, rows = TopicPartition(TOPIC, 0), 0, []
    try:
        for target in BATCH_COUNTS:
            started = time.perf_counter()
            while stored < target:  # one record per batch: each send is acknowledged before the next
                await (await producer.send(TOPIC, b"t" * 64, partition=0))
                stored += 1
            row: dict[str, Any] = {"batches": target}
            for wait in FETCH_WAITS_MS:
                row[f"wait_{wait}_ms"] = await tail_fetch_ms(bootstrap, tp, wait)
            rows.append(row)
            print(f"  {target} batches stored ({time.perf_counter() - started:.0f} s): {row}", flush=True)
    finally:
        await producer.stop()
    return rows


def run() -> dict[str, Any]:
    port = free_port()
    broker = subprocess.Popen(broker_argv("127.0.0.1", port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", port):
            if time.monotonic() > deadline:
                raise RuntimeError("the broker did not start")
            time.sleep(0.05)
        rows = asyncio.run(measure(f"127.0.0.1:{port}"))
    finally:
        broker.kill()
        broker.wait()
    return {"scenario": "broker_scan", "rows": rows, "give_up_s": GIVE_UP_S}


def table(result: dict[str, Any]) -> str:
    head = " | ".join(f"fetch wait {w} ms" for w in FETCH_WAITS_MS)
    lines = [f"| batches in the partition | {head} |", "|---:|" + "---:|" * len(FETCH_WAITS_MS)]
    for row in result["rows"]:
        cells = " | ".join("nothing" if row[f"wait_{w}_ms"] is None else f"{row[f'wait_{w}_ms']} ms"
                           for w in FETCH_WAITS_MS)
        lines.append(f"| {row['batches']:,} | {cells} |")
    give_up = f"{result['give_up_s']:.0f} s"
    return "\n".join(lines) + f"\n\n(ms: median time to fetch the last records; nothing: no record in {give_up})"
