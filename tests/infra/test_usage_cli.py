"""`tokenbus usage` against the stack's billing (through the processors, which hold chDB)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import sys
import uuid

import httpx
import pytest

from tests.conftest import MODEL
from tests.stream_processors.helpers import Processors, eventually
from tokenbus.infra.devstack.stack import EmbeddedStack

pytestmark = pytest.mark.stack


def usage(stack: EmbeddedStack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENBUS_CLICKHOUSE_URL": f"chdb://{stack.clickhouse_path}"}
    return subprocess.run([sys.executable, "-m", "tokenbus.infra", "usage", "--processors-url", stack.processors_url, *args],
                          capture_output=True, text=True, env=env, timeout=60)


async def bill_three_requests(stack: EmbeddedStack) -> tuple[str, int]:
    tenant = f"usage-{uuid.uuid4().hex[:6]}"
    key = await stack.create_key(tenant, "standard")
    tokens = 0
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(3):
            response = await client.post(f"{stack.edge_url}/v1/chat/completions",
                                         headers={"Authorization": f"Bearer {key}"},
                                         json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]})
            tokens += response.json()["usage"]["total_tokens"]
            request_id = response.json()["id"]
    await eventually(lambda: Processors(stack.processors_url).usage_rows(request_id))
    return tenant, tokens


@pytest.fixture(scope="module")
def billed_tenant(stack: EmbeddedStack) -> tuple[str, int]:
    return asyncio.run(bill_three_requests(stack))


def test_json_csv_and_table_agree(stack, billed_tenant):
    tenant, tokens = billed_tenant
    rows = json.loads(usage(stack, "--tenant", tenant, "--bucket", "day", "--format", "json").stdout)
    assert sum(r["requests"] for r in rows) == 3
    assert sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows) == tokens
    assert 0 <= sum(r["cached_prompt_tokens"] for r in rows) < sum(r["prompt_tokens"] for r in rows)
    assert {(r["tenant"], r["model"], r["tier"]) for r in rows} == {(tenant, MODEL, "standard")}

    out = usage(stack, "--tenant", tenant, "--bucket", "day", "--format", "csv").stdout
    parsed = list(csv.DictReader(io.StringIO(out)))
    assert [int(r["requests"]) for r in parsed] == [r["requests"] for r in rows]

    table = usage(stack, "--tenant", tenant, "--bucket", "day").stdout.splitlines()
    assert table[0].split() == ["bucket", "tenant", "model", "tier", "requests", "prompt_tokens",
                                "cached_prompt_tokens", "completion_tokens", "cost_usd"]
    assert tenant in table[1]


def test_filters_that_match_nothing_give_no_rows(stack, billed_tenant):
    tenant, _ = billed_tenant
    assert json.loads(usage(stack, "--tenant", tenant, "--tier", "batch", "--format", "json").stdout) == []
    assert json.loads(usage(stack, "--tenant", tenant, "--until", "2000-01-01", "--format", "json").stdout) == []


def test_plot_writes_a_png(stack, billed_tenant, tmp_path):
    tenant, _ = billed_tenant
    chart = tmp_path / "usage.png"
    result = usage(stack, "--tenant", tenant, "--bucket", "minute", "--plot", str(chart), "--metric", "cost")
    assert result.returncode == 0, result.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000


def test_check_reports_rollups_consistent_with_raw_rows(stack, billed_tenant):
    result = usage(stack, "--check")
    assert result.returncode == 0 and json.loads(result.stdout)["consistent"] is True


def test_bad_time_is_a_usage_error(stack):
    result = usage(stack, "--since", "yesterday")
    assert result.returncode == 2 and "ISO 8601" in result.stderr
