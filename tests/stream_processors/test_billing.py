"""Billing against real ClickHouse (chDB, embedded in this process), and the billing sink's
retry and dead-letter paths against the real broker."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from tests.stream_processors.helpers import read_topic
from tokenbus.schemas import AvroCodec, Completion, ModerationDecision
from tokenbus.stores.billing.clickhouse import (
    BUCKETS,
    ClickHouseSettings,
    UsageWriter,
    apply_schema,
    connect,
    mend_rollups,
    schema_statements,
)
from tokenbus.stores.billing.prices import Price, PriceTable
from tokenbus.stores.billing.report import UsageQuery, reconcile, usage_report
from tokenbus.stream_processors.billing import ClickHouseSink
from tokenbus.stream_processors.context import ProcessorContext
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import BusSettings, TopicCatalog

PRICES = PriceTable([Price("*", "*", 0.10, 0.40), Price("m", "interactive", 1.0, 2.0)])


@pytest.fixture(scope="session")
def chdb(tmp_path_factory):
    """chDB allows one data directory per process: the whole session shares this one."""
    return connect(ClickHouseSettings(url=f"chdb://{tmp_path_factory.mktemp('chdb')}"))


@pytest.fixture
def writer(chdb) -> UsageWriter:
    database = f"t_{uuid.uuid4().hex[:8]}"  # a database per test keeps them apart
    apply_schema(chdb, database)
    return UsageWriter(chdb, database, PRICES)


def completion(i: int, tenant: str = "acme", tier: str = "standard", at_ms: int | None = None) -> Completion:
    at = at_ms if at_ms is not None else int(time.time() * 1000) - i * 61_000  # spread over minutes
    return Completion(f"req-{i}", "m", tier, "text", "stop", 10 + i, 20 + i, at - 50, at - 40, at, tenant=tenant)


def test_prices_pick_the_most_specific_entry():
    assert PRICES.price("m", "interactive").input_usd_per_mtok == 1.0
    assert PRICES.price("m", "batch").input_usd_per_mtok == 0.10
    assert PRICES.cost_nanousd("m", "interactive", 1_000_000, 1) == (1_000_000_000, 2_000)
    assert PriceTable([]).cost_nanousd("m", "t", 5, 5) == (0, 0)


def test_cached_prompt_tokens_are_priced_at_their_own_rate():
    prices = PriceTable([Price("*", "*", 1.0, 4.0, cached_input_usd_per_mtok=0.25), Price("m", "batch", 1.0, 4.0)])
    # 1,000 prompt tokens, 600 of them cached: 400 at $1/Mtok + 600 at $0.25/Mtok.
    assert prices.cost_nanousd("x", "standard", 1_000, 10, cached_prompt_tokens=600) == (400_000 + 150_000, 40_000)
    # An entry with no cached price charges cached tokens as input; cached never exceeds the prompt.
    assert prices.cost_nanousd("m", "batch", 1_000, 0, cached_prompt_tokens=600) == (1_000_000, 0)
    assert prices.cost_nanousd("x", "standard", 100, 0, cached_prompt_tokens=500) == (25_000, 0)


def test_cached_prompt_tokens_reach_the_rows_and_every_rollup(writer):
    morning = 1_795_000_000_000  # 2026-11-18 11:06:40 UTC: the four minutes before it are one day
    batch = [completion(i, at_ms=morning - i * 61_000) for i in range(4)]
    for c in batch:
        c.cached_prompt_tokens = 8
    writer.write(batch)
    totals = reconcile(writer.client, writer.database)
    assert totals["consistent"]
    (row,) = totals["raw"]
    assert row["cached_prompt_tokens"] == 32
    assert row["input_cost_nanousd"] == sum(10 + i - 8 for i in range(4)) * 100 + 32 * 100  # no cached price: input's
    (day,) = usage_report(writer.client, writer.database, UsageQuery(bucket="day"))["rows"]
    assert day["cached_prompt_tokens"] == 32


def test_tables_made_before_cached_tokens_are_upgraded_in_place(chdb):
    """A store created by the previous schema (no cached column, rollup views without it) gets the
    column and views that sum it when the schema is applied again; rows already there stay."""
    database = f"t_{uuid.uuid4().hex[:8]}"
    statements = [st.replace("  cached_prompt_tokens UInt32 DEFAULT 0,\n", "").replace(
        "  cached_prompt_tokens UInt64 DEFAULT 0,\n", "").replace("  sum(cached_prompt_tokens) AS cached_prompt_tokens,\n", "")
        for st in schema_statements(database) if "cached" not in st or "CREATE" in st]
    for statement in statements:
        chdb.command(statement)
    assert "cached_prompt_tokens" not in chdb.command(f"SHOW CREATE TABLE {database}.usage_events")
    chdb.command(f"INSERT INTO {database}.usage_events (request_id, tenant, model, tier, prompt_tokens, finished_at, "
                 f"created_at, started_at) VALUES ('old', 'acme', 'm', 'standard', 5, now64(3), now64(3), now64(3))")
    apply_schema(chdb, database)
    writer = UsageWriter(chdb, database, PRICES)
    new = completion(1)
    new.cached_prompt_tokens = 4
    writer.write([new])
    totals = reconcile(chdb, database)
    assert totals["consistent"] and totals["raw_rows"] == 2
    (row,) = totals["raw"]
    assert (row["prompt_tokens"], row["cached_prompt_tokens"]) == (5 + 11, 4)


def test_default_price_file_loads():
    table = PriceTable.load()
    assert table.price("any-model", "batch").output_usd_per_mtok < table.price("any-model", "interactive").output_usd_per_mtok
    standard = table.price("any-model", "standard")
    assert standard.cached_input_usd < standard.input_usd_per_mtok


def test_each_request_is_billed_once_however_often_it_arrives(writer):
    batch = [completion(i) for i in range(20)]
    assert writer.write(batch) == 20
    assert writer.write(batch) == 0  # a replay
    assert writer.write(batch[:5] + batch[:5]) == 0  # duplicates inside one batch
    totals = reconcile(writer.client, writer.database)
    assert totals["raw_rows"] == 20 and totals["consistent"]
    (row,) = totals["raw"]
    assert row["requests"] == 20
    assert row["prompt_tokens"] == sum(10 + i for i in range(20))
    assert row["output_cost_nanousd"] == sum(20 + i for i in range(20)) * 400


def test_rollups_equal_the_raw_rows_per_bucket(writer):
    writer.write([completion(i, tenant=t, tier=tier) for i in range(30)
                  for t, tier in (("a", "standard"), ("b", "interactive"))][:45])
    totals = reconcile(writer.client, writer.database)
    assert totals["consistent"]
    for bucket in ("minute", "hour", "day"):
        assert totals[bucket] == totals["raw"]
    minutes = usage_report(writer.client, writer.database, UsageQuery(bucket="minute", tenant="b"))["rows"]
    assert {r["tenant"] for r in minutes} == {"b"} and len(minutes) > 1
    assert sum(r["requests"] for r in minutes) == sum(r["requests"] for r in totals["raw"] if r["tenant"] == "b")


def test_rollups_that_lost_an_insert_cut_short_are_mended_from_the_raw_rows(writer):
    """A stop between ``usage_events`` and its views is made here by detaching the views for
    one insert: the raw rows land, their rollups do not (as after a SIGKILL of chDB's process)."""
    db = writer.database
    writer.write([completion(i) for i in range(10)])
    for bucket in BUCKETS:
        writer.client.command(f"DETACH TABLE {db}.usage_{bucket}_mv")
    writer.write([completion(i) for i in range(10, 16)] + [completion(i, tenant="new") for i in range(16, 20)])
    for bucket in BUCKETS:
        writer.client.command(f"ATTACH TABLE {db}.usage_{bucket}_mv")
    assert not reconcile(writer.client, db)["consistent"]

    assert mend_rollups(writer.client, db) == {f"{db}.usage_{bucket}": 10 for bucket in BUCKETS}
    totals = reconcile(writer.client, db)
    assert totals["consistent"] and sum(row["requests"] for row in totals["raw"]) == 20
    assert mend_rollups(writer.client, db) == {f"{db}.usage_{bucket}": 0 for bucket in BUCKETS}  # nothing twice
    writer.write([completion(20)])  # and the views go on as before
    assert reconcile(writer.client, db)["consistent"]


def test_a_rollup_holding_more_than_the_raw_rows_is_left_alone(writer):
    writer.write([completion(0)])
    writer.client.command(f"INSERT INTO {writer.database}.usage_minute (bucket, tenant, model, tier, requests) "
                          "SELECT now(), 'acme', 'm', 'standard', 1")
    assert mend_rollups(writer.client, writer.database)[f"{writer.database}.usage_minute"] == 0


def test_report_filters(writer):
    writer.write([completion(0, tenant="a"), completion(1, tenant="b", tier="batch")])
    def rows(**filters):
        return usage_report(writer.client, writer.database, UsageQuery(bucket="day", **filters))["rows"]
    assert {r["tenant"] for r in rows()} == {"a", "b"}
    assert [r["tenant"] for r in rows(tier="batch")] == ["b"]
    assert rows(model="other") == []
    with pytest.raises(ValueError):
        UsageQuery(bucket="week")


def test_moderation_decisions_are_stored(writer):
    decisions = [ModerationDecision(f"r{i}", "input", "block", tenant="a", categories=["jailbreak"],
                                    scores={"jailbreak": 1.0}) for i in range(3)]
    assert writer.write_decisions(decisions) == 3
    result = writer.client.query(f"SELECT count(), any(categories) FROM {writer.database}.moderation_decisions")
    assert result.result_rows == [(3, ["jailbreak"])]


class FlakyWriter:
    """Stands in for ClickHouse being away: the first ``failures`` calls raise a connection error."""

    def __init__(self, real: UsageWriter, failures: int) -> None:
        self.real, self.failures, self.calls = real, failures, 0

    def write(self, completions):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionRefusedError("clickhouse is down")
        return self.real.write(completions)


def messages_of(records: list, topic: str = "tokenbus.completions") -> list:
    codec = AvroCodec()
    return [SimpleNamespace(topic=topic, partition=0, offset=i, key=r.request_id.encode(), headers=[],
                            value=codec.encode(r) if not isinstance(r, bytes) else r) for i, r in enumerate(records)]


async def test_a_batch_waits_for_clickhouse_and_lands_exactly_once(writer, bus: BusSettings):
    ctx = ProcessorContext(ProcessorSettings(bus=bus, retry_max_delay_s=0.05))
    flaky = FlakyWriter(writer, failures=3)
    sink = ClickHouseSink(ctx, lambda: flaky)
    try:
        decoded, written = await sink.write_batch("bill-usage", messages_of([completion(i) for i in range(5)]),
                                                  Completion, lambda w, records: w.write(records))
    finally:
        await ctx.stop()
    assert (decoded, written, flaky.calls) == (5, 5, 4)
    assert ctx.metrics.retries.labels("bill-usage")._value.get() == 3
    assert reconcile(writer.client, writer.database)["raw_rows"] == 5


async def test_undecodable_and_rejected_records_go_to_dlq_and_the_rest_is_billed(writer, bus: BusSettings):
    ctx = ProcessorContext(ProcessorSettings(bus=bus))

    def write(w: UsageWriter, records: list[Completion]) -> int:
        if any(r.request_id == "req-2" for r in records):
            raise ValueError("ClickHouse refused the row")  # not transient: find the culprit, dead-letter it
        return w.write(records)

    good = [completion(i) for i in range(4)]
    messages = messages_of(good) + [SimpleNamespace(topic="tokenbus.completions", partition=0, offset=99, headers=[],
                                                    key=b"junk", value=b"junk")]
    sink = ClickHouseSink(ctx, lambda: writer)
    try:
        decoded, written = await sink.write_batch("bill-usage", messages, Completion, write)
    finally:
        await ctx.stop()
    assert (decoded, written) == (4, 3)
    dlq = await read_topic(bus, TopicCatalog(bus).dlq)
    reasons = sorted(dict(r.headers)["tokenbus.dlq.reason"].decode() for r in dlq)
    assert reasons == ["store_rejected", "truncated"]
    assert reconcile(writer.client, writer.database)["raw_rows"] == 3


async def test_the_sink_connects_at_start_and_a_store_away_then_is_tried_again_on_the_first_batch(writer, bus):
    ctx = ProcessorContext(ProcessorSettings(bus=bus))
    made: list[UsageWriter] = []

    def factory() -> UsageWriter:
        made.append(writer)
        if len(made) == 1:
            raise ConnectionRefusedError("clickhouse is down")
        return writer

    sink = ClickHouseSink(ctx, factory)
    try:
        await sink.warm()  # the store is away: ready anyway, it connects when there is work
        assert sink.warmed.is_set() and len(made) == 1
        decoded, written = await sink.write_batch("bill-usage", messages_of([completion(1)]), Completion,
                                                  lambda w, records: w.write(records))
        assert (decoded, written, len(made)) == (1, 1, 2)

        connected = ClickHouseSink(ctx, factory)
        await connected.warm()
        assert connected.warmed.is_set() and len(made) == 3  # connected at start, before any batch
        await connected.write_batch("bill-usage", messages_of([completion(2)]), Completion,
                                    lambda w, records: w.write(records))
        assert len(made) == 3  # the batch used that connection
    finally:
        await ctx.stop()
