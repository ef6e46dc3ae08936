"""Scenario: OpenAI's ``service_tier`` under overload. One standard key's traffic through the edge,
half of it plain (its key's tier) and half asking ``service_tier: flex`` (the lowest tier), offered
together at 1.5x what the GPU consumer serves: per kind, TTFT and end-to-end latency, and what
billing charged a request (read back from the usage rollups, where the flex ones are billed at the
lowest tier's price). And what reading the tier costs the edge, in process."""

from __future__ import annotations

import asyncio
import time
import timeit
import uuid
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen import RequestResult, arrival_gaps, summarize
from tokenbus.infra.loadgen.sse_client import client_session, stream_chat
from tokenbus.sse_edge.protocol.service_tiers import tier_asked, tier_served

OUTPUT_TOKENS = 24
MAX_NUM_SEQS = 8
SIM = SimulatedEngineSettings(seed=4, ttft_ms=20, tokens_per_s=50, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
RATE_PER_KIND = 12.0  # capacity is about MAX_NUM_SEQS / 0.5 s = 16 req/s; offered 24
SECONDS = 8
KINDS = {"default": None, "flex": "flex"}


async def offer(base_url: str, key: str, kind: str, seed: int) -> list[RequestResult]:
    async def one(i: int) -> RequestResult:
        payload: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS,
                                   "messages": [{"role": "user", "content": f"{kind} request {i}"}]}
        if KINDS[kind] is not None:
            payload["service_tier"] = KINDS[kind]
        return await stream_chat(http, f"{base_url}/v1/chat/completions", payload, {"Authorization": f"Bearer {key}"})

    tasks = []
    async with client_session(256, timeout_s=300) as http:
        for i, gap in enumerate(arrival_gaps(int(RATE_PER_KIND * SECONDS), RATE_PER_KIND, 1.0, seed)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i)))
        return list(await asyncio.gather(*tasks))


def billed_per_tier(processors_url: str, tenant: str, expected: int) -> dict[str, dict[str, int]]:
    """Requests and cost (nano-USD) billing wrote per tier for ``tenant``, once ``expected`` are in."""
    deadline = time.time() + 60
    while True:
        rows = httpx.get(f"{processors_url}/usage", params={"bucket": "day", "tenant": tenant}, timeout=30).json()["rows"]
        per_tier: dict[str, dict[str, int]] = {}
        for row in rows:
            sums = per_tier.setdefault(row["tier"], {"requests": 0, "cost_nanousd": 0})
            sums["requests"] += row["requests"]
            sums["cost_nanousd"] += row["input_cost_nanousd"] + row["output_cost_nanousd"]
        if sum(s["requests"] for s in per_tier.values()) >= expected or time.time() > deadline:
            return per_tier
        time.sleep(0.5)


def reading_cost_ns(tiers: list[str]) -> float:
    """CPU time of reading a request's tier (what it asks, never above its key's), in process."""
    calls = 200_000
    seconds = timeit.timeit(lambda: tier_served(tier_asked("flex", tiers), "standard", tiers), number=calls)
    return round(seconds / calls * 1e9, 1)


def run() -> dict[str, Any]:
    with bench_stack(SIM, max_num_seqs=MAX_NUM_SEQS, extra_env={"TOKENBUS_PROC_BILLING_BATCH_S": "0.2"}) as stack:
        tenant = f"bench-tiers-{uuid.uuid4().hex[:6]}"
        key = asyncio.run(stack.create_key(tenant, "standard"))
        started = time.perf_counter()

        async def together() -> list[list[RequestResult]]:
            return list(await asyncio.gather(*(offer(stack.edge_url, key, kind, seed)
                                               for seed, kind in enumerate(KINDS))))

        per_kind = asyncio.run(together())
        duration = time.perf_counter() - started
        bills = billed_per_tier(stack.processors_url, tenant, sum(len(r) for r in per_kind))
        tiers = stack.bus_settings().tiers
    rows = []
    for (kind, asked), results in zip(KINDS.items(), per_kind, strict=True):
        s = summarize(results, duration, (50.0, 99.0))
        tier = tier_served(tier_asked(asked, tiers), "standard", tiers)
        bill = bills.get(tier, {"requests": 0, "cost_nanousd": 0})
        rows.append({"kind": kind, "tier": tier, "completed": s.completed, "failed": s.failed,
                     "ttft_p50": round(s.ttft_ms["median"], 1), "ttft_p99": round(s.ttft_ms["p99"], 1),
                     "e2el_p50": round(s.e2el_ms["median"], 1), "billed_requests": bill["requests"],
                     "billed_nanousd_per_request": round(bill["cost_nanousd"] / max(1, bill["requests"]))})
    return {"scenario": "service_tiers", "engine": SIM.model_dump(), "max_num_seqs": MAX_NUM_SEQS,
            "offered_per_kind": RATE_PER_KIND, "seconds": SECONDS, "duration_s": round(duration, 1),
            "reading_tier_ns": reading_cost_ns(tiers), "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [f"one standard key, {result['offered_per_kind']:g} req/s of each kind for {result['seconds']} s "
             f"(1.5x capacity); drained in {result['duration_s']} s; reading the tier: "
             f"{result['reading_tier_ns']} ns a request", "",
             "| service_tier | runs at | done | failed | TTFT p50 ms | TTFT p99 ms | E2EL p50 ms | billed nano-USD / request |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['kind']} | {r['tier']} | {r['completed']} | {r['failed']} | {r['ttft_p50']} | "
                     f"{r['ttft_p99']} | {r['e2el_p50']} | {r['billed_nanousd_per_request']} |")
    return "\n".join(lines)
