"""``tokenbus usage``: usage and cost per tenant, model and tier from ClickHouse's rollups.

Where the numbers come from: a ClickHouse server when ``TOKENBUS_CLICKHOUSE_URL`` is
``http(s)://``; otherwise the embedded chDB directory, which only one process may open:
through the running processors' ``/usage`` page when the stack is up, directly when not.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from typing import Any

import httpx

from tokenbus.stores.billing.clickhouse import BUCKETS, ClickHouseSettings, connect
from tokenbus.stores.billing.report import UsageQuery, parse_time, reconcile, usage_report

COLUMNS = ["bucket", "tenant", "model", "tier", "requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens",
           "cost_usd"]
DEFAULT_PROCESSORS_URL = "http://127.0.0.1:8702"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant")
    parser.add_argument("--model")
    parser.add_argument("--tier")
    parser.add_argument("--since", help="ISO 8601 start (inclusive), UTC unless it names a zone")
    parser.add_argument("--until", help="ISO 8601 end (exclusive)")
    parser.add_argument("--bucket", choices=BUCKETS, default="hour")
    parser.add_argument("--format", choices=["table", "csv", "json"], default="table")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw tokens or cost over time")
    parser.add_argument("--metric", choices=["tokens", "cost"], default="tokens", help="what --plot draws")
    parser.add_argument("--check", action="store_true", help="compare rollup totals with the raw rows")
    parser.add_argument("--processors-url", default=DEFAULT_PROCESSORS_URL,
                        help="the processors' web address, used while they hold the embedded chDB")


def fetch(query: UsageQuery, check: bool, processors_url: str) -> dict[str, Any]:
    settings = ClickHouseSettings()
    if settings.embedded_path is not None:
        params = {**query.to_params(), **({"check": "1"} if check else {})}
        try:
            response = httpx.get(f"{processors_url}/usage", params=params, timeout=30)
        except httpx.HTTPError:
            response = None  # the stack is down: the directory is free to open here
        if response is not None:
            if response.status_code != 200:
                raise SystemExit(f"usage: {response.json().get('error', response.text)}")
            return response.json()
    client = connect(settings)
    if check:
        return reconcile(client, settings.database)
    return usage_report(client, settings.database, query)


def render_table(rows: list[dict[str, Any]]) -> str:
    cells = [[format_cell(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) if i >= 4 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(lines)


def format_cell(value: Any) -> str:
    return f"{value:.6f}" if isinstance(value, float) else str(value)


def render_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def plot(rows: list[dict[str, Any]], path: str, metric: str, bucket: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[datetime, float]]] = {}
    for row in rows:
        value = row["cost_usd"] if metric == "cost" else row["prompt_tokens"] + row["completion_tokens"]
        series.setdefault(f"{row['tenant']} / {row['model']} / {row['tier']}", []).append(
            (datetime.fromisoformat(row["bucket"]), value))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, points in sorted(series.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_ylabel("cost (USD)" if metric == "cost" else "tokens (prompt + completion)")
    ax.set_title(f"tokenbus usage per {bucket}")
    if series:
        ax.legend(fontsize=8)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_usage(args: argparse.Namespace) -> int:
    try:
        query = UsageQuery(bucket=args.bucket, tenant=args.tenant, model=args.model, tier=args.tier,
                           since=parse_time(args.since), until=parse_time(args.until))
    except ValueError as exc:
        print(f"usage: {exc}", file=sys.stderr)
        return 2
    result = fetch(query, args.check, args.processors_url)
    if args.check:
        print(json.dumps(result, indent=2))
        return 0 if result["consistent"] else 1
    rows = result["rows"]
    if args.format == "json":
        print(json.dumps(rows, indent=2))
    elif args.format == "csv":
        print(render_csv(rows), end="")
    else:
        print(render_table(rows))
    if args.plot:
        plot(rows, args.plot, args.metric, args.bucket)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
