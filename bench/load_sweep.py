"""Scenario 2, load sweep: TTFT, ITL and throughput as the request rate rises past
what one GPU consumer can serve (Poisson arrivals)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench.plots import plot_load_sweep
from bench.stack import bench_stack, serve_config
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.loadgen.serve import run_serve

OUTPUT_TOKENS = 48
MAX_NUM_SEQS = 32
# Steps slow down as the batch grows, as on a GPU: the consumer saturates near 20 req/s.
SIM = SimulatedEngineSettings(seed=2, ttft_ms=20, tokens_per_s=50, batch_slowdown=0.02,
                              min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
RATES = (2.0, 5.0, 10.0, 15.0, 20.0, 30.0)
SECONDS_PER_RATE = 6


def run() -> dict[str, Any]:
    rows = []
    with bench_stack(SIM, max_num_seqs=MAX_NUM_SEQS) as stack:
        for rate in RATES:
            config = serve_config(stack.edge_url, stack.dev_key, num_prompts=max(20, int(rate * SECONDS_PER_RATE)),
                                  request_rate=rate, output_len=OUTPUT_TOKENS, warmup=2, seed=int(rate))
            s, _ = asyncio.run(run_serve(config))
            rows.append({
                "rate": rate, "completed": s.completed, "failed": s.failed,
                "request_throughput": round(s.request_throughput, 2), "output_throughput": round(s.output_throughput, 1),
                "ttft_p50": round(s.ttft_ms["median"], 1), "ttft_p99": round(s.ttft_ms["p99"], 1),
                "itl_p50": round(s.itl_ms["median"], 2), "itl_p99": round(s.itl_ms["p99"], 2),
                "e2el_p50": round(s.e2el_ms["median"], 1),
            })
    return {"scenario": "load_sweep", "engine": SIM.model_dump(), "max_num_seqs": MAX_NUM_SEQS, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| offered req/s | done | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | E2EL p50 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['rate']:g} | {r['completed']} | {r['failed']} | {r['request_throughput']} | "
                     f"{r['output_throughput']} | {r['ttft_p50']} | {r['ttft_p99']} | {r['itl_p50']} | "
                     f"{r['itl_p99']} | {r['e2el_p50']} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    return plot_load_sweep(result["rows"], out_dir / "load_sweep.png")
