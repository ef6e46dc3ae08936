"""Scheduling, cancellation and restart of the worker, in-process against the real broker."""

import asyncio
import time

from tests.conftest import MODEL
from tests.expected import expected_output
from tests.gpu_consumers.helpers import read_all, running_worker
from tokenbus.gpu_consumers.engines import SimulatedEngine, SimulatedEngineSettings
from tokenbus.producers import TokenbusClient
from tokenbus.schemas import AvroCodec, ChatMessage, ChatRequest, Completion, cancelled_group, group_cancel_id, group_of
from tokenbus.topics import TopicCatalog

FAST = dict(min_tokens=2, max_tokens=2, tokens_per_s=2000)


async def run_backlog(bus, requests, **worker_kw) -> list[str]:
    """Publish every request, then start a one-slot worker on the backlog; returns the finish order."""
    async with TokenbusClient(bus, idle_timeout=30) as client:
        streams = [await client.submit(r) for r in requests]
        finished: list[tuple[float, str]] = []

        async def wait(stream):
            async for _ in stream.events(idle_timeout=30):
                pass
            finished.append((time.perf_counter(), stream.request_id))

        async with running_worker(bus, max_num_seqs=1, **worker_kw):
            await asyncio.gather(*(wait(s) for s in streams))
    return [request_id for _, request_id in sorted(finished)]


def make(bus, tier: str, i: int, tenant: str = "t") -> ChatRequest:
    """A request read back on reply partition 0 (TokenbusClient's default)."""
    return ChatRequest(f"{tier}-{tenant}-{i}", MODEL, tier, [ChatMessage("user", f"{tier} {i}")],
                       TopicCatalog(bus).tokens, 0, tenant=tenant)


async def test_backlog_is_served_by_tier_without_starving_batch(bus):
    requests = [make(bus, "batch", i) for i in range(2)] + [make(bus, "interactive", i) for i in range(34)]
    order = await run_backlog(bus, requests, **FAST)
    assert len(order) == 36
    batch_ranks = [order.index(f"batch-t-{i}") for i in range(2)]
    assert all(r.startswith("interactive") for r in order[:8])  # published last, served first
    assert max(batch_ranks) < 35  # batch moves while interactive still waits


async def test_one_tenants_flood_does_not_starve_another(bus):
    requests = [make(bus, "standard", i, tenant="flood") for i in range(30)]
    requests += [make(bus, "standard", i, tenant="quiet") for i in range(3)]
    order = await run_backlog(bus, requests, **FAST)
    quiet_ranks = sorted(order.index(f"standard-quiet-{i}") for i in range(3))
    assert quiet_ranks[-1] < 8, order


class AbortRecordingEngine(SimulatedEngine):
    """The simulated engine, noting how many tokens each sequence had generated when the worker
    first aborted it: the moment the cancel reached the engine, whatever the machine's speed."""

    def __init__(self, settings: SimulatedEngineSettings) -> None:
        super().__init__(settings)
        self.generated_at_abort: dict[str, int] = {}

    def generate(self, inp):
        sequence = super().generate(inp)
        abort = sequence.abort

        def recording_abort() -> None:
            self.generated_at_abort.setdefault(inp.request_id, sequence.generated)
            abort()

        sequence.abort = recording_abort
        return sequence


async def test_cancel_stops_generation_within_a_step_and_frees_the_slot(bus):
    async with running_worker(bus, max_num_seqs=1, engine_type=AbortRecordingEngine, ttft_ms=1, tokens_per_s=5,
                              min_tokens=1000, max_tokens=1000) as worker, \
            TokenbusClient(bus, idle_timeout=30) as client:
        long = client.new_request(MODEL, [ChatMessage("user", "go on forever")])
        queued = client.new_request(MODEL, [ChatMessage("user", "my turn")], max_tokens=3)
        long_stream = await client.submit(long)
        queued_stream = await client.submit(queued)
        received = 0
        async for reply in long_stream.events(idle_timeout=30):
            if reply.event.is_final:
                final = reply.event
                break
            received += 1
            if received == 3:
                await client.cancel(long.request_id, "client went away")
        queued_events = [r.event async for r in queued_stream.events(idle_timeout=30)]
        assert worker.running == 0
    assert final.finish_reason == "cancelled"
    # Nothing generated once the cancel reached the engine; only what it had made before is delivered.
    assert 3 <= final.completion_tokens <= worker.engine.generated_at_abort[long.request_id]
    assert final.completion_tokens == received
    assert queued_events[-1].finish_reason == "length"

    records = await read_all(bus, TopicCatalog(bus).completions, expected=2)
    completions = {c.request_id: c for c in (AvroCodec().decode(r.value, Completion) for r in records)}
    assert completions[long.request_id].cancelled and completions[long.request_id].completion_tokens == received


async def test_cancel_of_a_waiting_request_answers_it_without_generating(each_bus):
    async with running_worker(each_bus, max_num_seqs=1, tokens_per_s=50, min_tokens=200, max_tokens=200), \
            TokenbusClient(each_bus, idle_timeout=30) as client:
        busy = await client.submit(client.new_request(MODEL, [ChatMessage("user", "busy")]))
        await anext(aiter(busy.events(idle_timeout=30)))  # busy holds the only slot
        waiting = client.new_request(MODEL, [ChatMessage("user", "never mind")])
        waiting_stream = await client.submit(waiting)
        await asyncio.sleep(0.3)
        await client.cancel(waiting.request_id)
        events = [r.event async for r in waiting_stream.events(idle_timeout=30)]
        await client.cancel(busy.request_id)
    assert [(e.seq, e.finish_reason, e.completion_tokens) for e in events] == [(0, "cancelled", 0)]


async def test_a_group_cancel_stops_the_whole_group_and_what_is_fetched_of_it_later(bus):
    """One record naming ``{group}-*`` cancels the group's running and waiting requests, and one of
    the group fetched after it; a request of another group, waiting with them, is served."""
    tokens = TopicCatalog(bus).tokens

    def request(request_id: str, max_tokens: int | None = None) -> ChatRequest:
        return ChatRequest(request_id, MODEL, "batch", [ChatMessage("user", request_id)], tokens, 0, tenant="t",
                           max_tokens=max_tokens)

    async with running_worker(bus, max_num_seqs=2, tokens_per_s=20, min_tokens=200, max_tokens=200), \
            TokenbusClient(bus, idle_timeout=30) as client:
        group = [await client.submit(request(f"batch_g1-{line}")) for line in range(5)]
        other = await client.submit(request("batch_g2-0", max_tokens=3))
        await anext(aiter(group[0].events(idle_timeout=30)))  # the group holds the slots (two at most)
        await client.cancel(group_cancel_id("batch_g1"), "cancelled with its batch")
        late = await client.submit(request("batch_g1-5"))
        finals = [[r.event async for r in stream.events(idle_timeout=30)][-1] for stream in [*group, late]]
        other_final = [r.event async for r in other.events(idle_timeout=30)][-1]
    assert [f.finish_reason for f in finals] == ["cancelled"] * 6
    assert all(f.completion_tokens < 200 for f in finals) and finals[-1].completion_tokens == 0
    # Those that waited generated nothing: three of the five at least (two slots; the requests sit
    # on four partitions, so which were fetched first is not the order they were sent in).
    assert sorted(f.completion_tokens for f in finals[:5])[:3] == [0, 0, 0]
    assert other_final.finish_reason == "length" and other_final.completion_tokens == 3


async def test_a_worker_that_joins_after_a_cancel_does_not_run_what_was_cancelled(bus):
    """A GPU consumer starting reads the cancels the control topic holds before it fetches: the
    queued requests of a group cancelled before it came, and a single cancelled request, are
    answered cancelled without generating; another request queued with them is served."""
    tokens = TopicCatalog(bus).tokens

    def request(request_id: str) -> ChatRequest:
        return ChatRequest(request_id, MODEL, "batch", [ChatMessage("user", request_id)], tokens, 0, tenant="t",
                           max_tokens=3)

    async with TokenbusClient(bus, idle_timeout=30) as client:
        queued = [await client.submit(request(f"batch_late-{line}")) for line in range(3)]
        single = await client.submit(request("chatcmpl-late"))
        kept = await client.submit(request("batch_kept-0"))
        await client.cancel(group_cancel_id("batch_late"), "cancelled with its batch")
        await client.cancel("chatcmpl-late", "client went away")
        async with running_worker(bus, max_num_seqs=2):
            finals = [[r.event async for r in s.events(idle_timeout=30)][-1] for s in [*queued, single, kept]]
    assert [(f.finish_reason, f.completion_tokens) for f in finals[:4]] == [("cancelled", 0)] * 4
    assert finals[4].finish_reason == "length" and finals[4].completion_tokens == 3


def test_group_ids():
    assert cancelled_group(group_cancel_id("batch_abc")) == "batch_abc"
    assert cancelled_group("batch_abc-3") is None
    assert group_of("batch_abc-12") == "batch_abc" and group_of("chatcmpl-9f3a") is None
    assert group_of("chatcmpl-1a2b-0") == "chatcmpl-1a2b" and group_of("lonely") is None


async def test_restart_continues_unfinished_requests_from_the_log(each_bus):
    """A worker stopped mid-generation commits below its unfinished requests; the next one
    continues them after the tokens already published, and the text is the uninterrupted text."""
    engine = dict(ttft_ms=1, tokens_per_s=40, min_tokens=24, max_tokens=24)
    async with TokenbusClient(each_bus, idle_timeout=60) as client:
        requests = [client.new_request(MODEL, [ChatMessage("user", f"q{i}")], seed=i) for i in range(4)]
        streams = [await client.submit(r) for r in requests]
        collected = {r.request_id: [] for r in requests}

        async def collect(stream):
            async for reply in stream.events(idle_timeout=60):
                collected[stream.request_id].append(reply.event)

        readers = [asyncio.create_task(collect(s)) for s in streams]
        async with running_worker(each_bus, max_num_seqs=2, worker_id="first", **engine):
            while sum(len(v) for v in collected.values()) < 10:
                await asyncio.sleep(0.02)
        async with running_worker(each_bus, max_num_seqs=4, worker_id="second", **engine) as second:
            await asyncio.gather(*readers)
            assert second.metrics.registry.get_sample_value(
                "tokenbus:requests_taken_over_total", {"model_name": MODEL}) >= 1

    for request in requests:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        expected = await expected_output(messages, request.seed, settings=SimulatedEngineSettings(**engine))
        got = collected[request.request_id]
        assert [e.seq for e in got] == list(range(len(got)))
        assert "".join(e.text for e in got) == expected.text
        assert got[-1].completion_tokens == expected.completion_tokens == 24
    workers = {e.worker_id for events in collected.values() for e in events}
    assert workers == {"first", "second"}

