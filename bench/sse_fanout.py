"""Scenario 3, SSE fan-out: how many concurrent streams one edge process holds, and
its memory per open stream. Streams are long and slow (one token a second), so they
stay open while the count ramps up; each level is measured with all streams open."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from bench.plots import plot_fanout
from bench.stack import MODEL, bench_stack, process_rss_kib
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen import stream_chat

LEVELS = (250, 500, 1000, 1500, 2000)
TOKENS_PER_STREAM = 40
SIM = SimulatedEngineSettings(seed=3, ttft_ms=10, tokens_per_s=1, min_tokens=10_000, max_tokens=10_000)


async def open_streams(edge_url: str, api_key: str, edge_pid: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max(LEVELS) + 16, max_keepalive_connections=16)
    auth = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits, headers=auth) as http:
        url = f"{edge_url}/v1/chat/completions"
        payload = {"model": MODEL, "stream": True, "max_tokens": TOKENS_PER_STREAM,
                   "messages": [{"role": "user", "content": "hold this stream open"}]}
        await stream_chat(http, url, {**payload, "max_tokens": 2})  # warm the edge before the baseline
        baseline = process_rss_kib(edge_pid)
        tasks: list[asyncio.Task] = []
        levels = []
        for level in LEVELS:
            tasks += [asyncio.create_task(stream_chat(http, url, payload)) for _ in range(level - len(tasks))]
            open_now = await wait_for_open(http, edge_url, level)
            rss = process_rss_kib(edge_pid)
            levels.append({"streams": level, "open_at_edge": open_now, "edge_rss_mib": round(rss / 1024, 1),
                           "kib_per_stream": round((rss - baseline) / level, 1)})
        results = await asyncio.gather(*tasks)
    ok = sum(1 for r in results if r.success and r.output_tokens == TOKENS_PER_STREAM)
    return {"baseline_rss_mib": round(baseline / 1024, 1), "levels": levels, "streams_total": len(results),
            "streams_complete": ok}


async def wait_for_open(http: httpx.AsyncClient, edge_url: str, target: int, timeout: float = 60) -> int:
    """Wait until the edge reports ``target`` open streams (all connected and relaying)."""
    deadline = time.monotonic() + timeout
    open_now = 0
    while time.monotonic() < deadline:
        open_now = (await http.get(f"{edge_url}/healthz")).json()["open_streams"]
        if open_now >= target:
            await asyncio.sleep(2)  # every stream has relayed at least one token by now
            break
        await asyncio.sleep(0.5)
    return open_now


def run() -> dict[str, Any]:
    with bench_stack(SIM, max_num_seqs=max(LEVELS) + 64) as stack:
        edge_pid = stack.processes["edge"].pid
        assert edge_pid is not None
        measured = asyncio.run(open_streams(stack.edge_url, stack.dev_key, edge_pid))
    return {"scenario": "sse_fanout", "engine": SIM.model_dump(), "tokens_per_stream": TOKENS_PER_STREAM, **measured}


def table(result: dict[str, Any]) -> str:
    lines = [f"edge RSS before: {result['baseline_rss_mib']} MiB; streams that completed with every token: "
             f"{result['streams_complete']} / {result['streams_total']}", "",
             "| open streams | seen open at edge | edge RSS MiB | KiB per stream |", "|---:|---:|---:|---:|"]
    for level in result["levels"]:
        lines.append(f"| {level['streams']} | {level['open_at_edge']} | {level['edge_rss_mib']} | {level['kib_per_stream']} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    return plot_fanout(result["levels"], out_dir / "sse_fanout.png")
