"""Scenario 9, soak: steady streaming load for a bounded time (TOKENBUS_SOAK_S, default
600 s) against the whole stack, sampling every process's memory; the run should end
with zero failed requests and flat memory curves."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from bench.plots import plot_soak
from bench.stack import MODEL, bench_stack, process_rss_kib
from gpu_consumers.engines import SimulatedEngineSettings
from infra.loadgen import stream_chat

SIM = SimulatedEngineSettings(seed=5, ttft_ms=20, tokens_per_s=100, min_tokens=16, max_tokens=48)
CONCURRENCY = 16
SAMPLE_EVERY_S = 10.0


def duration_s() -> float:
    return float(os.environ.get("TOKENBUS_SOAK_S", "600"))


async def soak(stack, seconds: float) -> dict[str, Any]:
    pids = {name: p.pid for name, p in stack.processes.items() if p.pid}
    url = f"{stack.edge_url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {stack.dev_key}"}
    counts = {"ok": 0, "failed": 0}
    errors: dict[str, int] = {}
    stop_at = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, worker: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            payload = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"soak {worker} {i}"}]}
            result = await stream_chat(http, url, payload, headers)
            if result.success:
                counts["ok"] += 1
            else:
                counts["failed"] += 1
                errors[result.error[:80]] = errors.get(result.error[:80], 0) + 1
            i += 1

    samples = []
    started = time.monotonic()

    async def sampler() -> None:
        while time.monotonic() < stop_at + 1:
            samples.append({"t_s": round(time.monotonic() - started, 1), "requests": counts["ok"],
                            "rss_mib": {n: round(process_rss_kib(pid) / 1024, 1) for n, pid in pids.items()}})
            await asyncio.sleep(SAMPLE_EVERY_S)

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY + 4)) as http:
        await asyncio.gather(sampler(), *(client(http, w) for w in range(CONCURRENCY)))
    return {"counts": counts, "errors": errors, "samples": samples}


def growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process: RSS at the first sample after warm-up (a quarter in), at the end, and the change."""
    warm = samples[len(samples) // 4]
    last = samples[-1]
    return {name: {"warm_mib": warm["rss_mib"][name], "end_mib": last["rss_mib"][name],
                   "max_mib": max(s["rss_mib"][name] for s in samples),
                   "change_mib": round(last["rss_mib"][name] - warm["rss_mib"][name], 1)} for name in last["rss_mib"]}


def run() -> dict[str, Any]:
    seconds = duration_s()
    with bench_stack(SIM) as stack:
        result = asyncio.run(soak(stack, seconds))
    result.update(scenario="soak", seconds=seconds, concurrency=CONCURRENCY, engine=SIM.model_dump(),
                  memory=growth(result["samples"]))
    return result


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    return plot_soak(result["samples"], out_dir / "soak.png")


def table(result: dict[str, Any]) -> str:
    c = result["counts"]
    lines = [f"{result['seconds']:.0f} s at {result['concurrency']} concurrent streams: {c['ok']} requests completed, "
             f"{c['failed']} failed {result['errors'] or ''}", "",
             "| process | RSS after warm-up MiB | at the end MiB | max MiB | change MiB |", "|---|---:|---:|---:|---:|"]
    for name, m in result["memory"].items():
        lines.append(f"| {name} | {m['warm_mib']} | {m['end_mib']} | {m['max_mib']} | {m['change_mib']:+.1f} |")
    return "\n".join(lines)
