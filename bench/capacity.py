"""Scenario: the capacity plan's inputs and its check (docs/capacity.md).

The plan sizes each tier from the CPU one more token event costs in each process (its
marginal cost: at a low rate most of a process's CPU is the fixed cost of its readers'
polling, which a busy process amortizes). This scenario measures CPU seconds of every process
(from /proc) over windows of streaming turns at three rates, token events and turns counted by
the client; fits a line (fixed CPU per second + CPU per event) through the two lower rates;
and checks it by predicting the CPU of the highest rate. Then the plan for the design's load
(``PLAN``) from the marginal costs (each turn's own work is in them: turns and events come
together here).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack, cpu_seconds
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings

TOKENS = 48
SIM = SimulatedEngineSettings(seed=9, ttft_ms=20, tokens_per_s=200, min_tokens=TOKENS, max_tokens=TOKENS)
RATES = (8.0, 16.0, 32.0)  # turns per second: the line through the first two, checked on the third
WINDOW_S = 15.0
# The design's load (issue: "12,000 new chat turns per second on average and 50,000 at peak,
# 2,000 input and 500 output tokens per turn, streamed").
PLAN = {"turns_per_s": {"average": 12_000, "peak": 50_000}, "input_tokens": 2_000, "output_tokens": 500}
CORE_UTILISATION = 0.6  # plan cores to run at this share of busy, leaving headroom for spikes


async def load(edge_url: str, api_key: str, rate: float, seconds: float) -> dict[str, int]:
    """Streaming turns at ``rate`` a second for ``seconds``; counts turns and content chunks."""
    counts = {"turns": 0, "events": 0, "failed": 0}
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_key}"},
                                 limits=httpx.Limits(max_connections=256)) as http:
        async def turn(i: int) -> None:
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": f"turn {i}"}]}
            try:
                async with http.stream("POST", f"{edge_url}/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"content":"' in line:
                            counts["events"] += 1
                counts["turns"] += 1
            except httpx.HTTPError:
                counts["failed"] += 1

        tasks = []
        started = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(turn(i)))
        await asyncio.gather(*tasks)
    return counts


def measure(stack: Any, rate: float) -> dict[str, Any]:
    """CPU seconds per process over one window of turns at ``rate``, and what was served."""
    pids = {name: p.pid for name, p in stack.processes.items() if p.pid and p.alive()}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    counts = asyncio.run(load(stack.edge_url, stack.dev_key, rate, WINDOW_S))
    elapsed = time.monotonic() - started
    cpu = {name: round(cpu_seconds(pid) - before[name], 3) for name, pid in pids.items()}
    return {"rate": rate, "seconds": round(elapsed, 2), **counts, "cpu_s": cpu}


def fit(low: dict[str, Any], high: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per process: (fixed CPU seconds per second, CPU seconds per token event), the line through
    two windows (CPU per wall second against events per wall second)."""
    lines = {}
    for name in high["cpu_s"]:
        x0, y0 = low["events"] / low["seconds"], low["cpu_s"][name] / low["seconds"]
        x1, y1 = high["events"] / high["seconds"], high["cpu_s"][name] / high["seconds"]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        lines[name] = (max(0.0, y0 - slope * x0), slope)
    return lines


def plan(per_event: dict[str, float]) -> dict[str, Any]:
    """Cores per tokenbus process kind for the design's load, from measured CPU per token event.
    The embedded broker is left out: its CPU here is its readers' polling, and a Kafka cluster
    is sized by bytes (docs/capacity.md)."""
    tiers = {}
    for level, turns in PLAN["turns_per_s"].items():
        events = turns * PLAN["output_tokens"]  # one event per token today (no coalescing)
        cores = {name: math.ceil(events * cost / CORE_UTILISATION) for name, cost in per_event.items()
                 if name != "broker"}
        tiers[level] = {"turns_per_s": turns, "token_events_per_s": events, "cores": cores}
    return tiers


def run() -> dict[str, Any]:
    with bench_stack(SIM) as stack:
        asyncio.run(load(stack.edge_url, stack.dev_key, 4.0, 3.0))  # warm every path
        low, middle, high = (measure(stack, rate) for rate in RATES)
    lines = fit(low, middle)
    check = {}
    for name, (fixed, per_event) in lines.items():
        predicted = (fixed + per_event * high["events"] / high["seconds"]) * high["seconds"]
        check[name] = {"predicted_cpu_s": round(predicted, 2), "measured_cpu_s": high["cpu_s"][name],
                       "ratio": round(high["cpu_s"][name] / predicted, 2) if predicted else None}
    per_event = {name: line[1] for name, line in lines.items()}
    return {"scenario": "capacity", "engine": SIM.model_dump(), "windows": [low, middle, high],
            "fixed_cpu_per_s": {n: round(line[0], 3) for n, line in lines.items()},
            "cpu_us_per_event": {n: round(c * 1e6, 1) for n, c in per_event.items()},
            "check_high_from_fit": check, "plan": plan(per_event)}


def table(result: dict[str, Any]) -> str:
    lines = ["| process | fixed CPU (cores) | CPU µs per token event | highest rate: predicted / measured CPU s | ratio |",
             "|---|---:|---:|---:|---:|"]
    for name, cost in result["cpu_us_per_event"].items():
        c = result["check_high_from_fit"][name]
        lines.append(f"| {name} | {result['fixed_cpu_per_s'][name]} | {cost} | {c['predicted_cpu_s']} / "
                     f"{c['measured_cpu_s']} | {c['ratio']} |")
    lines.append("")
    for level, tier in result["plan"].items():
        lines.append(f"{level}: {tier['turns_per_s']} turns/s, {tier['token_events_per_s']} token events/s, "
                     f"cores {json.dumps(tier['cores'])}")
    served = [f"{r['rate']}/s: {r['turns']} turns, {r['events']} events, {r['failed']} failed"
              for r in result["windows"]]
    return "\n".join(lines) + "\n\n" + "; ".join(served)
