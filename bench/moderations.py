"""Scenario: what ``POST /v1/moderations`` costs beside the edge's cheapest authenticated call.

Through the embedded stack, alternating call by call (so each kind sees the same moments of this
noisy machine), ``CALLS`` of each:

- ``models``: ``GET /v1/models`` (authentication and nothing else): the reference;
- ``moderations_short``: one sentence to classify;
- ``moderations_long``: ``LONG_CHARS`` characters of prose holding an e-mail address.

Reported: each kind's latency p50 and p99 and the edge's CPU time per call (read around each
call), and the in-process cost of the policy's scan of the long text alone.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.stack import cpu_seconds, latency_and_cpu, measure_edge
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.moderation import INPUT, ModerationSettings

CALLS = 400
LONG_CHARS = 8000
SHORT = "Please name three rivers of Europe."
LONG = ("The quarterly report covers revenue, churn and the hiring plan for the next two quarters. " * 100)[:LONG_CHARS - 40]
LONG += " Contact: someone@example.com today."
SIM = SimulatedEngineSettings(seed=1)
KINDS = {"models": None, "moderations_short": SHORT, "moderations_long": LONG}


async def one(http: httpx.AsyncClient, text: str | None) -> None:
    response = await (http.get("/v1/models") if text is None else http.post("/v1/moderations", json={"input": text}))
    response.raise_for_status()


async def alternate(edge_url: str, api_key: str, edge_pid: int) -> dict[str, dict[str, list[float]]]:
    measured: dict[str, dict[str, list[float]]] = {k: {"latency": [], "cpu": []} for k in KINDS}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for text in KINDS.values():
            await one(http, text)  # warm-up
        for _ in range(CALLS):
            for kind, text in KINDS.items():
                before, started = cpu_seconds(edge_pid), time.perf_counter()
                await one(http, text)
                measured[kind]["latency"].append((time.perf_counter() - started) * 1000)
                measured[kind]["cpu"].append(cpu_seconds(edge_pid) - before)
    return measured


def scan_us() -> float:
    policy = ModerationSettings().load_policy()
    started = time.perf_counter()
    for _ in range(200):
        policy.decide(policy.scan(LONG, INPUT), "standard", INPUT)
    return (time.perf_counter() - started) / 200 * 1e6


def run() -> dict[str, Any]:
    measured = measure_edge(SIM, alternate)
    kinds = latency_and_cpu(measured, CALLS, "call")
    reference = kinds["models"]
    for k in kinds.values():
        k["p50_vs_models"] = round(k["p50_ms"] / reference["p50_ms"], 3)
        k["cpu_vs_models"] = round(k["edge_cpu_us_per_call"] / reference["edge_cpu_us_per_call"], 3)
    return {"scenario": "moderations", "calls": CALLS, "long_chars": len(LONG), "kinds": kinds,
            "scan_long_in_process_us": round(scan_us(), 1)}


def table(result: dict[str, Any]) -> str:
    lines = ["| call | p50 ms | p99 ms | vs models | edge CPU µs / call | vs models |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {kind} | {k['p50_ms']} | {k['p99_ms']} | {k['p50_vs_models']} | {k['edge_cpu_us_per_call']} | "
              f"{k['cpu_vs_models']} |" for kind, k in result["kinds"].items()]
    lines.append(f"\nthe policy's scan of {result['long_chars']} characters alone, in process: "
                 f"{result['scan_long_in_process_us']} µs")
    return "\n".join(lines)
