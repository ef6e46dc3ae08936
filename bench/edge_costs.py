"""Scenario 7, the edge's own costs: the latency rate limiting adds per request (the Lua
round trip to Redis over six buckets), and how many token events one edge process relays
per second of its own CPU time."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

import redis.asyncio as redis

from bench.stack import bench_stack, cpu_seconds, serve_config
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen import percentile
from tokenbus.infra.loadgen.serve import run_serve
from tokenbus.sse_edge.plumbing.ratelimit import Bucket, RateLimiter

CALLS = 3000
SIM = SimulatedEngineSettings(seed=7, ttft_ms=5, tokens_per_s=100, min_tokens=200, max_tokens=200)
# 384 requests: 2.5 s of edge CPU, read in 10 ms ticks (a resolution of 0.4 %), after one wave of 64
# that warms the edge (its connections, caches and first-call paths) and is not counted.
STREAMS, REQUESTS = 64, 384


def buckets(name: str) -> list[Bucket]:
    levels = [f"key:{name}", f"tenant:{name}", f"route:{name}"]
    return [Bucket(f"{lv}:{dim}", kind, 10**9, 10) for lv in levels for dim, kind in (("rpm", "requests"), ("tpm", "tokens"))]


async def rate_limit_latency(redis_url: str) -> dict[str, float]:
    client = redis.Redis.from_url(redis_url)
    limiter = RateLimiter(client, f"bench-{uuid.uuid4().hex[:6]}:")
    name = uuid.uuid4().hex
    await limiter.admit(buckets(name))  # loads the script
    samples = []
    for _ in range(CALLS):
        started = time.perf_counter()
        await limiter.admit(buckets(name))
        samples.append((time.perf_counter() - started) * 1e6)
    await client.aclose()
    return {"calls": CALLS, "mean_us": round(statistics.fmean(samples), 1),
            "p50_us": round(percentile(samples, 50), 1), "p99_us": round(percentile(samples, 99), 1)}


def relay_rate(stack) -> dict[str, float]:
    edge_pid = stack.processes["edge"].pid
    warm_up = serve_config(stack.edge_url, stack.dev_key, num_prompts=STREAMS, max_concurrency=STREAMS,
                           output_len=SIM.max_tokens, warmup=0)
    asyncio.run(run_serve(warm_up))
    config = serve_config(stack.edge_url, stack.dev_key, num_prompts=REQUESTS, max_concurrency=STREAMS,
                          output_len=SIM.max_tokens, warmup=0)
    before = cpu_seconds(edge_pid)
    summary, results = asyncio.run(run_serve(config))
    used = cpu_seconds(edge_pid) - before
    events = sum(r.output_tokens for r in results if r.success)
    return {"streams": STREAMS, "requests": REQUESTS, "events": events, "edge_cpu_s": round(used, 2),
            "wall_s": round(summary.duration_s, 2), "events_per_cpu_s": round(events / max(used, 1e-9)),
            "events_per_wall_s": round(events / summary.duration_s)}


def run() -> dict[str, Any]:
    with bench_stack(SIM) as stack:
        latency = asyncio.run(rate_limit_latency(stack.settings.redis_url))
        relay = relay_rate(stack)
    return {"scenario": "edge_costs", "rate_limit": latency, "relay": relay}


def table(result: dict[str, Any]) -> str:
    rl, relay = result["rate_limit"], result["relay"]
    return "\n".join([
        "| measure | value |", "|---|---:|",
        f"| rate limiting added per request, mean (6 buckets, one Redis round trip) | {rl['mean_us']} µs |",
        f"| rate limiting added per request, p50 / p99 | {rl['p50_us']} / {rl['p99_us']} µs |",
        f"| token events relayed by one edge process per CPU-second | {relay['events_per_cpu_s']} |",
        f"| token events relayed per wall second ({relay['streams']} streams, 2 shared cores) | {relay['events_per_wall_s']} |",
    ])
