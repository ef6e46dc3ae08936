"""Acceptance: two GPU consumer processes serve 20 streams; one is killed with SIGKILL, or
stopped with SIGTERM (it hands its running sequences off: stops them without a final event,
flushes what it published, commits and leaves its group), mid-generation. The other takes its
requests over from the tokens already published, and every client stream is exactly the
uninterrupted text: no gap, no duplicate, no error; a stream that asked for log probabilities has
each token's once, the uninterrupted stream's. Ten of the streams are read as two groups (the
choices of a response, ``ReplyGroup``), each choice as exact as a stream of its own.

`make test` runs it once; `make faults` runs it TOKENBUS_TAKEOVER_RUNS (10) times."""

import asyncio
import os
import signal

import httpx
import pytest
from aiokafka import TopicPartition

from tests.conftest import MODEL
from tests.expected import expected_output
from tests.waiting import wait_for
from tokenbus.gpu_consumers.engines import SimulatedEngineSettings
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, TokenEvent
from tokenbus.topics import TopicCatalog, make_consumer

RUNS = int(os.environ.get("TOKENBUS_TAKEOVER_RUNS", "1"))
STREAMS = 20
GROUP = 5  # two groups of this many of the streams are read as one each (the choices of a response)
REPLY_PARTITION = 2
ENGINE = SimulatedEngineSettings(seed=11, ttft_ms=5, tokens_per_s=10, min_tokens=40, max_tokens=40)


def health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()


def metric(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def raw_events(bus, request_ids: set[str]) -> list[TokenEvent]:
    """Every token event published for these requests, duplicates included."""
    codec = AvroCodec()
    consumer = make_consumer(bus)
    await consumer.start()
    tp = TopicPartition(TopicCatalog(bus).tokens, REPLY_PARTITION)
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        events = []
        while True:
            for record in (await consumer.getmany(tp, timeout_ms=300)).get(tp, []):
                if record.key and record.key.decode() in request_ids:
                    events.append(codec.decode(record.value, TokenEvent))
            if consumer.highwater(tp) is not None and await consumer.position(tp) >= consumer.highwater(tp):
                return events
    finally:
        await consumer.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("run", range(RUNS))
async def test_a_consumer_stopped_mid_generation_loses_and_repeats_nothing(stack, bus, tmp_path, run, sig):
    side = EmbeddedStack(
        stack.settings.model_copy(update={"topic_prefix": bus.topic_prefix, "run_root": tmp_path}),
        extra_env={f"TOKENBUS_SIM_{k.upper()}": str(v) for k, v in ENGINE.model_dump().items()},
    )
    side.run_dir.mkdir(parents=True)
    ports = {"a": free_port(), "b": free_port()}
    try:
        for name, port in ports.items():
            side.start_worker(f"worker-{name}", port)
        total = len(TopicCatalog(bus).model_request_topics(MODEL)) * bus.request_partitions
        await wait_for(lambda: all(health(p)["partitions"] for p in ports.values())
                       and sum(health(p)["partitions"] for p in ports.values()) == total, 30, "both workers assigned")

        async with TokenbusClient(bus, reply_partitions=[REPLY_PARTITION], idle_timeout=60) as client:
            requests = [client.new_request(MODEL, [ChatMessage("user", f"stream {i}")], seed=1000 * run + i,
                                           logprobs=i % 2 == 0, top_logprobs=2 if i % 2 == 0 else 0)
                        for i in range(STREAMS)]
            received: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}

            async def read(request):
                async for reply in client.stream(request):
                    received[request.request_id].append(reply.event)

            async def read_group(name, members):  # a response's choices, read as one stream
                group, _ = await client.group_submission(name, members)
                try:
                    async for reply in group.events(60):
                        received[reply.event.request_id].append(reply.event)
                finally:
                    for member in members:
                        client.finish(member.request_id)

            singles, grouped = requests[:STREAMS - 2 * GROUP], requests[STREAMS - 2 * GROUP:]
            readers = [asyncio.create_task(read(r)) for r in singles] + [
                asyncio.create_task(read_group(f"group-{run}-{g}", grouped[g * GROUP:(g + 1) * GROUP])) for g in (0, 1)]
            await wait_for(lambda: all(len(v) >= 3 for v in received.values()), 60, "every stream to be generating",
                           lambda: f"events per stream {sorted(len(v) for v in received.values())}, "
                                   f"workers {[health(p) for p in ports.values()]}")
            assert health(ports["a"])["running"] > 0
            side.processes["worker-a"].signal(sig)
            await asyncio.wait_for(asyncio.gather(*readers), 90)

        assert metric(ports["b"], "tokenbus:requests_taken_over_total") >= 1
    finally:
        side.stop()

    for request in requests:
        events = received[request.request_id]
        expected = await expected_output([{"role": "user", "content": request.messages[0].content}], request.seed,
                                         settings=ENGINE, logprobs=2 if request.logprobs else None)
        assert [e.seq for e in events] == list(range(len(events))), "gap or duplicate"
        assert events[-1].finish_reason == expected.finish_reason and not events[-1].error
        assert "".join(e.text for e in events) == expected.text
        assert events[-1].completion_tokens == expected.completion_tokens
        scored = [t for e in events for t in e.logprobs]
        assert [t.token for t in scored] == [t.token for t in expected.logprobs]
        assert [t.logprob for t in scored] == pytest.approx([t.logprob for t in expected.logprobs], rel=1e-6)
        assert len(scored) == (expected.completion_tokens if request.logprobs else 0)

    # At-least-once may publish an event twice; it must then be the same event.
    by_position: dict[tuple[str, int], set[str]] = {}
    for event in await raw_events(bus, set(received)):
        by_position.setdefault((event.request_id, event.seq), set()).add(event.text)
    assert all(len(texts) == 1 for texts in by_position.values())
