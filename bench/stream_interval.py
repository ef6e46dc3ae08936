"""What `TOKENBUS_WORKER_STREAM_INTERVAL_MS` buys and costs: the same streaming load through stacks
whose GPU consumer sends a sequence's token events at every step (0) or at most once per interval,
the steps between as one event. Reported per stack: the CPU each process spent per output token
(the edge, output moderation in the processors and the broker handle each event, whatever it
carries), token events per request, and the latency a client sees (a coarser stream's chunks come
further apart; the first token never waits)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from bench.stack import bench_stack, cpu_seconds, serve_config
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen.serve import run_serve

OUTPUT_TOKENS = 64
SIM = SimulatedEngineSettings(seed=8, ttft_ms=20, tokens_per_s=100, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
INTERVALS_MS = tuple(int(v) for v in os.environ.get("TOKENBUS_BENCH_STREAM_INTERVALS_MS", "0,20,50").split(","))
CONCURRENCY, REQUESTS = 64, 256


def measure(interval_ms: int) -> dict[str, Any]:
    with bench_stack(SIM, extra_env={"TOKENBUS_WORKER_STREAM_INTERVAL_MS": str(interval_ms)}) as stack:
        config = lambda requests: serve_config(stack.edge_url, stack.dev_key, num_prompts=requests,  # noqa: E731
                                               max_concurrency=CONCURRENCY, output_len=OUTPUT_TOKENS, warmup=0)
        asyncio.run(run_serve(config(CONCURRENCY)))  # every path warm
        pids = {name: p.pid for name, p in stack.processes.items() if p.pid and p.alive()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        summary, results = asyncio.run(run_serve(config(REQUESTS)))
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    tokens = sum(r.output_tokens for r in results if r.success)
    chunks = sum(r.chunks for r in results if r.success)  # content chunks: one per token event
    return {
        "interval_ms": interval_ms, "failed": summary.failed, "output_tokens": tokens,
        "events_per_request": round(chunks / max(summary.completed, 1), 1),
        "cpu_us_per_token": {name.split("-")[0]: round(1e6 * seconds / max(tokens, 1), 1)
                             for name, seconds in sorted(used.items())},
        "ttft_ms_p50": round(summary.ttft_ms["median"], 1), "itl_ms_p50": round(summary.itl_ms["median"], 1),
        "itl_ms_p99": round(summary.itl_ms["p99"], 1), "output_tokens_per_s": round(summary.output_throughput),
    }


def run() -> dict[str, Any]:
    rows = [measure(interval) for interval in INTERVALS_MS]
    return {"scenario": "stream_interval", "engine": SIM.model_dump(), "concurrency": CONCURRENCY,
            "requests": REQUESTS, "rows": rows}


def table(result: dict[str, Any]) -> str:
    processes = sorted({name for row in result["rows"] for name in row["cpu_us_per_token"]})
    lines = ["| interval | events a request | " + " | ".join(f"{p} µs/token" for p in processes)
             + " | TTFT p50 | ITL p50 / p99 | tok/s |",
             "|---:|---:|" + "---:|" * len(processes) + "---:|---:|---:|"]
    for row in result["rows"]:
        cpu = " | ".join(str(row["cpu_us_per_token"].get(p, "")) for p in processes)
        lines.append(f"| {row['interval_ms']} ms | {row['events_per_request']} | {cpu} | {row['ttft_ms_p50']} ms "
                     f"| {row['itl_ms_p50']} / {row['itl_ms_p99']} ms | {row['output_tokens_per_s']} |")
    return "\n".join(lines) + (f"\n\n{result['requests']} requests of {OUTPUT_TOKENS} tokens, {result['concurrency']} "
                               "at a time, the simulated engine at 100 tokens/s a sequence")
