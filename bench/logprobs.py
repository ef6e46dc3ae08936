"""What asking for log probabilities costs a token on the pipeline's own path, in process: a GPU
consumer making a step's token event and writing it, an edge reading it and rendering its chunk,
for a token with no scores (a request that does not ask), with its own score only
(``logprobs: true``) and with five likeliest tokens' (``top_logprobs: 5``), the last two as ratios
to the first, measured in one run.

The engine's side is not here: the simulated engine's scores are Python over its small vocabulary
and say nothing of a GPU's, where the `hf` slots add a log-softmax and a top-k of the rows that ask
to the step (hf_slot_logprobs.py) and TensorRT-LLM computes its own. Rounds alternate and the best
of each counts; every way's chunk is checked against what the edge serves first."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenbus.gpu_consumers.engines import StepOutput
from tokenbus.gpu_consumers.step_events import StepEvents
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, TokenEvent, TokenLogprob, TopLogprob
from tokenbus.sse_edge.plumbing.relay import event_chunks
from tokenbus.sse_edge.protocol.completion_bodies import ChunkWriter

ROUNDS = 5
CALLS = 5_000
WAYS = {"not asked": None, "logprobs": 0, "top_logprobs 5": 5}
WORDS = [" shipment", " arrives", " on", " Tuesday", " morning", " in"]


def step(top: int | None) -> StepOutput:
    """A mid-stream step of one token, scored as a request asking ``top`` would have it."""
    scored = () if top is None else (
        TokenLogprob(" shipment", -0.3125, [TopLogprob(w, -0.3125 - i) for i, w in enumerate(WORDS[:top])]),)
    return StepOutput(" shipment", (53_112,), 412, 41, logprobs=scored)


def request(top: int | None) -> ChatRequest:
    return ChatRequest("chatcmpl-4f9c2a7be1d04c35", "tokenbus-sim", "standard",
                       [ChatMessage("user", "When does the shipment arrive?")], "tokens", 3,
                       logprobs=top is not None, top_logprobs=top or 0)


def best_us(call: Callable[[], Any], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def run(calls: int = CALLS, rounds: int = ROUNDS) -> dict[str, Any]:
    codec = AvroCodec()
    consumer: dict[str, Callable[[], Any]] = {}
    edge: dict[str, Callable[[], Any]] = {}
    sizes: dict[str, int] = {}
    for way, top in WAYS.items():
        events, out = StepEvents(request(top), "gpu-0", "hermes"), step(top)
        data = codec.encode(events.event(41, out))
        sizes[way] = len(data)
        writer = ChunkWriter("chatcmpl-4f9c2a7be1d04c35", "tokenbus-sim", include_usage=False, created=1_795_000_000)
        (chunk,) = event_chunks(codec.decode(data, TokenEvent), writer)
        if (top is None) != ('"logprobs":null' in chunk):
            raise AssertionError(f"{way}: the chunk's logprobs are not what the request asked")
        consumer[way] = lambda events=events, out=out: codec.encode(events.event(41, out))
        edge[way] = lambda data=data, writer=writer: event_chunks(codec.decode(data, TokenEvent), writer)
    timings: dict[str, dict[str, float]] = {"consumer": {}, "edge": {}}
    for _ in range(rounds):  # alternate the ways, keep each one's best
        for side, calls_by_way in (("consumer", consumer), ("edge", edge)):
            for way, call in calls_by_way.items():
                us = best_us(call, calls, 1)
                timings[side][way] = min(timings[side].get(way, us), us)
    return {"scenario": "logprobs", "calls": calls, "rounds": rounds, "bytes": sizes,
            "us": {side: {way: round(us, 2) for way, us in t.items()} for side, t in timings.items()}}


def table(result: dict[str, Any]) -> str:
    us, sizes = result["us"], result["bytes"]
    plain = {side: us[side]["not asked"] for side in us}
    rows = ["| a token, its request asking | event bytes | consumer: event + encode, µs | edge: decode + chunk, µs |",
            "|---|---:|---:|---:|"]
    for way in WAYS:
        cells = [f"{us[side][way]} ({us[side][way] / plain[side]:.2f}x)" for side in ("consumer", "edge")]
        rows.append(f"| {way} | {sizes[way]} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)
