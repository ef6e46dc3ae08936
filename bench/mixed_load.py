"""A light edge beside a loaded one: one client at a time through a second edge, alone and while the
main edge keeps 16 streams running on the same GPU consumer. What the light edge's client waits
(TTFT, ITL) and what the light edge spends a request (CPU) say whether it keeps the express lane
(docs/architecture.md) while the consumer it shares is loaded by someone else. Alone, the GPU
consumer's CPU a request is the light client's alone: at concurrency 1 it hands each token event
over on the express lane.

Phases alternate, `TOKENBUS_BENCH_MIXED_ROUNDS` (2) rounds of `TOKENBUS_BENCH_MIXED_REQUESTS` (32)
requests each, `peers`' simulated engine; the load runs in a process of its own, as a second
client would. Also, in this process: the CPU a hand-over costs the process that makes it, with 1, 4
and 16 handed over in one pass of its event loop (a GPU consumer's step serving that many light
streams), net of the pass itself."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from typing import Any

from bench import peers
from bench.stack import bench_stack, cpu_seconds, serve_config
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.loadgen import RequestResult, summarize
from tokenbus.infra.loadgen.serve import ServeConfig, run_serve
from tokenbus.topics.doorbell import Doorbell

ROUNDS = int(os.environ.get("TOKENBUS_BENCH_MIXED_ROUNDS", "2"))
REQUESTS = int(os.environ.get("TOKENBUS_BENCH_MIXED_REQUESTS", "32"))
LOAD_CONCURRENCY = 16
LIGHT_EDGE_REPLY_PARTITIONS = "0-7"  # the main edge has 8-23
LOAD_SETTLE_S = 3.0  # the load's streams all running before the light client starts
HANDOVER_PASSES = 1000


def config(url: str, key: str, requests: int, concurrency: int) -> ServeConfig:
    return serve_config(url, key, warmup=0, num_prompts=requests, max_concurrency=concurrency,
                        output_len=peers.OUTPUT_TOKENS, percentile_metrics=("ttft", "itl", "e2el"))


def keep_loading(url: str, key: str) -> None:
    """In a process of its own until killed: the main edge's 16 streams, more than a phase takes
    (and few enough that making their prompts takes no time)."""
    asyncio.run(run_serve(config(url, key, 64 * REQUESTS, LOAD_CONCURRENCY)))


def handover_cpu_us(redis_url: str, topic_prefix: str) -> dict[int, float]:
    """µs of CPU a hand-over costs, by how many are handed over in each pass of the event loop."""

    async def per_record(records: int) -> float:
        lane = Doorbell(redis_url, topic_prefix, ring_every_s=60)

        async def passes(count: int, records: int) -> float:
            started = time.process_time()
            for _ in range(count):
                for offset in range(records):
                    lane.hand_over(f"{topic_prefix}bench-handover", 0, offset, b"request", b"x" * 120)
                await asyncio.sleep(0.001)
            return time.process_time() - started

        try:
            await passes(50, records)  # the connection made
            spent = await passes(HANDOVER_PASSES, records) - await passes(HANDOVER_PASSES, 0)
        finally:
            await lane.close()
        return round(1e6 * spent / (HANDOVER_PASSES * records), 1)

    return {records: asyncio.run(per_record(records)) for records in (1, 4, 16)}


def run() -> dict[str, Any]:
    with bench_stack(peers.SIM) as stack:
        light_port = free_port()
        light_edge = stack.start_edge("light-edge", light_port, reply_partitions=LIGHT_EDGE_REPLY_PARTITIONS)
        light_url = f"http://{stack.settings.host}:{light_port}"
        asyncio.run(run_serve(config(stack.edge_url, stack.dev_key, 16, 4)))  # warm both paths
        asyncio.run(run_serve(config(light_url, stack.dev_key, 8, 1)))
        results: dict[str, list[RequestResult]] = {"alone": [], "beside load": []}
        cpu = {phase: 0.0 for phase in results}
        consumer = next(p for name, p in stack.processes.items() if name.startswith("gpu-consumer"))
        consumer_cpu = 0.0  # alone: the light client's requests only
        for _ in range(ROUNDS):
            for phase in results:
                loader = None
                if phase == "beside load":
                    loader = multiprocessing.get_context("fork").Process(
                        target=keep_loading, args=(stack.edge_url, stack.dev_key), daemon=True)
                    loader.start()
                    time.sleep(LOAD_SETTLE_S)
                before, consumer_before = cpu_seconds(light_edge.pid), cpu_seconds(consumer.pid)
                _, batch = asyncio.run(run_serve(config(light_url, stack.dev_key, REQUESTS, 1)))
                cpu[phase] += cpu_seconds(light_edge.pid) - before
                if phase == "alone":
                    consumer_cpu += cpu_seconds(consumer.pid) - consumer_before
                results[phase] += batch
                if loader is not None:
                    assert loader.is_alive(), "the load ended before the light client's requests did"
                    loader.kill()
                    loader.join()
                time.sleep(1)  # the load's streams, cut off, wound down
        bus = stack.bus_settings()
        broker = bus.broker
        assert bus.doorbell_url
        handover = handover_cpu_us(bus.doorbell_url, bus.topic_prefix)
    rows = []
    for phase, batch in results.items():
        s = summarize(batch, 1.0, (50.0, 99.0))
        rows.append({"phase": phase, "requests": len(batch), "failed": s.failed,
                     "ttft_ms": {k: round(s.ttft_ms[k], 2) for k in ("median", "p99")},
                     "itl_ms": {k: round(s.itl_ms[k], 2) for k in ("median", "p99")},
                     "light_edge_cpu_ms_per_request": round(1000 * cpu[phase] / max(len(batch), 1), 2)})
    alone = len(results["alone"])
    return {"scenario": "mixed_load", "engine": peers.SIM.model_dump(), "broker": broker, "rounds": ROUNDS,
            "load_concurrency": LOAD_CONCURRENCY, "rows": rows, "handover_cpu_us": handover,
            "gpu_consumer_cpu_ms_per_request_alone": round(1000 * consumer_cpu / max(alone, 1), 2)}


def table(result: dict[str, Any]) -> str:
    lines = ["| light edge, concurrency 1 | requests | failed | TTFT p50 / p99 ms | ITL p50 / p99 ms"
             " | light edge CPU ms a request |", "|---|---:|---:|---|---|---:|"]
    for row in result["rows"]:
        ttft, itl = row["ttft_ms"], row["itl_ms"]
        lines.append(f"| {row['phase']} | {row['requests']} | {row['failed']} | {ttft['median']} / {ttft['p99']}"
                     f" | {itl['median']} / {itl['p99']} | {row['light_edge_cpu_ms_per_request']} |")
    return "\n".join(lines) + (f"\n\nthe load: {result['load_concurrency']} streams through the main edge on the same"
                               f" GPU consumer; {result['rounds']} rounds alternating; `{result['broker']}` client profile"
                               f"\n\nthe GPU consumer's CPU a request, the light client alone: "
                               f"{result['gpu_consumer_cpu_ms_per_request_alone']} ms"
                               "\n\nCPU a hand-over costs its writer, by hand-overs in one pass of its event loop: "
                               + ", ".join(f"{n}: {us} µs" for n, us in result["handover_cpu_us"].items()))
