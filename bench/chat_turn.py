"""Scenario: what the parts of a whole chat turn add to time to first token, at concurrency 1.

Three kinds of streaming request through the embedded stack, in turn, one at a time (so each
kind sees the same moments of this noisy machine):

- ``plain``: a user message, no tools;
- ``tools_answered_in_words``: two tools offered and a tool's result in the history, so the
  model answers in words, every token passing through the worker's tool-call parser, with the
  tool definitions rendered into the prompt and carried on the bus;
- ``tool_call``: two tools offered, answered with two calls. Its first chunk is the first call's
  header, sent once that call's markup has closed (a call cannot run before its arguments are
  whole), so its TTFT includes generating the markup; ``calls_done_ms`` is when both are complete;
- ``server_history``: the user message of ``plain`` in a conversation of ``HISTORY_TURNS`` stored
  turns (and growing by one each round), loaded by the edge (``metadata.history = "server"``):
  a conversation row read from the transcript store and the turns from Redis, fitted into the
  context window, and a longer prompt on the bus.

And, in process, the parser's own cost per generated token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.gpu_consumers.engines.tool_calls import HermesToolParser, render_call

SIM = SimulatedEngineSettings(seed=1, ttft_ms=20, tokens_per_s=100, min_tokens=8, max_tokens=8)
ROUNDS = 40
WARMUP = 3
GAP_S = 0.3
TOOLS = [{"type": "function", "function": {"name": name, "description": f"Look up the {name} of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}
         for name in ("weather", "time")]
QUESTION = {"role": "user", "content": "What are the weather and the time in Oslo?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "3 C and rain"}
HISTORY_TURNS = 20
CONVERSATION = {"conversation_id": "bench-history"}
KINDS = {
    "plain": {"messages": [QUESTION]},
    "tools_answered_in_words": {"messages": [QUESTION, CALLED, RESULT], "tools": TOOLS},
    "tool_call": {"messages": [QUESTION], "tools": TOOLS},
    "server_history": {"messages": [QUESTION], "metadata": {**CONVERSATION, "history": "server"}},
}


async def one_turn(http: httpx.AsyncClient, edge_url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(ms to the first content or tool-call chunk, ms to the last chunk)."""
    sent = time.perf_counter()
    first = last = None
    async with http.stream("POST", f"{edge_url}/v1/chat/completions", json={"model": MODEL, "stream": True, **body}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            if delta.get("content") or delta.get("tool_calls"):
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None, "a turn produced nothing"
    return (first - sent) * 1000, (last - sent) * 1000


async def alternate(edge_url: str, api_key: str) -> dict[str, list[tuple[float, float]]]:
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    async with httpx.AsyncClient(timeout=30, headers={"Authorization": f"Bearer {api_key}"}) as http:
        for i in range(HISTORY_TURNS):  # the conversation server_history continues
            await one_turn(http, edge_url, {"messages": [{"role": "user", "content": f"earlier question {i}"}],
                                            "metadata": CONVERSATION})
        for i in range(ROUNDS + WARMUP):
            for kind, body in KINDS.items():
                measured = await one_turn(http, edge_url, body)
                if i >= WARMUP:
                    times[kind].append(measured)
                await asyncio.sleep(GAP_S)
    return times


def parser_cost_us(tokens: int = 20_000) -> dict[str, float]:
    """Microseconds per generated token the parser adds: plain words, and call markup."""
    words = [" word"] * tokens
    markup = render_call("weather", {"city": "Oslo", "days": 3}) * (tokens // 60)
    pieces = [markup[i:i + 4] for i in range(0, len(markup), 4)]
    out = {}
    for name, feed in (("words", words), ("markup", pieces)):
        parser = HermesToolParser("bench", {"weather"})
        started = time.perf_counter()
        for piece in feed:
            parser.feed(piece)
        out[f"{name}_us_per_token"] = round((time.perf_counter() - started) * 1e6 / len(feed), 2)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def run() -> dict[str, Any]:
    with bench_stack(SIM) as stack:
        times = asyncio.run(alternate(stack.edge_url, stack.dev_key))
    plain = statistics.median(t for t, _ in times["plain"])
    kinds = {}
    for kind, measured in times.items():
        ttft = [t for t, _ in measured]
        kinds[kind] = {"ttft_p50_ms": round(statistics.median(ttft), 1), "ttft_p99_ms": percentile(ttft, 0.99),
                       "ttft_vs_plain": round(statistics.median(ttft) / plain, 3),
                       "last_chunk_p50_ms": round(statistics.median(d for _, d in measured), 1)}
    return {"scenario": "chat_turn", "engine": SIM.model_dump(), "rounds": ROUNDS, "kinds": kinds,
            "parser": parser_cost_us(), "engine_step_ms": 1000 / SIM.tokens_per_s}


def table(result: dict[str, Any]) -> str:
    lines = ["| request | TTFT p50 ms | TTFT p99 ms | TTFT / plain | last chunk p50 ms |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {kind} | {k['ttft_p50_ms']} | {k['ttft_p99_ms']} | {k['ttft_vs_plain']} | {k['last_chunk_p50_ms']} |"
              for kind, k in result["kinds"].items()]
    parser = result["parser"]
    return "\n".join(lines) + (f"\n\nparser, in process: {parser['words_us_per_token']} µs per word token, "
                               f"{parser['markup_us_per_token']} µs per markup token "
                               f"(an engine step here: {result['engine_step_ms']:.0f} ms)")
