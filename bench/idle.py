"""The embedded stack at rest: how much CPU each process burns with no traffic at all, over a
window after one request has warmed every path. A laptop user running `make run` pays this
all day; the goal is a few percent of one core for the whole stack."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack, cpu_seconds
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings

SIM = SimulatedEngineSettings(seed=5, ttft_ms=20, tokens_per_s=100, min_tokens=32, max_tokens=32)
WARM_S = float(os.environ.get("TOKENBUS_BENCH_IDLE_WARM_S", "10"))
WINDOW_S = float(os.environ.get("TOKENBUS_BENCH_IDLE_WINDOW_S", "30"))


async def one_request(edge_url: str, api_key: str) -> int:
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as http:
        response = await http.post(f"{edge_url}/v1/chat/completions",
                                   json={"model": MODEL, "messages": [{"role": "user", "content": "warm up"}]})
        return response.status_code


def run() -> dict[str, Any]:
    with bench_stack(SIM) as stack:
        status = asyncio.run(one_request(stack.edge_url, stack.dev_key))
        time.sleep(WARM_S)
        pids = {name: process.pid for name, process in stack.processes.items() if process.pid and process.alive()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        time.sleep(WINDOW_S)
        elapsed = time.monotonic() - started
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    per_process = {name: round(100 * seconds / elapsed, 1) for name, seconds in sorted(used.items())}
    return {"warm_request_status": status, "window_s": round(elapsed, 1), "broker": stack.bus_settings().broker,
            "cpu_percent_of_a_core": per_process, "total_cpu_percent_of_a_core": round(sum(per_process.values()), 1)}


def table(result: dict[str, Any]) -> str:
    rows = ["| process | idle CPU, % of one core |", "|---|---:|"]
    rows += [f"| {name} | {percent} |" for name, percent in result["cpu_percent_of_a_core"].items()]
    rows.append(f"| **all** | **{result['total_cpu_percent_of_a_core']}** |")
    return "\n".join(rows) + f"\n\n{result['window_s']} s window, no traffic, `{result['broker']}` client profile"
