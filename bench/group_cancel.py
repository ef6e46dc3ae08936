"""Scenario: cancelling a big batch, one cancel record per request beside one record for the group.

Through the embedded stack's bus and its GPU consumer (its own process), with the SDK: an
interactive stream runs (a token every 20 ms), then ``REQUESTS`` requests of one batch are
published at the batch tier (``MAX_NUM_SEQS`` of them running, the rest waiting in the consumer
or on the bus), then the batch is cancelled, in turn:

- ``per_request``: a cancel record for each request (``{batch_id}-{line}``), as a batch was
  cancelled before;
- ``group``: one record naming the group (``{batch_id}-*``).

Reported for each: the time to publish the cancels, the time until every request of the batch
has its cancelled final event, and the interactive stream's longest gap between two tokens from
the cancel to a second after the last request ended, against its gaps before it: what the cancel
costs work beside it. The gaps are read at the GPU consumer (each event's ``created_at_ms``) and
at this client, which also reads the batch's 5,000 final events and, in ``per_request``, sends
the cancels.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.stack import MODEL, bench_stack
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import ChatMessage, group_cancel_id
from tokenbus.topics import BusSettings, ReplyStream

REQUESTS = 5000
MAX_NUM_SEQS = 64
LINE_TOKENS = 100
SIM = SimulatedEngineSettings(seed=1, ttft_ms=5, tokens_per_s=50, min_tokens=3000, max_tokens=3000)
SETTLE_S = 1.5  # after publishing the batch, before cancelling it
AFTER_S = 1.0  # the stream watched on after the last request of the batch is cancelled
MODES = ("per_request", "group")


async def token_times(stream: ReplyStream, times: list[float], made: list[float]) -> None:
    """When each event reached this client, and when the GPU consumer made it (its ``created_at_ms``)."""
    async for reply in stream.events(idle_timeout=120):
        times.append(time.perf_counter())
        made.append(reply.event.created_at_ms / 1000)
        if reply.event.is_final:
            return


async def cancel_batch(bus: BusSettings, mode: str) -> dict[str, float]:
    async with TokenbusClient(bus, idle_timeout=120) as client:
        interactive = await client.submit(client.new_request(MODEL, [ChatMessage("user", "stay with me")],
                                                             tier="interactive"))
        times: list[float] = []
        made: list[float] = []
        reading = asyncio.create_task(token_times(interactive, times, made))
        batch_id = f"batch_{mode}"
        lines = [client.new_request(MODEL, [ChatMessage("user", f"line {i}")], tier="batch",
                                    request_id=f"{batch_id}-{i}", max_tokens=LINE_TOKENS) for i in range(REQUESTS)]
        streams: list[ReplyStream] = []
        for start in range(0, REQUESTS, 256):
            streams += await asyncio.gather(*(client.submit(line) for line in lines[start:start + 256]))
        await asyncio.sleep(SETTLE_S)
        cancelled_at, cancelled_at_wall = time.perf_counter(), time.time()
        if mode == "group":
            await client.cancel(group_cancel_id(batch_id), "cancelled with its batch")
        else:
            for start in range(0, REQUESTS, 256):
                await asyncio.gather(*(client.cancel(line.request_id, "cancelled with its batch")
                                       for line in lines[start:start + 256]))
        published = time.perf_counter() - cancelled_at

        async def final(stream: ReplyStream) -> None:
            async for reply in stream.events(idle_timeout=120):
                if reply.event.is_final:
                    return

        await asyncio.gather(*(final(s) for s in streams))
        all_ended = time.perf_counter() - cancelled_at
        await asyncio.sleep(AFTER_S)
        await client.cancel(interactive.request_id, "measured")
        await reading
    return {"publish_cancels_ms": round(1000 * published, 1), "all_cancelled_ms": round(1000 * all_ended, 1),
            **gaps("client", times, cancelled_at, all_ended), **gaps("consumer", made, cancelled_at_wall, all_ended)}


def gaps(where: str, times: list[float], cancelled_at: float, all_ended: float) -> dict[str, float]:
    """The stream's gaps between tokens before the cancel (p50), and the longest in the window after it."""
    window_end = cancelled_at + all_ended + AFTER_S
    before = [b - a for a, b in zip(times, times[1:], strict=False) if b < cancelled_at]
    after = [b - a for a, b in zip(times, times[1:], strict=False) if cancelled_at <= b <= window_end]
    return {f"{where}_gap_p50_before_ms": round(1000 * statistics.median(before), 1),
            f"{where}_gap_max_after_ms": round(1000 * max(after), 1)}


def run() -> dict[str, Any]:
    with bench_stack(SIM, max_num_seqs=MAX_NUM_SEQS) as stack:
        bus = stack.bus_settings()
        kinds = {mode: asyncio.run(cancel_batch(bus, mode)) for mode in MODES}
    return {"scenario": "group_cancel", "requests": REQUESTS, "max_num_seqs": MAX_NUM_SEQS, "kinds": kinds}


def table(result: dict[str, Any]) -> str:
    lines = ["| cancel sent as | publishing the cancels ms | until all cancelled ms | stream gap p50 before ms | "
             "longest gap after, at the consumer ms | longest gap after, at the client ms |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {mode} | {k['publish_cancels_ms']} | {k['all_cancelled_ms']} | {k['consumer_gap_p50_before_ms']} | "
              f"{k['consumer_gap_max_after_ms']} | {k['client_gap_max_after_ms']} |" for mode, k in result["kinds"].items()]
    return "\n".join(lines)
