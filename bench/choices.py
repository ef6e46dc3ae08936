"""Scenario: what a response of several choices (OpenAI's ``n``) costs beside as many requests.

Through the embedded stack, in turn, one kind at a time and in a rotating order (so each sees the
same moments of this noisy machine), streaming chats of ``TOKENS`` tokens a choice:

- ``n1``: one choice, the reference;
- ``n4``: one request with ``n: 4``, four requests on the bus read back by the edge as one
  stream (a ReplyGroup: each event through a queue and the stream's task, not written directly
  from the reply router's callback as a single stream's are);
- ``four_requests``: four requests of one choice each, at once, as a client without ``n`` sends them.

Reported: time to the first content chunk and to the last, and the edge process's CPU time per
token event relayed, each kind's own (read around each of its turns).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.stack import MODEL, cpu_seconds, measure_edge
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings

TOKENS = 64
SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=200, min_tokens=TOKENS, max_tokens=TOKENS)
ROUNDS = 30
WARMUP = 3
GAP_S = 0.2
QUESTION = [{"role": "user", "content": "Name four rivers."}]
KINDS = {"n1": (1, 1), "n4": (4, 1), "four_requests": (1, 4)}  # (n, requests at once)


async def one_stream(http: httpx.AsyncClient, edge_url: str, n: int, sent: float) -> tuple[float, float, int]:
    """(ms to the first content chunk, ms to the last, content chunks) of one streaming request."""
    first = last = None
    chunks = 0
    body = {"model": MODEL, "messages": QUESTION, "stream": True, "n": n}
    async with http.stream("POST", f"{edge_url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line.removeprefix("data: "))["choices"]
            if choices and choices[0]["delta"].get("content"):
                chunks += 1
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None, "a request produced nothing"
    return (first - sent) * 1000, (last - sent) * 1000, chunks


async def one_turn(http: httpx.AsyncClient, edge_url: str, n: int, at_once: int) -> tuple[float, float, int]:
    sent = time.perf_counter()
    streams = await asyncio.gather(*(one_stream(http, edge_url, n, sent) for _ in range(at_once)))
    return min(s[0] for s in streams), max(s[1] for s in streams), sum(s[2] for s in streams)


async def alternate(edge_url: str, api_key: str, edge_pid: int) -> dict[str, dict[str, list[float]]]:
    measured: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "last": [], "cpu": [], "chunks": []} for k in KINDS}
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as http:
        kinds = list(KINDS.items())
        for i in range(ROUNDS + WARMUP):
            # Each round in another order: a request after a quiet spell (the reference's short turn)
            # meets an idler worker, and would be slower whatever its kind.
            for kind, (n, at_once) in kinds[i % 3:] + kinds[:i % 3]:
                before = cpu_seconds(edge_pid)
                ttft, last, chunks = await one_turn(http, edge_url, n, at_once)
                cpu = cpu_seconds(edge_pid) - before
                if i >= WARMUP:
                    for name, value in (("ttft", ttft), ("last", last), ("cpu", cpu), ("chunks", chunks)):
                        measured[kind][name].append(value)
                await asyncio.sleep(GAP_S)
    return measured


def run() -> dict[str, Any]:
    measured = measure_edge(SIM, alternate)
    kinds = {}
    for kind, m in measured.items():
        us_per_event = 1e6 * sum(m["cpu"]) / max(sum(m["chunks"]), 1)
        kinds[kind] = {"ttft_p50_ms": round(statistics.median(m["ttft"]), 1),
                       "last_chunk_p50_ms": round(statistics.median(m["last"]), 1),
                       "edge_cpu_us_per_event": round(us_per_event, 1),
                       "content_chunks_per_turn": round(statistics.mean(m["chunks"]), 1)}
    reference = kinds["four_requests"]["edge_cpu_us_per_event"]
    for k in kinds.values():
        k["cpu_vs_four_requests"] = round(k["edge_cpu_us_per_event"] / reference, 3)
    return {"scenario": "choices", "engine": SIM.model_dump(), "rounds": ROUNDS, "kinds": kinds}


def table(result: dict[str, Any]) -> str:
    lines = ["| request | TTFT p50 ms | last chunk p50 ms | content chunks a turn | edge CPU µs / event | vs four_requests |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {kind} | {k['ttft_p50_ms']} | {k['last_chunk_p50_ms']} | {k['content_chunks_per_turn']} | "
              f"{k['edge_cpu_us_per_event']} | {k['cpu_vs_four_requests']} |" for kind, k in result["kinds"].items()]
    return "\n".join(lines)
