"""Scenario 4, tier fairness under overload: three tiers offered together at 1.5x what
the GPU consumer can serve; TTFT per tier. Requests go through the producers SDK, the
way internal services publish at a tier."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bench.plots import plot_tiers
from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen import RequestResult, arrival_gaps, summarize
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import ChatMessage

OUTPUT_TOKENS = 24
MAX_NUM_SEQS = 8
SIM = SimulatedEngineSettings(seed=4, ttft_ms=20, tokens_per_s=50, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
RATE_PER_TIER = 8.0  # capacity is about MAX_NUM_SEQS / 0.5 s = 16 req/s; offered 24
SECONDS = 8


async def timed_stream(client: TokenbusClient, tier: str, i: int) -> RequestResult:
    result = RequestResult()
    request = client.new_request(MODEL, [ChatMessage("user", f"{tier} request {i}")], tier=tier)
    start = time.perf_counter()
    async for reply in client.stream(request):
        if reply.event.text:
            result.chunk_arrived(time.perf_counter(), start)
            result.output_tokens += 1
        if reply.event.is_final:
            result.success = reply.event.finish_reason in {"stop", "length"}
    result.latency = time.perf_counter() - start
    return result


async def offer_tier(client: TokenbusClient, tier: str, seed: int) -> list[RequestResult]:
    tasks = []
    for i, gap in enumerate(arrival_gaps(int(RATE_PER_TIER * SECONDS), RATE_PER_TIER, 1.0, seed)):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(timed_stream(client, tier, i)))
    return list(await asyncio.gather(*tasks))


async def overload(stack) -> dict[str, Any]:
    tiers = stack.bus_settings().tiers
    async with TokenbusClient(stack.bus_settings(), reply_partitions=[5], idle_timeout=300) as client:
        started = time.perf_counter()
        per_tier = await asyncio.gather(*(offer_tier(client, tier, seed) for seed, tier in enumerate(tiers)))
        duration = time.perf_counter() - started
    rows = []
    for tier, results in zip(tiers, per_tier):
        s = summarize(results, duration, (50.0, 99.0))
        rows.append({"tier": tier, "completed": s.completed, "failed": s.failed,
                     "ttft_p50": round(s.ttft_ms["median"], 1), "ttft_p99": round(s.ttft_ms["p99"], 1),
                     "e2el_p50": round(s.e2el_ms["median"], 1)})
    return {"rows": rows, "duration_s": round(duration, 1)}


def run() -> dict[str, Any]:
    with bench_stack(SIM, max_num_seqs=MAX_NUM_SEQS) as stack:
        measured = asyncio.run(overload(stack))
    return {"scenario": "tier_fairness", "engine": SIM.model_dump(), "max_num_seqs": MAX_NUM_SEQS,
            "offered_per_tier": RATE_PER_TIER, **measured}


def table(result: dict[str, Any]) -> str:
    lines = [f"offered {result['offered_per_tier']:g} req/s per tier for {SECONDS} s; drained in {result['duration_s']} s", "",
             "| tier | done | failed | TTFT p50 ms | TTFT p99 ms | E2EL p50 ms |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['tier']} | {r['completed']} | {r['failed']} | {r['ttft_p50']} | {r['ttft_p99']} | {r['e2el_p50']} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    return plot_tiers(result["rows"], out_dir / "tier_fairness.png")
