"""Billing's ClickHouse side: connecting (chDB embedded or a server), the schema from
``stores/billing/schema.sql``, and writing usage and moderation rows exactly once.

Exactly once, without transactions: completions are keyed by request id, so one
request always lands on the same partition and so on one billing consumer. Before each
insert the writer asks which of the batch's request ids are stored already and inserts
only the others; a replay or a crash before the offsets were committed finds its rows
there and adds nothing. The rollups are materialized views over inserts, so they see
each request once too.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.schemas import Completion, ModerationDecision
from tokenbus.stores.billing.prices import PriceTable
from tokenbus.stores.ddl import ddl_statements

log = logging.getLogger(__name__)

BUCKETS = ("minute", "hour", "day")
ROLLUP_KEY = ["bucket", "tenant", "model", "tier"]
ROLLUP_SUMS = ["requests", "cancelled", "prompt_tokens", "completion_tokens", "cached_prompt_tokens",
               "input_cost_nanousd", "output_cost_nanousd"]
USAGE_COLUMNS = [
    "request_id", "tenant", "key_id", "model", "tier", "conversation_id", "prompt_tokens", "completion_tokens",
    "cached_prompt_tokens", "input_cost_nanousd", "output_cost_nanousd", "finish_reason", "cancelled", "error", "worker_id",
    "created_at", "started_at", "first_token_at", "finished_at",
]
MODERATION_COLUMNS = ["request_id", "tenant", "model", "tier", "stage", "action", "categories", "scores", "seq",
                      "policy", "decided_at"]


class ClickHouseSettings(BaseSettings):
    """``TOKENBUS_CLICKHOUSE_*``. ``url`` is ``chdb://DIR`` (embedded) or ``http(s)://user:pass@host:port``."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_CLICKHOUSE_", extra="ignore")

    url: str = "chdb://.run/clickhouse"
    database: str = "tokenbus"

    @property
    def embedded_path(self) -> Path | None:
        return Path(self.url.removeprefix("chdb://")) if self.url.startswith("chdb://") else None


class ClickHouseUnavailable(ConnectionError):
    """No client could be made: the server is down, or another process holds chDB's directory."""


def connect(settings: ClickHouseSettings) -> Any:
    """A clickhouse-connect client. chDB allows one process per data directory."""
    import clickhouse_connect

    _without_pandas()
    try:
        if settings.embedded_path is not None:
            settings.embedded_path.mkdir(parents=True, exist_ok=True)
            return clickhouse_connect.get_client(interface="chdb", path=str(settings.embedded_path))
        url = urlparse(settings.url)
        return clickhouse_connect.get_client(
            interface=url.scheme or "http", host=url.hostname or "127.0.0.1", port=url.port or 8123,
            username=url.username or "default", password=url.password or "",
        )
    except Exception as exc:  # the driver raises several types for "cannot connect"
        raise ClickHouseUnavailable(f"cannot open ClickHouse at {settings.url}: {exc}") from exc


def _without_pandas() -> None:
    """clickhouse-connect imports pandas on its first insert (0.2 s of CPU and ~45 MiB) only to ask
    whether the rows are a DataFrame; these writers pass lists. Unless the process has pandas
    already, the driver is told there is none (it then treats rows as rows, as it does without
    pandas installed); nothing here reads DataFrames."""
    from clickhouse_connect.driver import options

    if "pandas" not in sys.modules:
        vars(options).setdefault("pd", None)
        vars(options).setdefault("pd_time_test", None)


MATERIALIZED_VIEW = re.compile(r"CREATE MATERIALIZED VIEW IF NOT EXISTS (\S+) TO (\S+) AS\s+(.*)", re.DOTALL)


def schema_statements(database: str) -> list[str]:
    """schema.sql for ``database``, a statement per rollup bucket where it says ``{bucket}``; each
    view is created if missing and given its query if not (a view made by an older schema)."""
    out = []
    for statement in ddl_statements("tokenbus.stores.billing", "schema.sql"):
        variants = [statement]
        if "{bucket}" in statement:
            variants = [statement.replace("{bucket}", b).replace("{Bucket}", b.capitalize()) for b in BUCKETS]
        for variant in variants:
            out.append(variant.replace("{db}", database))
            view = MATERIALIZED_VIEW.match(out[-1])
            if view is not None:
                out.append(f"ALTER TABLE {view[1]} MODIFY QUERY {view[3]}")
    return out


def apply_schema(client: Any, database: str) -> None:
    for statement in schema_statements(database):
        client.command(statement)


def rollup_views(database: str) -> dict[str, str]:
    """Each rollup table and the query its view sums the raw rows with (schema.sql is their home)."""
    views = (MATERIALIZED_VIEW.match(statement) for statement in schema_statements(database))
    return {view[2]: view[3] for view in views if view is not None}


def mend_rollups(client: Any, database: str) -> dict[str, int]:
    """Add to each rollup the requests of raw rows it lacks; returns how many per rollup.

    A materialized view is ClickHouse's insert trigger, not a transaction: an insert stopped
    between ``usage_events`` and its views (the ClickHouse process killed, which for chDB is
    this process) keeps the raw rows and loses their rollups, and the replay after it finds the
    request ids stored and adds nothing. Such an insert is the last one before the stop, so the
    buckets to compare are those of the rows inserted in the hour before the newest one; each is
    compared whole (a day of raw rows at most per bucket) and given the difference. A bucket
    whose rollup holds more than the raw rows is left alone (a sum cannot be taken back).

    Only for a writer that is ClickHouse's only one, as chDB's process is: with other writers
    inserting, their rows between table and view would be added twice."""
    recent = (f"FROM {database}.usage_events WHERE inserted_at >= "
              f"(SELECT max(inserted_at) FROM {database}.usage_events) - INTERVAL 1 HOUR")
    span = (f"WITH (SELECT toStartOfDay(min(finished_at)) {recent}) AS lo, "  # whole days: whole buckets
            f"(SELECT toStartOfDay(max(finished_at)) + INTERVAL 1 DAY {recent}) AS hi ")
    raw = f"(SELECT * FROM {database}.usage_events FINAL WHERE finished_at >= lo AND finished_at < hi)"
    mended = {}
    for table, view in rollup_views(database).items():
        summed = view.replace(f"FROM {database}.usage_events", f"FROM {raw}")
        if summed == view:  # schema.sql changed how its views read the raw rows
            raise RuntimeError(f"the view of {table} does not read FROM {database}.usage_events")
        from_raw = f"SELECT * REPLACE (toDateTime(bucket, 'UTC') AS bucket) FROM ({summed})"  # the table's type
        in_rollup = (f"SELECT {', '.join(ROLLUP_KEY)}, {', '.join(f'sum({c}) AS {c}' for c in ROLLUP_SUMS)} "
                     f"FROM {table} WHERE bucket >= lo AND bucket < hi GROUP BY {', '.join(ROLLUP_KEY)}")
        rows = client.query(
            f"{span} SELECT {', '.join(f'r.{c}' for c in ROLLUP_KEY)}, {', '.join(f'r.{c} - s.{c}' for c in ROLLUP_SUMS)} "
            f"FROM ({from_raw}) AS r LEFT JOIN ({in_rollup}) AS s USING ({', '.join(ROLLUP_KEY)}) "
            f"WHERE r.requests > s.requests AND {' AND '.join(f'r.{c} >= s.{c}' for c in ROLLUP_SUMS)}"
        ).result_rows
        if rows:
            client.insert(table, rows, column_names=ROLLUP_KEY + ROLLUP_SUMS)
        mended[table] = sum(row[len(ROLLUP_KEY)] for row in rows)
    return mended


def _time(ms: int | None) -> dt.datetime | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def usage_row(completion: Completion, prices: PriceTable) -> list[Any]:
    c = completion
    generated = c.billed_completion_tokens  # a continuation's carried tokens were billed with its turn
    prompt, cached = c.billed_prompt_tokens  # none for a choice whose prompt another choice bills
    input_cost, output_cost = prices.cost_nanousd(c.model, c.tier, prompt, generated, cached)
    return [c.request_id, c.tenant, c.key_id, c.model, c.tier, c.conversation_id or "", prompt,
            generated, cached, input_cost, output_cost, c.finish_reason,
            c.cancelled, c.error or "", c.worker_id,
            _time(c.created_at_ms), _time(c.started_at_ms), _time(c.first_token_at_ms), _time(c.finished_at_ms)]


class UsageWriter:
    """Synchronous (clickhouse-connect is); the billing agent calls it from a worker thread."""

    def __init__(self, client: Any, database: str, prices: PriceTable) -> None:
        self.client = client
        self.database = database
        self.prices = prices

    @classmethod
    def open(cls, settings: ClickHouseSettings, prices: PriceTable) -> UsageWriter:
        """Connected, the schema applied, the prices loaded; with chDB, whose only writer this
        process is, the rollups are mended first (``mend_rollups``)."""
        client = connect(settings)
        apply_schema(client, settings.database)
        if settings.embedded_path is not None:
            mended = mend_rollups(client, settings.database)
            if any(mended.values()):
                log.warning("billing: rollups lacked requests of an insert cut short by a stop; added %s", mended)
        writer = cls(client, settings.database, prices)
        writer.load_prices()
        return writer

    def load_prices(self) -> None:
        rows = [[p.model, p.tier, p.input_usd_per_mtok, p.output_usd_per_mtok, p.cached_input_usd]
                for p in self.prices.prices]
        if rows:
            self.client.insert(f"{self.database}.prices", rows, column_names=[
                "model", "tier", "input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"])

    def already_billed(self, completions: list[Completion]) -> set[str]:
        ids = [c.request_id for c in completions]
        result = self.client.query(
            f"SELECT DISTINCT request_id FROM {self.database}.usage_events "
            "WHERE finished_at BETWEEN {lo:DateTime64(3)} AND {hi:DateTime64(3)} AND request_id IN {ids:Array(String)}",
            parameters={"ids": ids, "lo": _time(min(c.finished_at_ms for c in completions)),
                        "hi": _time(max(c.finished_at_ms for c in completions))},
        )
        return {row[0] for row in result.result_rows}

    def write(self, completions: list[Completion]) -> int:
        """Insert the usage of requests not billed yet; returns how many rows were inserted."""
        if not completions:
            return 0
        unique = {c.request_id: c for c in completions}  # a batch can hold a request twice after a replay
        billed = self.already_billed(list(unique.values()))
        rows = [usage_row(c, self.prices) for rid, c in unique.items() if rid not in billed]
        if rows:
            self.client.insert(f"{self.database}.usage_events", rows, column_names=USAGE_COLUMNS)
        return len(rows)

    def write_decisions(self, decisions: list[ModerationDecision]) -> int:
        rows = [[d.request_id, d.tenant, d.model, d.tier, d.stage, d.action, d.categories, d.scores, d.seq, d.policy,
                 _time(d.decided_at_ms)] for d in decisions]
        if rows:
            self.client.insert(f"{self.database}.moderation_decisions", rows, column_names=MODERATION_COLUMNS)
        return len(rows)
