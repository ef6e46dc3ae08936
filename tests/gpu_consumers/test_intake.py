"""A GPU consumer's intake (gpu_consumers/intake.py), in-process against the real broker: a
request on the wrong topic (another model's, or another tier's) is dead-lettered and the rest
served, and a tier whose buffer is full
leaves its requests in Kafka, unfetched, until it has room (consumer lag is the queue depth)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all, read_written, running_worker
from tests.waiting import wait_for
from tokenbus.gpu_consumers.engines import GenerationInput, SimulatedEngine, SimulatedEngineSettings, StepOutput
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion
from tokenbus.topics import ReplyEvent, TopicCatalog, make_producer
from tokenbus.topics.dead_letters import HEADER_REASON

codec = AvroCodec()


async def tokens(events: AsyncIterator[ReplyEvent]) -> tuple[int, str | None]:
    """The tokens a stream delivered and how it finished (a reader that fell behind its engine gets
    the steps that waited as one event, so the events themselves are not counted)."""
    delivered = [reply.event async for reply in events]
    return sum(len(e.token_ids) for e in delivered), delivered[-1].finish_reason


async def test_a_request_for_another_model_or_tier_is_dead_lettered_and_the_rest_are_served(bus):
    catalog = TopicCatalog(bus)
    topic = catalog.requests(MODEL, "standard")
    strays = [ChatRequest("stray-model", "another-model", "standard", [ChatMessage("user", "hi")], catalog.tokens, 0),
              ChatRequest("stray-tier", MODEL, "batch", [ChatMessage("user", "hi")], catalog.tokens, 0)]
    producer = make_producer(bus)
    await producer.start()
    try:
        for stray in strays:  # on partition 0, ahead of whatever the worker serves there
            await producer.send_and_wait(topic, codec.encode(stray), key=stray.request_id.encode(), partition=0)
    finally:
        await producer.stop()
    async with running_worker(bus, min_tokens=2, max_tokens=2) as worker, TokenbusClient(bus, idle_timeout=20) as client:
        requests = [client.new_request(MODEL, [ChatMessage("user", f"after the strays {i}")], tier="standard")
                    for i in range(4)]
        served = await asyncio.gather(*(tokens(client.stream(request)) for request in requests))
        assert served == [(2, "stop")] * 4
        await wait_for(lambda: worker.completed == 4, 10, "the completions acknowledged")
    dead = await read_all(bus, catalog.dlq, expected=2)
    assert sorted((r.key, dict(r.headers)[HEADER_REASON]) for r in dead) == [
        (b"stray-model", b"wrong_route"), (b"stray-tier", b"wrong_route")]
    assert {r.value for r in dead} == {codec.encode(s) for s in strays}  # unchanged, for whoever looks into it
    completions = [codec.decode(r.value, Completion).request_id for r in await read_written(bus, catalog.completions)]
    assert sorted(completions) == sorted(r.request_id for r in requests)  # the strays were never served


async def test_a_request_out_of_range_is_dead_lettered_answered_with_why_and_the_rest_are_served(bus):
    """Internal services publish requests directly: one no engine can serve as asked is refused
    with its reason (and answered on its reply partition, so that its stream ends at once), one
    whose reply log is not one is only dead-lettered (before it, a reply partition that did not
    exist held up every other request's token-log lookup), and a takeover prefix outside the
    model's vocabulary is answered with an error rather than served again and again."""
    catalog = TopicCatalog(bus)
    topic = catalog.requests(MODEL, "standard")
    async with running_worker(bus, min_tokens=2, max_tokens=2) as worker, TokenbusClient(bus, idle_timeout=20) as client:
        def stray(name: str, **fields) -> ChatRequest:
            return dataclasses.replace(client.new_request(MODEL, [ChatMessage("user", "hi")], tier="standard",
                                                          request_id=name), **fields)

        greedy = stray("greedy", max_tokens=300_000)  # more than the worker's whole budget in flight
        answered = [stray("hot", temperature=-1.0), stray("nan", frequency_penalty=math.nan),
                    stray("silent", messages=[]), stray("wizard", messages=[ChatMessage("wizard", "hi")]),
                    stray("unnamed", tool_choice="function"), stray("signed", logit_bias={"-3": 1.0}), greedy]
        unanswerable = [stray("no-partition", reply_partition=bus.token_partitions + 5),
                        stray("negative-partition", reply_partition=-1), stray("to-control", reply_topic=catalog.control)]
        beyond = stray("beyond", prefix_token_ids=[10**9], prefix_text="x")
        streams = {r.request_id: client.router.open(r.request_id, r.reply_partition, r.reply_topic)
                   for r in [*answered, beyond]}
        producer = make_producer(bus)
        await producer.start()
        try:
            for request in [*answered, *unanswerable, beyond]:  # one partition: each ahead of the good ones
                await producer.send_and_wait(topic, codec.encode(request), key=request.request_id.encode(), partition=0)
        finally:
            await producer.stop()
        good = [client.new_request(MODEL, [ChatMessage("user", f"after the strays {i}")], tier="standard")
                for i in range(4)]
        served = await asyncio.gather(*(tokens(client.stream(request)) for request in good))
        assert served == [(2, "stop")] * 4
        ends = {name: [reply.event async for reply in stream.events(idle_timeout=20)] for name, stream in streams.items()}
        await wait_for(lambda: worker.completed == 5, 10, "the good requests and the refused prefix acknowledged")
    assert {name: [(e.finish_reason, e.error) for e in events] for name, events in ends.items()} == {
        "hot": [("error", "invalid_request: temperature -1.0 is not in [0, 2]")],
        "nan": [("error", "invalid_request: frequency_penalty nan is not in [-2, 2]")],
        "silent": [("error", "invalid_request: messages must not be empty")],
        "wizard": [("error", "invalid_request: messages[0].role 'wizard' is not one of system, developer, user, "
                             "assistant, tool")],
        "unnamed": [("error", "invalid_request: tool_choice_name None names none of the request's tools")],
        "signed": [("error", "invalid_request: logit_bias key '-3' is not a token id (a non-negative integer)")],
        "greedy": [("error", f"invalid_request: max_tokens 300000 with the prompt's ~{greedy.estimated_prompt_tokens} "
                             f"tokens exceeds the {worker.settings.max_tokens_in_flight} tokens a worker of this "
                             "model holds in flight")],
        "beyond": [("error", f"invalid_request: token id 1000000000 is not in the model's vocabulary "
                             f"(0 to {len(VOCABULARY) - 1})")],
    }
    dead = await read_all(bus, catalog.dlq, expected=10)
    assert sorted((r.key.decode(), dict(r.headers)[HEADER_REASON].decode()) for r in dead) == sorted(
        [(r.request_id, "invalid_request") for r in answered] + [(r.request_id, "no_reply_log") for r in unanswerable])
    completions = [codec.decode(r.value, Completion) for r in await read_written(bus, catalog.completions)]
    assert sorted(c.request_id for c in completions) == sorted([r.request_id for r in good] + ["beyond"])
    assert [(c.finish_reason, c.completion_tokens) for c in completions if c.request_id == "beyond"] == [("error", 0)]


class GatedEngine(SimulatedEngine):
    """The simulated engine, whose sequences give out nothing until ``gate`` is set."""

    def __init__(self, settings: SimulatedEngineSettings) -> None:
        super().__init__(settings)
        self.gate = asyncio.Event()

    def generate(self, inp: GenerationInput) -> _Gated:
        return _Gated(super().generate(inp), self.gate)


class _Gated:
    def __init__(self, stream, gate: asyncio.Event) -> None:
        self._stream, self._gate = stream, gate

    def abort(self) -> None:
        self._stream.abort()

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        await self._gate.wait()
        async for out in self._stream:
            yield out


async def test_a_full_tier_leaves_its_requests_in_kafka_until_it_has_room(bus):
    """One slot, two requests buffered per tier: with one request running and two waiting, the
    tier's partitions are paused, and what is published meanwhile stays in the log (the worker's
    position does not move over several fetches) until slots free up; then every request is
    served, once."""
    topic = TopicCatalog(bus).requests(MODEL, "standard")
    async with (running_worker(bus, max_num_seqs=1, engine_type=GatedEngine, worker_settings={"prefetch_per_tier": 2},
                               min_tokens=2, max_tokens=2) as worker,
                TokenbusClient(bus, idle_timeout=30) as client):
        engine = worker.engine
        assert isinstance(engine, GatedEngine)
        requests = [client.new_request(MODEL, [ChatMessage("user", f"request {i}")], tier="standard") for i in range(13)]
        streams = [await client.submit(r) for r in requests[:3]]
        await wait_for(lambda: worker.running == 1 and worker.scheduler.waiting("standard") == 2, 10,
                       "one request running and two waiting")
        fetches = 0
        fetch = worker.intake.fetch

        async def counted_fetch() -> bool:
            nonlocal fetches
            fetches += 1
            return await fetch()

        worker.intake.fetch = counted_fetch  # type: ignore[method-assign]
        streams += [await client.submit(r) for r in requests[3:]]  # acknowledged by the broker
        await wait_for(lambda: fetches >= 3, 10, "three fetches after the rest were published")
        consumer = worker._consumer
        assert consumer is not None
        positions = [await consumer.position(tp) for tp in consumer.assignment() if tp.topic == topic]
        assert sum(positions) == 3, "only the three the tier had room for were fetched"
        assert worker.scheduler.waiting("standard") == 2
        engine.gate.set()
        served = await asyncio.gather(*(tokens(s.events(idle_timeout=30)) for s in streams))
        assert served == [(2, "stop")] * 13
        await wait_for(lambda: worker.completed == 13, 10, "every completion acknowledged")
