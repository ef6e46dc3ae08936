"""Stream processors under faults: a SIGKILL or a SIGTERM mid-batch, and ClickHouse away for a while.
Either way every completion ends up billed exactly once, written to its transcript exactly once
and, where it answers a request of a batch (the Batch API), counted in its batch exactly once.
(`make faults` repeats each case TOKENBUS_FAULT_RUNS times.)"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
import uuid

import pytest

from tests.faults.conftest import FAULT_RUNS
from tests.stream_processors.helpers import Processors, eventually
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.schemas import AvroCodec, ChatMessage, Completion
from tokenbus.stores.batches import (
    BATCH,
    BATCH_LINE,
    CUSTOM_ID,
    IN_PROGRESS,
    Batch,
    BatchStore,
    batch_request_id,
    new_batch_id,
)
from tokenbus.stores.redis_client import redis_client
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import TopicCatalog, make_consumer, make_producer, topic_partitions

pytestmark = pytest.mark.stack
CODEC = AvroCodec()


def completions(tenant: str, count: int, start: int = 0, batch_id: str = "") -> list[Completion]:
    """Completions of ``tenant``'s requests; with ``batch_id``, each answers that batch's line ``i``
    (its request id is the line's, as an edge names it)."""
    at = int(time.time() * 1000)
    return [Completion(batch_request_id(batch_id, i) if batch_id else f"{tenant}-{i}", "tokenbus-sim", "standard",
                       f"answer {i}", "stop", 7, i % 50 + 1, at, at, at + 10, tenant=tenant,
                       messages=[ChatMessage("user", f"question {i}")],
                       annotations={BATCH: batch_id, BATCH_LINE: str(i), CUSTOM_ID: f"q{i}"} if batch_id else {})
            for i in range(start, start + count)]


async def batch_of(store: BatchStore, tenant: str, total: int) -> str:
    """A batch of ``total`` requests, in progress (as an edge makes one)."""
    now = int(time.time())
    batch = Batch(new_batch_id(), tenant, "/v1/chat/completions", "file-x", "24h", IN_PROGRESS, now, now + 86_400,
                  total=total)
    await store.create(batch)
    return batch.id


async def publish(stack: EmbeddedStack, records: list[Completion]) -> None:
    producer = make_producer(stack.bus_settings(), linger_ms=5)
    await producer.start()
    try:
        topic = TopicCatalog(stack.bus_settings()).completions
        deliveries = [await producer.send(topic, CODEC.encode(r), key=r.request_id.encode()) for r in records]
        await asyncio.gather(*deliveries)
    finally:
        await producer.stop()


def transcript_rows(stack: EmbeddedStack, tenant: str) -> int:
    if not stack.transcripts_path.exists():
        return 0
    with sqlite3.connect(stack.transcripts_path) as db:
        return db.execute("SELECT count(*) FROM messages_by_conversation WHERE tenant = ?", (tenant,)).fetchone()[0]


async def committed_completions(stack: EmbeddedStack) -> int:
    """How many records of `completions` the processors' group has committed, all partitions."""
    bus = stack.bus_settings()
    group = ProcessorSettings(bus=bus).group_id
    reader = make_consumer(bus, group_id=group)  # carries the group id, joins nothing (manual assignment)
    await reader.start()
    try:
        tps = await topic_partitions(reader, TopicCatalog(bus).completions)
        return sum([await reader.committed(tp) or 0 for tp in tps])
    finally:
        await reader.stop()


async def billed(processors: Processors, tenant: str) -> dict:
    totals = await processors.totals()
    rows = [r for r in totals["raw"] if r["tenant"] == tenant]
    return {"requests": rows[0]["requests"] if rows else 0, "completion_tokens": rows[0]["completion_tokens"] if rows else 0,
            "consistent": totals["consistent"]}


async def settle_exactly(side: EmbeddedStack, tenant: str, records: list[Completion]) -> None:
    processors = Processors(side.processors_url)
    want = {"requests": len(records), "completion_tokens": sum(r.completion_tokens for r in records),
            "consistent": True}

    async def done():
        return await billed(processors, tenant) == want and transcript_rows(side, tenant) == 2 * len(records)

    await eventually(done, timeout=90, interval=0.5)
    await asyncio.sleep(2.0)  # and nothing more arrives late (a replay after the restart)
    assert await billed(processors, tenant) == want
    assert transcript_rows(side, tenant) == 2 * len(records)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("run", range(FAULT_RUNS))
async def test_stopped_mid_batch_loses_and_doubles_nothing(side_stack, run, sig):
    """SIGKILL: the offsets of what it just did are not committed, and it is done again (the
    stores deduplicate). SIGTERM: it stops its agents, commits what every job finished and leaves
    within its grace. Both jobs read `completions` in one group, so the commit is where the slower
    one is: a billing batch still being gathered is not committed and is billed by the next one."""
    tenant = f"{sig.name.lower()}-{uuid.uuid4().hex[:6]}"
    processors = Processors(side_stack.processors_url)
    side_stack.start_processors("processors", side_stack.settings.processors_port)
    redis = redis_client(side_stack.settings.redis_url)
    batches = BatchStore(redis, side_stack.settings.redis_prefix)
    batch_id = await batch_of(batches, tenant, 800)
    first, rest = completions(tenant, 400, batch_id=batch_id), completions(tenant, 400, start=400, batch_id=batch_id)
    await publish(side_stack, first)

    async def halfway():
        return await processors.metric("tokenbus:processor_events_total", processor="write-transcripts") >= 100
    await eventually(halfway, timeout=60, interval=0.05)
    side_stack.processes["processors"].signal(sig)
    exit_code = side_stack.processes["processors"].popen.wait(30)
    if sig == signal.SIGTERM:
        assert exit_code in (0, -signal.SIGTERM), side_stack.processes["processors"].log_tail()
        # It committed on the way out, and nothing it had not written: the next one starts there.
        assert 0 < await committed_completions(side_stack) * 2 <= transcript_rows(side_stack, tenant)

    await publish(side_stack, rest)  # arrives while no processor runs
    side_stack.start_processors("processors", side_stack.settings.processors_port)
    await settle_exactly(side_stack, tenant, first + rest)
    batch = await batches.get(tenant, batch_id)
    assert (batch.completed, batch.failed) == (800, 0)  # each line once, however often it was read
    outcomes = await batches.outcomes(batch_id)
    assert sorted(outcomes) == list(range(800)) and outcomes[799]["text"] == "answer 799"
    await redis.aclose()


@pytest.mark.parametrize("run", range(FAULT_RUNS))
async def test_billing_waits_while_clickhouse_is_away_then_lands_exactly_once(side_stack, run):
    """ClickHouse cannot be opened for a while (embedded, its directory's path is taken by a
    file; a server would refuse connections alike): billing retries with backoff while
    transcripts carry on; once it can be opened, every row lands once. Failures of a
    connected client mid-batch are covered with real chDB in tests/stream_processors/test_billing.py."""
    tenant = f"away-{uuid.uuid4().hex[:6]}"
    side_stack.clickhouse_path.parent.mkdir(parents=True, exist_ok=True)
    side_stack.clickhouse_path.write_text("not a ClickHouse directory")
    side_stack.start_processors("processors", side_stack.settings.processors_port)
    processors = Processors(side_stack.processors_url)
    records = completions(tenant, 200)
    await publish(side_stack, records)

    async def transcripts_written():
        return transcript_rows(side_stack, tenant) == 400

    await eventually(transcripts_written, timeout=60)
    await eventually(lambda: processors.metric("tokenbus:processor_retries_total", processor="bill-usage"))
    await asyncio.sleep(1.0)
    assert await processors.metric("tokenbus:billing_usage_rows_total") == 0

    side_stack.clickhouse_path.unlink()  # ClickHouse is back
    await settle_exactly(side_stack, tenant, records)
