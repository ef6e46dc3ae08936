"""Scenario 3, SSE fan-out: how many concurrent streams one edge process holds, and its memory
per open stream. Streams are long and slow (one token every five seconds), so they stay open
while the count ramps up to 10,000; each level is measured with all its streams open and
relaying, and at the end every stream must have delivered every token.

The client side is a minimal HTTP/1.1 reader (asyncio streams, chunked bodies, SSE frames), not
httpx or the openai client: ten thousand of those would cost the shared cores more than the edge
under test."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.plots import plot_fanout
from bench.stack import MODEL, bench_stack, process_rss_kib
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings

LEVELS = (1000, 2500, 5000, 7500, 10_000)
TOKENS_PER_STREAM = 24
OPEN_PER_SECOND = 400  # connections opened at this pace, not all at once (the listen backlog)
SIM = SimulatedEngineSettings(seed=3, ttft_ms=10, tokens_per_s=0.2, min_tokens=10_000, max_tokens=10_000,
                              kv_cache_tokens=10_000_000)
ADMIT_ALL = {"TOKENBUS_WORKER_MAX_TOKENS_IN_FLIGHT": "10000000"}


@dataclass
class StreamResult:
    status: int = 0
    chunks: int = 0  # data frames with a chat.completion.chunk
    done: bool = False
    error: str = ""

    @property
    def complete(self) -> bool:
        # the role chunk, one per token, and [DONE]
        return self.status == 200 and self.done and self.chunks == TOKENS_PER_STREAM + 1


async def sse_stream(host: str, port: int, api_key: str, result: StreamResult,
                     max_tokens: int = TOKENS_PER_STREAM) -> None:
    """One streaming chat completion over a raw connection: its frames counted, nothing kept."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hold this stream open"}]}).encode()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        result.error = f"connect: {exc}"
        return
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), api_key.encode(), len(body), body))
        result.status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        if result.status != 200:  # an error in OpenAI's format, with a Content-Length
            result.error = f"HTTP {result.status}: " + (await reader.read(300)).decode(errors="replace")
            return
        pending = b""
        while not result.done:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *frames, pending = pending.split(b"\n\n")
            for data in frames:
                if data == b"data: [DONE]":
                    result.done = True
                elif data.startswith(b'data: {"id"'):
                    result.chunks += 1
                elif data.startswith(b"data: "):
                    result.error = data[6:200].decode(errors="replace")
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()


async def open_streams(edge_url: str, api_key: str, edge_pid: int) -> dict[str, Any]:
    host, port = edge_url.split("//", 1)[1].rsplit(":", 1)
    async with httpx.AsyncClient(timeout=30) as http:
        warm = StreamResult()
        await sse_stream(host, int(port), api_key, warm, max_tokens=1)  # warm the edge before the baseline
        baseline = process_rss_kib(edge_pid)
        results: list[StreamResult] = []
        tasks: list[asyncio.Task] = []
        levels = []
        ramp_s = 0.0
        for level in LEVELS:
            started = time.monotonic()
            while len(tasks) < level:
                results.append(StreamResult())
                tasks.append(asyncio.create_task(sse_stream(host, int(port), api_key, results[-1])))
                if len(tasks) % (OPEN_PER_SECOND // 10) == 0:
                    await asyncio.sleep(0.1)
            open_now = await wait_for_open(http, edge_url, level)
            ramp_s += time.monotonic() - started
            rss = process_rss_kib(edge_pid)
            levels.append({"streams": level, "open_at_edge": open_now, "edge_rss_mib": round(rss / 1024, 1),
                           "kib_per_stream": round((rss - baseline) / level, 1)})
        await asyncio.gather(*tasks)
    errors: dict[str, int] = {}
    for r in results:
        if not r.complete:
            reason = r.error or f"HTTP {r.status}, {r.chunks} chunks, done={r.done}"
            errors[reason[:120]] = errors.get(reason[:120], 0) + 1
    return {"baseline_rss_mib": round(baseline / 1024, 1), "levels": levels, "streams_total": len(results),
            "streams_complete": sum(r.complete for r in results), "failures": errors,
            "seconds_to_open_all": round(ramp_s, 1)}


async def wait_for_open(http: httpx.AsyncClient, edge_url: str, target: int, timeout: float = 120) -> int:
    """Wait until the edge reports ``target`` open streams (all connected and relaying)."""
    deadline = time.monotonic() + timeout
    open_now = 0
    while time.monotonic() < deadline:
        open_now = (await http.get(f"{edge_url}/healthz")).json()["open_streams"]
        if open_now >= target:
            await asyncio.sleep(2)  # the newest streams' first frames are out by now
            break
        await asyncio.sleep(0.5)
    return open_now


def run() -> dict[str, Any]:
    # Every stream runs at once: the consumer's budget of tokens in flight must not hold any back.
    with bench_stack(SIM, max_num_seqs=max(LEVELS) + 64, extra_env=ADMIT_ALL) as stack:
        edge_pid = stack.processes["edge"].pid
        assert edge_pid is not None
        measured = asyncio.run(open_streams(stack.edge_url, stack.dev_key, edge_pid))
    return {"scenario": "sse_fanout", "engine": SIM.model_dump(), "tokens_per_stream": TOKENS_PER_STREAM, **measured}


def table(result: dict[str, Any]) -> str:
    lines = [f"edge RSS before: {result['baseline_rss_mib']} MiB; streams that completed with every token: "
             f"{result['streams_complete']} / {result['streams_total']} (opened in "
             f"{result['seconds_to_open_all']} s)", "",
             "| open streams | seen open at edge | edge RSS MiB | KiB per stream |", "|---:|---:|---:|---:|"]
    for level in result["levels"]:
        lines.append(f"| {level['streams']} | {level['open_at_edge']} | {level['edge_rss_mib']} | {level['kib_per_stream']} |")
    if result["failures"]:
        lines += ["", "failed streams: " + "; ".join(f"{reason}: {n}" for reason, n in result["failures"].items())]
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path) -> Path:
    return plot_fanout(result["levels"], out_dir / "sse_fanout.png")
