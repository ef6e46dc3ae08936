"""Usage reports over the rollups, as analysts and ``tokenbus usage`` ask for them."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

from tokenbus.stores.billing.clickhouse import BUCKETS, ROLLUP_SUMS
from tokenbus.stores.billing.prices import NANO_USD_PER_USD


@dataclass(frozen=True, slots=True)
class UsageQuery:
    bucket: str = "hour"
    tenant: str | None = None
    model: str | None = None
    tier: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None

    def __post_init__(self) -> None:
        if self.bucket not in BUCKETS:
            raise ValueError(f"bucket must be one of {list(BUCKETS)}")

    @classmethod
    def from_params(cls, params: dict[str, str]) -> UsageQuery:
        return cls(
            bucket=params.get("bucket") or "hour",
            tenant=params.get("tenant") or None,
            model=params.get("model") or None,
            tier=params.get("tier") or None,
            since=parse_time(params.get("since")),
            until=parse_time(params.get("until")),
        )

    def to_params(self) -> dict[str, str]:
        return {k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in asdict(self).items() if v}

    def where(self) -> tuple[str, dict[str, Any]]:
        clauses, params = [], {}
        for column in ("tenant", "model", "tier"):
            value = getattr(self, column)
            if value is not None:
                clauses.append(f"{column} = {{{column}:String}}")
                params[column] = value
        if self.since is not None:
            clauses.append("bucket >= {since:DateTime}")
            params["since"] = self.since
        if self.until is not None:
            clauses.append("bucket < {until:DateTime}")
            params["until"] = self.until
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def parse_time(value: str | None) -> dt.datetime | None:
    """ISO 8601 (``2026-11-21``, ``2026-11-21T10:00``), naive times taken as UTC."""
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"not an ISO 8601 time: {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def usage_report(client: Any, database: str, query: UsageQuery) -> dict[str, Any]:
    where, params = query.where()
    sums = ", ".join(f"sum({c}) AS {c}" for c in ROLLUP_SUMS)
    result = client.query(
        f"SELECT bucket, tenant, model, tier, {sums} FROM {database}.usage_{query.bucket}{where} "
        "GROUP BY bucket, tenant, model, tier ORDER BY bucket, tenant, model, tier",
        parameters=params,
    )
    rows = []
    for bucket, tenant, model, tier, *values in result.result_rows:
        row = {"bucket": bucket.replace(tzinfo=dt.UTC).isoformat(), "tenant": tenant, "model": model,
               "tier": tier, **{c: int(v) for c, v in zip(ROLLUP_SUMS, values)}}
        row["cost_usd"] = (row["input_cost_nanousd"] + row["output_cost_nanousd"]) / NANO_USD_PER_USD
        rows.append(row)
    return {"query": query.to_params(), "rows": rows}


def reconcile(client: Any, database: str) -> dict[str, Any]:
    """Totals per tenant, model and tier from the raw rows and from each rollup; they must agree."""
    raw_sums = ("count() AS requests, countIf(cancelled) AS cancelled, sum(prompt_tokens), sum(completion_tokens), "
                "sum(cached_prompt_tokens), sum(input_cost_nanousd), sum(output_cost_nanousd)")
    sources = {"raw": f"SELECT tenant, model, tier, {raw_sums} FROM {database}.usage_events FINAL "
                      "GROUP BY tenant, model, tier"}
    sums = ", ".join(f"sum({c})" for c in ROLLUP_SUMS)
    for bucket in BUCKETS:
        sources[bucket] = f"SELECT tenant, model, tier, {sums} FROM {database}.usage_{bucket} GROUP BY tenant, model, tier"
    totals: dict[str, Any] = {}
    for name, sql in sources.items():
        totals[name] = sorted(
            ({"tenant": t, "model": m, "tier": r, **{c: int(v) for c, v in zip(ROLLUP_SUMS, values)}}
             for t, m, r, *values in client.query(sql).result_rows),
            key=lambda row: (row["tenant"], row["model"], row["tier"]),
        )
    raw_rows = client.query(f"SELECT count() FROM {database}.usage_events").result_rows[0][0]
    totals["raw_rows"] = int(raw_rows)
    totals["consistent"] = all(totals[b] == totals["raw"] for b in BUCKETS)
    return totals


def request_usage(client: Any, database: str, request_id: str) -> dict[str, Any]:
    """The raw usage rows of one request (there is one, or none yet)."""
    result = client.query(
        f"SELECT request_id, tenant, model, tier, prompt_tokens, completion_tokens, cached_prompt_tokens, input_cost_nanousd, "
        f"output_cost_nanousd, finish_reason, cancelled, worker_id, inserted_at FROM {database}.usage_events "
        "WHERE request_id = {id:String}",
        parameters={"id": request_id},
    )
    return {"rows": [dict(zip(result.column_names, row)) for row in result.result_rows]}
