"""Scenario 5, scale-out on loopback: the same offered load against 1 edge + 1 GPU
consumer, then against 2 edges + 2 GPU consumers (a second group member takes half the
partitions; the second edge owns its own reply partition)."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.stack import bench_stack, serve_config
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.loadgen.serve import run_serve

OUTPUT_TOKENS = 32
MAX_NUM_SEQS = 16  # one consumer serves about 16 / 0.66 s = 24 req/s
SIM = SimulatedEngineSettings(seed=5, ttft_ms=20, tokens_per_s=50, min_tokens=OUTPUT_TOKENS, max_tokens=OUTPUT_TOKENS)
RATE = 36.0
REQUESTS = 216


def measure(base_urls: str, api_key: str) -> dict[str, Any]:
    config = serve_config(base_urls, api_key, num_prompts=REQUESTS, request_rate=RATE, output_len=OUTPUT_TOKENS, warmup=4)
    s, _ = asyncio.run(run_serve(config))
    return {"completed": s.completed, "failed": s.failed, "request_throughput": round(s.request_throughput, 2),
            "output_throughput": round(s.output_throughput, 1), "ttft_p50": round(s.ttft_ms["median"], 1),
            "ttft_p99": round(s.ttft_ms["p99"], 1), "e2el_p50": round(s.e2el_ms["median"], 1)}


def run() -> dict[str, Any]:
    with bench_stack(SIM, max_num_seqs=MAX_NUM_SEQS) as stack:
        one = measure(stack.edge_url, stack.dev_key)
        stack.start_worker("gpu-consumer-2", free_port())
        edge_port = free_port()
        stack.start_edge("edge-2", edge_port, reply_partitions="1")
        two = measure(f"{stack.edge_url},http://{stack.settings.host}:{edge_port}", stack.dev_key)
    return {"scenario": "scale_out", "engine": SIM.model_dump(), "max_num_seqs": MAX_NUM_SEQS, "offered_rate": RATE,
            "rows": [{"shape": "1 edge + 1 consumer", **one}, {"shape": "2 edges + 2 consumers", **two}]}


def table(result: dict[str, Any]) -> str:
    lines = [f"offered {result['offered_rate']:g} req/s Poisson, {REQUESTS} requests", "",
             "| shape | done | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | E2EL p50 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['shape']} | {r['completed']} | {r['failed']} | {r['request_throughput']} | "
                     f"{r['output_throughput']} | {r['ttft_p50']} | {r['ttft_p99']} | {r['e2el_p50']} |")
    return "\n".join(lines)
