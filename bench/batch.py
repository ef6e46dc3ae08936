"""Scenario: a batch (OpenAI's Batch API) beside the same requests sent one by one, and what a
running batch does to interactive work.

Through the embedded stack, ``REQUESTS`` chat requests of ``TOKENS`` tokens each, in turn:

- ``one_by_one``: sent as plain (not streamed) chat completions, ``CLIENT_CONCURRENCY`` at a
  time (as many as the GPU consumer runs at once), as a client with a connection pool sends a
  job's requests: the reference;
- ``batch``: one file uploaded, one batch created and polled every ``POLL_S`` until it is
  completed, its output file downloaded. Its requests run at the batch tier, all published at
  once (the request log is the queue), its outcomes gathered by the batches processor.

Reported for each: the wall time from the first byte sent to the last answer in hand, and the
CPU time of the edge and of the processors over it, per request. Then interactive chats
(``PROBES``, one at a time) on an idle stack and while a batch of ``REQUESTS`` runs: their time
to the first token. The GPU consumer admits by tier as sequences free up, so an interactive
request waits at most for one batch sequence to end, not for the batch.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack, cpu_seconds
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings

TOKENS = 32
REQUESTS = 400
MAX_NUM_SEQS = 64
CLIENT_CONCURRENCY = MAX_NUM_SEQS  # enough to keep the engine as full as the batch does
SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=200, min_tokens=TOKENS, max_tokens=TOKENS)
POLL_S = 0.25
PROBES = 20


def chat_body(i: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Summarize document {i}."}], "seed": i}


async def one_by_one(http: httpx.AsyncClient) -> int:
    slots = asyncio.Semaphore(CLIENT_CONCURRENCY)

    async def one(i: int) -> int:
        async with slots:
            response = await http.post("/v1/chat/completions", json=chat_body(i))
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

    return sum(await asyncio.gather(*(one(i) for i in range(REQUESTS))))


async def start_batch(http: httpx.AsyncClient) -> str:
    lines = "".join(json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": chat_body(i)}) + "\n" for i in range(REQUESTS))
    uploaded = await http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("docs.jsonl", lines.encode())})
    uploaded.raise_for_status()
    created = await http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                   "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    created.raise_for_status()
    return str(created.json()["id"])


async def batch_output(http: httpx.AsyncClient, batch_id: str) -> int:
    while True:
        batch = (await http.get(f"/v1/batches/{batch_id}")).json()
        if batch["status"] == "completed":
            break
        assert batch["status"] == "in_progress", batch
        await asyncio.sleep(POLL_S)
    output = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text.splitlines()
    assert len(output) == REQUESTS
    return sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in output)


async def batch(http: httpx.AsyncClient) -> int:
    return await batch_output(http, await start_batch(http))


async def probe_ttft(http: httpx.AsyncClient) -> list[float]:
    """Time to the first content chunk of interactive chats, one at a time."""
    found = []
    for i in range(PROBES):
        sent = time.perf_counter()
        body = {**chat_body(10_000 + i), "stream": True}
        first = None
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():  # read to its end: the next probe starts on a quiet edge
                if first is None and line.startswith("data: {") and '"content":"' in line:
                    first = (time.perf_counter() - sent) * 1000
        assert first is not None, "a probe produced nothing"
        found.append(first)
    return found


async def measure(edge_url: str, batch_key: str, interactive_key: str, pids: dict[str, int]) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    async with (httpx.AsyncClient(base_url=edge_url, timeout=120,
                                  headers={"Authorization": f"Bearer {batch_key}"}) as http,
                httpx.AsyncClient(base_url=edge_url, timeout=120,
                                  headers={"Authorization": f"Bearer {interactive_key}"}) as interactive):
        await one_by_one(http)  # warm-up: connections, caches, the engine
        for name, run_kind in (("one_by_one", one_by_one), ("batch", batch)):
            before = {role: cpu_seconds(pid) for role, pid in pids.items()}
            started = time.perf_counter()
            tokens = await run_kind(http)
            wall = time.perf_counter() - started
            kinds[name] = {"wall_s": round(wall, 2), "tokens": tokens,
                           **{f"{role}_cpu_ms_per_request": round(1000 * (cpu_seconds(pid) - before[role]) / REQUESTS, 2)
                              for role, pid in pids.items()}}
        idle = await probe_ttft(interactive)
        batch_id = await start_batch(http)
        busy = await probe_ttft(interactive)
        await batch_output(http, batch_id)
    reference = kinds["one_by_one"]
    for kind in kinds.values():
        kind["wall_vs_one_by_one"] = round(kind["wall_s"] / reference["wall_s"], 3)
        kind["edge_cpu_vs_one_by_one"] = round(kind["edge_cpu_ms_per_request"] / reference["edge_cpu_ms_per_request"], 3)
    probes = {"idle_ttft_p50_ms": round(statistics.median(idle), 1), "idle_ttft_max_ms": round(max(idle), 1),
              "during_batch_ttft_p50_ms": round(statistics.median(busy), 1),
              "during_batch_ttft_max_ms": round(max(busy), 1)}
    return {"kinds": kinds, "interactive": probes}


def run() -> dict[str, Any]:
    with bench_stack(SIM, max_num_seqs=MAX_NUM_SEQS) as stack:
        pids = {role: stack.processes[role].pid for role in ("edge", "processors")}
        assert all(pid is not None for pid in pids.values())
        batch_key = asyncio.run(stack.create_key("bench-batch", "standard"))
        interactive_key = asyncio.run(stack.create_key("bench-interactive", "interactive"))
        measured = asyncio.run(measure(stack.edge_url, batch_key, interactive_key, pids))  # type: ignore[arg-type]
    return {"scenario": "batch", "engine": SIM.model_dump(), "requests": REQUESTS, "max_num_seqs": MAX_NUM_SEQS,
            "client_concurrency": CLIENT_CONCURRENCY, **measured}


def table(result: dict[str, Any]) -> str:
    lines = ["| requests sent as | wall s | vs one_by_one | edge CPU ms / request | vs one_by_one | "
             "processors CPU ms / request |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {kind} | {k['wall_s']} | {k['wall_vs_one_by_one']} | {k['edge_cpu_ms_per_request']} | "
              f"{k['edge_cpu_vs_one_by_one']} | {k['processors_cpu_ms_per_request']} |"
              for kind, k in result["kinds"].items()]
    p = result["interactive"]
    lines += ["", "| interactive chats | TTFT p50 ms | TTFT max ms |", "|---|---:|---:|",
              f"| idle stack | {p['idle_ttft_p50_ms']} | {p['idle_ttft_max_ms']} |",
              f"| while a batch of {result['requests']} runs | {p['during_batch_ttft_p50_ms']} | "
              f"{p['during_batch_ttft_max_ms']} |"]
    return "\n".join(lines)
