"""Scenario: the capacity plan's inputs and its check (docs/capacity.md).

The plan sizes each tier from the CPU one token event and one turn cost in each process. This
scenario measures them on the embedded stack: streaming turns at a low rate and at three times
it, CPU seconds of every process over each window (from /proc), token events and turns
counted by the client. The check is the model's own: the CPU at the high rate predicted from
the costs measured at the low rate (fixed idle cost plus cost per turn and per event), against
what the high rate used. Then the plan for the design's load (``PLAN``), from the high-rate
costs.
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
RATES = (4.0, 12.0)  # turns per second
WINDOW_S = 20.0
IDLE_S = 10.0
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


def measure(stack: Any, rate: float | None) -> dict[str, Any]:
    """CPU seconds per process over one window (idle when ``rate`` is None), and what was served."""
    pids = {name: p.pid for name, p in stack.processes.items() if p.pid and p.alive()}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    if rate is None:
        time.sleep(IDLE_S)
        counts = {"turns": 0, "events": 0, "failed": 0}
    else:
        counts = asyncio.run(load(stack.edge_url, stack.dev_key, rate, WINDOW_S))
    elapsed = time.monotonic() - started
    cpu = {name: round(cpu_seconds(pid) - before[name], 3) for name, pid in pids.items()}
    return {"rate": rate, "seconds": round(elapsed, 2), **counts, "cpu_s": cpu}


def costs(idle: dict[str, Any], busy: dict[str, Any]) -> dict[str, float]:
    """CPU seconds per token event of each process, above its idle burn (turns and events go
    together here, so a turn's fixed cost is spread over its events)."""
    out = {}
    for name, used in busy["cpu_s"].items():
        idle_rate = idle["cpu_s"].get(name, 0.0) / idle["seconds"]
        out[name] = max(0.0, used - idle_rate * busy["seconds"]) / max(busy["events"], 1)
    return out


def plan(per_event: dict[str, float]) -> dict[str, Any]:
    """Cores per process kind for the design's load, from measured CPU per token event."""
    tiers = {}
    for level, turns in PLAN["turns_per_s"].items():
        events = turns * PLAN["output_tokens"]  # one event per token today (no coalescing)
        cores = {name: math.ceil(events * cost / CORE_UTILISATION) for name, cost in per_event.items()}
        tiers[level] = {"turns_per_s": turns, "token_events_per_s": events, "cores": cores}
    return tiers


def run() -> dict[str, Any]:
    with bench_stack(SIM) as stack:
        asyncio.run(load(stack.edge_url, stack.dev_key, 2.0, 3.0))  # warm every path
        idle = measure(stack, None)
        low, high = (measure(stack, rate) for rate in RATES)
    low_costs, high_costs = costs(idle, low), costs(idle, high)
    check = {}
    for name in high["cpu_s"]:
        idle_rate = idle["cpu_s"].get(name, 0.0) / idle["seconds"]
        predicted = idle_rate * high["seconds"] + low_costs[name] * high["events"]
        check[name] = {"predicted_cpu_s": round(predicted, 2), "measured_cpu_s": high["cpu_s"][name],
                       "ratio": round(high["cpu_s"][name] / predicted, 2) if predicted else None}
    return {"scenario": "capacity", "engine": SIM.model_dump(), "idle": idle, "low": low, "high": high,
            "cpu_us_per_event": {n: round(c * 1e6, 1) for n, c in high_costs.items()},
            "check_high_from_low": check, "plan": plan(high_costs)}


def table(result: dict[str, Any]) -> str:
    lines = ["| process | CPU µs per token event | high rate: predicted from low / measured CPU s | ratio |",
             "|---|---:|---:|---:|"]
    for name, cost in result["cpu_us_per_event"].items():
        c = result["check_high_from_low"][name]
        lines.append(f"| {name} | {cost} | {c['predicted_cpu_s']} / {c['measured_cpu_s']} | {c['ratio']} |")
    lines.append("")
    for level, tier in result["plan"].items():
        lines.append(f"{level}: {tier['turns_per_s']} turns/s, {tier['token_events_per_s']} token events/s, "
                     f"cores {json.dumps(tier['cores'])}")
    served = [f"{r['rate']}/s: {r['turns']} turns, {r['events']} events, {r['failed']} failed"
              for r in (result["low"], result["high"])]
    return "\n".join(lines) + "\n\n" + "; ".join(served)
