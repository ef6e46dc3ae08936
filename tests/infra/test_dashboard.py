"""The Grafana dashboard (infra/deploy/grafana/tokenbus.json) asks only for metrics the
services export: every metric its queries name is scraped from the running embedded stack's
edge, GPU consumer and processors."""

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).parents[2] / "infra" / "deploy" / "grafana" / "tokenbus.json"
METRIC = re.compile(r"tokenbus:[a-z0-9_:]+")
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def exported(stack) -> set[str]:
    """Metric names in the exposition of every service (HELP lines name even metrics with no samples yet)."""
    urls = [f"{stack.edge_url}/metrics", f"http://127.0.0.1:{stack.settings.worker_port}/metrics",
            f"{stack.processors_url}/metrics"]
    names = set()
    for url in urls:
        text = httpx.get(url, timeout=10).text
        names |= {line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")}
    return names | {name.removesuffix(suffix) for name in names for suffix in SUFFIXES if name.endswith(suffix)}


def test_every_dashboard_query_names_an_exported_metric(stack):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    named = {m for expr in queries for m in METRIC.findall(expr)}
    assert len(queries) >= 20 and len(named) >= 20
    have = exported(stack)
    missing = sorted(m for m in named if m not in have and not any(
        m.endswith(s) and m.removesuffix(s) in have for s in SUFFIXES))
    assert not missing, f"the dashboard asks for metrics nobody exports: {missing}"
