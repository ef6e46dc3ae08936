"""The worker in-process against the real broker, with the simulated engine."""

import asyncio
import gc
import time

import pytest
from aiokafka.errors import UnknownError
from aiokafka.partitioner import murmur2

from tests.conftest import MODEL
from tests.gpu_consumers.helpers import read_all, read_written, reading_from_the_beginning, running_worker
from tests.waiting import wait_for
from tokenbus.gpu_consumers.engines import GenerationInput, SimulatedEngine, SimulatedEngineSettings
from tokenbus.gpu_consumers.engines.simulated_prompts import count_prompt_tokens
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.worker import GpuWorker
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, Completion, now_ms
from tokenbus.topics import RecordSender, TopicCatalog, make_producer
from tokenbus.topics.dead_letters import HEADER_REASON, HEADER_SOURCE

codec = AvroCodec()


async def test_requests_stream_back_and_close_with_a_completion(each_bus):
    async with (running_worker(each_bus, min_tokens=6, max_tokens=6) as worker,
                TokenbusClient(each_bus, idle_timeout=20) as client):
        requests = [
            client.new_request(MODEL, [ChatMessage("user", f"question {i}")], tier=tier, tenant="acme")
            for i, tier in enumerate(["interactive", "standard", "batch"] * 4)
        ]

        async def collect(request):
            return [r async for r in client.stream(request)]

        streams = await asyncio.gather(*(collect(r) for r in requests))
        # A request is completed once its completion is acknowledged too, which may come after the
        # client has read the final event.
        await wait_for(lambda: worker.completed == len(requests), 30, "every completion acknowledged")

    for stream in streams:
        assert [r.event.seq for r in stream] == list(range(6))
        assert stream[-1].event.finish_reason == "stop" and stream[-1].event.completion_tokens == 6

    records = await read_all(each_bus, TopicCatalog(each_bus).completions, expected=len(requests))
    completions = {c.request_id: c for c in (codec.decode(r.value, Completion) for r in records)}
    assert set(completions) == {r.request_id for r in requests}
    for request, stream in zip(requests, streams):
        completion = completions[request.request_id]
        assert completion.text == "".join(r.event.text for r in stream)
        assert completion.completion_tokens == 6 and completion.tenant == "acme"
        assert completion.messages == request.messages
        assert completion.started_at_ms <= (completion.first_token_at_ms or 0) <= completion.finished_at_ms


async def test_a_stream_interval_sends_fewer_events_with_every_token(bus):
    """With ``stream_interval_ms`` a sequence's steps within the interval go out as one event: the
    first token at once, then at most an event per interval, and the same tokens and text."""
    async def served(interval_ms: int) -> tuple[list, Completion]:
        settings = WorkerSettings(bus=bus, model=MODEL, worker_id=f"w-interval-{interval_ms}",
                                  stream_interval_ms=interval_ms)
        engine = SimulatedEngine(SimulatedEngineSettings(ttft_ms=1, tokens_per_s=200, min_tokens=40, max_tokens=40))
        worker = GpuWorker(settings, engine)
        task = asyncio.create_task(worker.run())
        try:
            async with TokenbusClient(bus, idle_timeout=20) as client:
                await asyncio.wait_for(worker.ready.wait(), 30)
                request = client.new_request(MODEL, [ChatMessage("user", "the same question")], seed=3)
                events = [r.event async for r in client.stream(request)]
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
        return events, request

    every_step, _ = await served(0)
    coarse, request = await served(60)  # 40 tokens at 200 a second: 200 ms, about 4 intervals
    assert len(every_step) == 40
    assert 2 <= len(coarse) <= 8
    assert [e.seq for e in coarse] == list(range(len(coarse)))
    assert len(coarse[0].token_ids) == 1  # the first token does not wait for the interval
    assert [t for e in coarse for t in e.token_ids] == [t for e in every_step for t in e.token_ids]
    assert "".join(e.text for e in coarse) == "".join(e.text for e in every_step)
    assert coarse[-1].finish_reason == every_step[-1].finish_reason and coarse[-1].completion_tokens == 40


async def test_completions_go_to_the_partition_kafka_gives_their_request_id(bus):
    """A completion leaves with the token events of its pass (a wave's completions as one batch a
    partition), the worker choosing its partition: it must be the one a Kafka producer would, by
    the documented default (murmur2 of the key, made positive, modulo the partition count)."""
    catalog = TopicCatalog(bus)
    async with (running_worker(bus, worker_id="w-keyed", min_tokens=3, max_tokens=3) as worker,
                TokenbusClient(bus, idle_timeout=20) as client):
        requests = [client.new_request(MODEL, [ChatMessage("user", f"keyed {i}")]) for i in range(16)]

        async def drain(request):
            return [r async for r in client.stream(request)]

        await asyncio.gather(*(drain(r) for r in requests))
        await wait_for(lambda: worker.completed >= len(requests), 30, "every completion acknowledged")
    ours = {r.request_id for r in requests}
    records = await read_all(bus, catalog.completions,
                             until=lambda rs: ours <= {codec.decode(r.value, Completion).request_id for r in rs})
    async with reading_from_the_beginning(bus, catalog.completions) as consumer:
        partitions = len(consumer.assignment())
    placed = {r.key.decode(): r.partition for r in records if r.key.decode() in ours}
    assert set(placed) == ours and partitions > 1
    assert placed == {key: (murmur2(key.encode()) & 0x7FFFFFFF) % partitions for key in ours}
    assert len(set(placed.values())) > 1


async def test_steps_made_while_the_loop_was_busy_go_out_as_one_event(bus):
    """An engine that generates apart from the event loop finds the worker busy at times: the
    steps it handed over meanwhile go out as one event (fewer to encode and relay just when the
    worker has to catch up), with every token in order."""
    async with (running_worker(bus, worker_id="w-busy", min_tokens=40, max_tokens=40, tokens_per_s=400,
                               catch_up_all=True),
                TokenbusClient(bus, idle_timeout=20) as client):
        events = []
        async for reply in client.stream(client.new_request(MODEL, [ChatMessage("user", "a busy loop")])):
            events.append(reply.event)
            if len(events) == 1:
                time.sleep(0.05)  # the loop held: ~20 steps made, then handed over back to back
    assert [e.seq for e in events] == list(range(len(events)))
    assert sum(len(e.token_ids) for e in events) == 40 == events[-1].completion_tokens
    assert max(len(e.token_ids) for e in events) >= 5 and len(events) < 40


async def test_poison_record_goes_to_dlq_and_the_next_request_is_served(each_bus):
    catalog = TopicCatalog(each_bus)
    async with running_worker(each_bus), TokenbusClient(each_bus, idle_timeout=20) as client:
        producer = make_producer(each_bus)
        await producer.start()
        try:
            await producer.send_and_wait(catalog.requests(MODEL, "standard"), b"\x01garbage, not an avro record", key=b"k")
        finally:
            await producer.stop()
        request = client.new_request(MODEL, [ChatMessage("user", "still there?")], tier="standard")
        events = [r.event async for r in client.stream(request)]
        assert events[-1].finish_reason in {"stop", "length"}

    (dead,) = await read_all(each_bus, catalog.dlq, expected=1)
    headers = dict(dead.headers)
    assert dead.value == b"\x01garbage, not an avro record"
    assert headers[HEADER_REASON] == b"bad_magic"
    assert headers[HEADER_SOURCE].startswith(catalog.requests(MODEL, "standard").encode())


async def test_a_request_whose_completion_was_refused_is_served_again_and_billed_once(bus, monkeypatch):
    """The broker refuses the completion's write (as the embedded broker did with an unknown error
    just after a restart): the worker serves the request again, finds its stream finished in the
    token log, and writes the completion then, once, without generating anything again. Left for
    redelivery it would have waited for the next rebalance, unbilled."""
    refused: list[str] = []
    send = RecordSender.send

    async def refuse_the_first_completion(self, topic, record, key, *args, **kwargs):
        if topic == TopicCatalog(bus).completions and not refused:
            refused.append(key)
            raise UnknownError("refused by the test")
        return await send(self, topic, record, key, *args, **kwargs)

    monkeypatch.setattr(RecordSender, "send", refuse_the_first_completion)
    async with (running_worker(bus, min_tokens=5, max_tokens=5, worker_id="w-refused") as worker,
                TokenbusClient(bus, idle_timeout=20) as client):
        request = client.new_request(MODEL, [ChatMessage("user", "bill me once")])
        events = [r.event async for r in client.stream(request)]
        deadline = asyncio.get_running_loop().time() + 20
        while worker.completed == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        assert worker.completed == 1

    assert refused == [request.request_id]
    assert [e.seq for e in events] == list(range(5))
    records = await read_written(bus, TopicCatalog(bus).completions)
    completions = [c for c in (codec.decode(r.value, Completion) for r in records) if c.request_id == request.request_id]
    assert len(completions) == 1
    assert completions[0].text == "".join(e.text for e in events) and completions[0].completion_tokens == 5
    replies = await read_written(bus, request.reply_topic)
    assert sum(r.key == request.request_id.encode() for r in replies) == 5  # generated once


@pytest.fixture
def held_completions(bus, monkeypatch) -> asyncio.Event:
    """Completions wait to be queued until the event returned is set (token events go on)."""
    held, completions = asyncio.Event(), TopicCatalog(bus).completions
    send = RecordSender.send

    async def send_when_let(self, topic, record, key, *args, **kwargs):
        if topic == completions:
            await held.wait()
        return await send(self, topic, record, key, *args, **kwargs)

    monkeypatch.setattr(RecordSender, "send", send_when_let)
    return held


async def test_a_worker_stopped_before_a_turns_completion_is_queued_still_writes_it(bus, held_completions):
    """A worker stopped between a turn's final event and its completion (whose send can wait a
    metadata round trip, for a topic the producer has not written lately) queues the completion
    before it lets the request go, and the flush on stopping writes it: the turn is billed without
    waiting for the request's next owner, which may never come (a model scaled to zero)."""
    async with running_worker(bus, min_tokens=3, max_tokens=3) as worker, TokenbusClient(bus, idle_timeout=20) as client:
        request = client.new_request(MODEL, [ChatMessage("user", "stop right after")])
        events = [r.event async for r in client.stream(request)]
        # Done in the engine, its slot already given back: the completion is all that is left.
        await wait_for(lambda: request.request_id in worker._finishing, 30, "the turn's completion on its way")
        serving = worker._finishing[request.request_id].task
        worker.stop()
        await wait_for(lambda: serving.cancelling(), 30, "the stop to cancel the request's task")
        held_completions.set()

    assert worker.completed == 0  # never acknowledged while it ran: the request stays uncommitted
    records = await read_written(bus, TopicCatalog(bus).completions)
    (completion,) = [codec.decode(r.value, Completion) for r in records]
    assert completion.request_id == request.request_id
    assert completion.text == "".join(e.text for e in events) and completion.completion_tokens == 3


async def test_the_next_request_runs_while_a_finished_turns_completion_waits_to_be_queued(bus, held_completions):
    """The engine's slot goes to the next request once a turn's final event is out, not once its
    completion is queued (one sent through the producer's ``send``, before the producer knows the
    completions topic, waits for a metadata round trip): with one slot and the first completion
    held, the second request still streams to its end."""
    async with running_worker(bus, max_num_seqs=1, min_tokens=3, max_tokens=3) as worker, \
            TokenbusClient(bus, idle_timeout=20) as client:
        first, second = (client.new_request(MODEL, [ChatMessage("user", text)]) for text in ("first", "second"))
        submitted = [await client.submit(request) for request in (first, second)]
        streams = [[r.event async for r in stream.events(20)] for stream in submitted]
        assert [events[-1].finish_reason for events in streams] == ["stop", "stop"]
        assert worker.completed == 0  # neither completion queued yet
        held_completions.set()
        await wait_for(lambda: worker.completed == 2, 30, "both completions acknowledged")


async def test_request_past_its_deadline_is_not_generated(each_bus):
    async with running_worker(each_bus), TokenbusClient(each_bus, idle_timeout=20) as client:
        request = client.new_request(MODEL, [ChatMessage("user", "too late")], deadline_ms=now_ms() - 1000)
        events = [r.event async for r in client.stream(request)]
    assert len(events) == 1
    assert events[0].finish_reason == "error" and "deadline" in (events[0].error or "")
    assert events[0].completion_tokens == 0


async def test_metrics_count_what_was_served(bus):
    async with running_worker(bus, min_tokens=5, max_tokens=5) as worker, TokenbusClient(bus, idle_timeout=20) as client:
        for i in range(3):
            [r async for r in client.stream(client.new_request(MODEL, [ChatMessage("user", f"m{i}")]))]
        sample = lambda name, **labels: worker.metrics.registry.get_sample_value(  # noqa: E731
            name, {"model_name": MODEL, **labels})
        # The worker counts a request once its final event is out, and sets its gauges once per
        # fetch loop: on a busy machine this client can read that event before either happened.
        await wait_for(lambda: sample("tokenbus:request_success_total", finished_reason="stop") == 3
                       and sample("tokenbus:num_requests_running") == 0
                       and sample("tokenbus:kv_cache_usage_perc") == 0, 20, "the third request counted")
        assert sample("tokenbus:generation_tokens_total") == 15
        assert sample("tokenbus:request_success_total", finished_reason="stop") == 3
        assert sample("tokenbus:time_to_first_token_seconds_count") == 3
        assert sample("tokenbus:inter_token_latency_seconds_count") == 12
        assert sample("tokenbus:request_queue_time_seconds_count") == 3
        assert sample("tokenbus:num_requests_running") == 0
        prompt = count_prompt_tokens(GenerationInput("m", (ChatMessage("user", "m0"),)))
        assert sample("tokenbus:request_prompt_tokens_sum") == 3 * prompt
        assert sample("tokenbus:kv_cache_usage_perc") == 0  # nothing runs: the engine holds no blocks


async def test_kv_cache_usage_follows_the_running_sequences(bus):
    """The gauge reads the engine: here the simulated engine's model of a paged cache of 1,600
    tokens in blocks of 16, which a running sequence fills block by block and gives back."""
    async with running_worker(bus, min_tokens=200, max_tokens=200, tokens_per_s=50, kv_cache_tokens=1600,
                              kv_block_tokens=16) as worker, TokenbusClient(bus, idle_timeout=20) as client:
        gauge = lambda: worker.metrics.registry.get_sample_value(  # noqa: E731
            "tokenbus:kv_cache_usage_perc", {"model_name": MODEL})
        request = client.new_request(MODEL, [ChatMessage("user", "a long one")])
        events = client.stream(request)
        async for reply in events:
            if reply.event.seq == 20:
                break
        for _ in range(200):
            if gauge():
                break
            await asyncio.sleep(0.05)
        held = gauge() * 1600
        assert held >= 32 and held % 16 == 0  # prompt and 20 tokens or more, in whole blocks
        await client.cancel(request.request_id)
        [r async for r in events]
        for _ in range(200):  # back to nothing once the sequence is gone (the next loop turn)
            if not gauge():
                break
            await asyncio.sleep(0.05)
        assert gauge() == 0 and worker.engine.kv_cache_usage() == 0


def test_worker_serves_prometheus_metrics(stack):
    import httpx

    body = httpx.get(f"http://127.0.0.1:{stack.settings.worker_port}/metrics", timeout=5).text
    for name in ("tokenbus:time_to_first_token_seconds_bucket", "tokenbus:inter_token_latency_seconds_bucket",
                 "tokenbus:request_queue_time_seconds_bucket", "tokenbus:batch_occupancy",
                 "tokenbus:num_requests_waiting", "tokenbus:requests_taken_over_total"):
        assert name in body


async def collect(replies) -> list:
    return [reply async for reply in replies]


class PreparingEngine(SimulatedEngine):
    """The simulated engine, noting each ``prepare`` and ``generate`` it is asked for."""

    def __init__(self, settings: SimulatedEngineSettings) -> None:
        super().__init__(settings)
        self.calls: list[tuple[str, GenerationInput]] = []

    async def prepare(self, inp: GenerationInput) -> None:
        await asyncio.sleep(0.01)  # as a thread's work would, the event loop goes on meanwhile
        self.calls.append(("prepare", inp))

    def generate(self, inp: GenerationInput):
        self.calls.append(("generate", inp))
        return super().generate(inp)


async def test_the_engine_prepares_each_request_before_generating_it(bus):
    """The worker awaits ``Engine.prepare`` (the hf and trtllm engines tokenize the prompt in a
    thread there) and then generates the same input."""
    async with (running_worker(bus, engine_type=PreparingEngine, min_tokens=2, max_tokens=2) as worker,
                TokenbusClient(bus, idle_timeout=20) as client):
        requests = [client.new_request(MODEL, [ChatMessage("user", f"prepared {i}")]) for i in range(3)]
        served = await asyncio.gather(*(collect(client.stream(r)) for r in requests))
    assert all(len(events) == 2 for events in served)
    engine = worker.engine
    assert isinstance(engine, PreparingEngine)
    for request in requests:
        calls = [(kind, inp) for kind, inp in engine.calls if inp.request_id == request.request_id]
        assert [kind for kind, _ in calls] == ["prepare", "generate"]
        assert calls[0][1] == calls[1][1]


async def test_a_served_request_leaves_nothing_for_the_garbage_collector(bus):
    """What a request holds while it runs (its task, sequence, step publisher, engine stream,
    mailbox, turn) is freed by reference counting once it ends. Held in reference cycles, as it
    once was, it is left to the collector, which on a busy consumer freed ~38 objects a request in
    pauses of 60-130 ms (BENCHMARKS.md §6): every stream the worker serves stalls meanwhile."""
    requests = 40
    async with (running_worker(bus, min_tokens=4, max_tokens=4) as worker,
                TokenbusClient(bus, idle_timeout=20) as client):
        async def serve(count: int) -> None:
            done = worker.completed + count
            for i in range(count):
                await client.publish(client.new_request(MODEL, [ChatMessage("user", f"question {i}")]))
            await wait_for(lambda: worker.completed >= done, 30, "every completion acknowledged")

        await serve(4)  # the first requests make what lasts (connections, metrics' children)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage to look at
        try:
            await serve(requests)
            gc.collect()
            left = [o for o in gc.garbage if type(o).__module__.startswith("tokenbus.gpu_consumers")]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert len(left) < requests, sorted({type(o).__qualname__ for o in left})
