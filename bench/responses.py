"""Scenario: what a turn costs through the Responses API, or kept as a stored chat completion, beside
the same turn as a chat completion.

Through the embedded stack, alternating turn by turn (so each kind sees the same moments of this
noisy machine), ``TURNS`` of each, every one the same prompt and seed (so the same 64 tokens):

- ``chat`` and ``chat_stream``: ``POST /v1/chat/completions``, whole and streamed: the reference;
- ``chat_stored`` and ``chat_stored_stream``: the same with ``store: true`` (what keeping the
  completion costs: a stream's made from its events as they go by, and none written directly);
- ``responses`` and ``responses_stream``: ``POST /v1/responses``, stored (its default);
- ``responses_unstored``: ``store: false`` (what storing costs is the difference);
- ``responses_chained``: ``previous_response_id`` of the kind's turn before (a chain of up to
  ``CHAIN`` turns, then a new one): loading the chain, and a longer prompt;
- ``responses_conversation``: ``conversation``, a conversation object of up to ``CHAIN`` turns
  (then a new one, made before the turn is timed): loading its items, holding it for the turn,
  adding the turn's;
- ``responses_compact``: ``POST /v1/responses/compact`` of a two-message context: its summary
  is the turn's 64 tokens, answered whole with the compaction item.

Reported: each kind's latency p50 and p99 and the edge's CPU time per turn (read around each
turn), and each as a ratio of the chat turn of the same delivery (whole or streamed).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.stack import MODEL, cpu_seconds, latency_and_cpu, measure_edge
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings

TURNS = 400
CHAIN = 8
PROMPT = "Tell me about the rivers of Europe."
SIM = SimulatedEngineSettings(seed=1, ttft_ms=5, tokens_per_s=4000, min_tokens=64, max_tokens=64)
KINDS = ("chat", "chat_stream", "chat_stored", "chat_stored_stream", "responses", "responses_stream",
         "responses_unstored", "responses_chained", "responses_conversation", "responses_compact")
REFERENCE = {"chat": "chat", "chat_stream": "chat_stream", "chat_stored": "chat",
             "chat_stored_stream": "chat_stream", "responses": "chat", "responses_stream": "chat_stream",
             "responses_unstored": "chat", "responses_chained": "chat", "responses_conversation": "chat",
             "responses_compact": "chat"}
CONTEXT = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "The Danube, the Rhine and the Loire."}]


class Turns:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.previous: str | None = None  # the chain's last response
        self.chained = 0  # turns in the chain
        self.conversation: str | None = None
        self.in_conversation = 0  # turns in it

    async def prepare(self, kind: str) -> None:
        """What a turn needs made before it is timed: a new conversation, once the last is full."""
        if kind == "responses_conversation" and (self.conversation is None or self.in_conversation == CHAIN):
            made = await self.http.post("/v1/conversations", json={})
            made.raise_for_status()
            self.conversation, self.in_conversation = made.json()["id"], 0

    async def one(self, kind: str) -> None:
        if kind.startswith("chat"):
            body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "seed": 5,
                                    "store": kind.startswith("chat_stored")}
            path = "/v1/chat/completions"
        elif kind == "responses_compact":
            body, path = {"model": MODEL, "input": CONTEXT, "seed": 5}, "/v1/responses/compact"
        else:
            body = {"model": MODEL, "input": PROMPT, "seed": 5, "store": kind != "responses_unstored"}
            path = "/v1/responses"
            if kind == "responses_chained" and self.previous is not None:
                body["previous_response_id"] = self.previous
            if kind == "responses_conversation":
                body["conversation"] = self.conversation
                self.in_conversation += 1
        if kind.endswith("_stream"):
            async with self.http.stream("POST", path, json={**body, "stream": True}) as streamed:
                streamed.raise_for_status()
                async for _ in streamed.aiter_bytes():
                    pass
            return
        answered = await self.http.post(path, json=body)
        answered.raise_for_status()
        if kind == "responses_chained":
            self.chained = self.chained + 1 if self.chained < CHAIN else 1
            self.previous = answered.json()["id"] if self.chained < CHAIN else None


async def alternate(edge_url: str, api_key: str, edge_pid: int) -> dict[str, dict[str, list[float]]]:
    measured: dict[str, dict[str, list[float]]] = {k: {"latency": [], "cpu": []} for k in KINDS}
    async with httpx.AsyncClient(base_url=edge_url, timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as http:
        turns = Turns(http)
        for kind in KINDS:
            await turns.prepare(kind)
            await turns.one(kind)  # warm-up
        for _ in range(TURNS):
            for kind in KINDS:
                await turns.prepare(kind)
                before, started = cpu_seconds(edge_pid), time.perf_counter()
                await turns.one(kind)
                measured[kind]["latency"].append((time.perf_counter() - started) * 1000)
                measured[kind]["cpu"].append(cpu_seconds(edge_pid) - before)
    return measured


def run() -> dict[str, Any]:
    measured = measure_edge(SIM, alternate)
    kinds = latency_and_cpu(measured, TURNS, "turn")
    for kind, k in kinds.items():
        reference = kinds[REFERENCE[kind]]
        k["p50_vs_chat"] = round(k["p50_ms"] / reference["p50_ms"], 3)
        k["cpu_vs_chat"] = round(k["edge_cpu_us_per_turn"] / reference["edge_cpu_us_per_turn"], 3)
    return {"scenario": "responses", "turns": TURNS, "output_tokens": SIM.max_tokens, "chain": CHAIN, "kinds": kinds}


def table(result: dict[str, Any]) -> str:
    lines = ["| turn | p50 ms | p99 ms | vs chat | edge CPU µs / turn | vs chat |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {kind} | {k['p50_ms']} | {k['p99_ms']} | {k['p50_vs_chat']} | {k['edge_cpu_us_per_turn']} | "
              f"{k['cpu_vs_chat']} |" for kind, k in result["kinds"].items()]
    lines.append("\n(each against the chat turn of the same delivery: whole, or streamed)")
    return "\n".join(lines)
