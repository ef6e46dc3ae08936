import asyncio

from tokenbus.gpu_consumers.engines import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    SamplingParams,
    SimulatedEngine,
    SimulatedEngineSettings,
)
from tokenbus.schemas import ChatMessage

FAST = dict(ttft_ms=1, tokens_per_s=2000)


def inp(request_id: str = "r", **sampling) -> GenerationInput:
    return GenerationInput(request_id, (ChatMessage("user", "two words"),), SamplingParams(**sampling))


async def run(engine: SimulatedEngine, *inputs: GenerationInput):
    async def one(i: GenerationInput):
        return [out async for out in engine.generate(i)]

    await engine.start()
    try:
        return await asyncio.gather(*(one(i) for i in inputs))
    finally:
        await engine.close()


async def test_same_seed_same_text_and_other_seed_other_text():
    a, b = await run(SimulatedEngine(SimulatedEngineSettings(**FAST)), inp("x", seed=1), inp("y", seed=1))
    (c,) = await run(SimulatedEngine(SimulatedEngineSettings(**FAST)), inp("x", seed=2))
    text = lambda outs: "".join(o.text_diff for o in outs)  # noqa: E731
    assert text(a) == text(b)
    assert text(a) != text(c)


async def test_one_token_per_step_and_usage_counts_them():
    (outs,) = await run(SimulatedEngine(SimulatedEngineSettings(**FAST, min_tokens=5, max_tokens=5)), inp())
    assert [len(o.token_ids_diff) for o in outs] == [1] * 5
    assert [o.completion_tokens for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].finish_reason == FINISH_STOP
    assert not any(o.finished for o in outs[:-1])
    assert outs[-1].prompt_tokens == 2 + 4


async def test_max_tokens_finishes_with_length():
    (outs,) = await run(SimulatedEngine(SimulatedEngineSettings(**FAST, min_tokens=20, max_tokens=20)), inp(max_tokens=3))
    assert len(outs) == 3 and outs[-1].finish_reason == FINISH_LENGTH and outs[-1].completion_tokens == 3


async def test_stop_sequence_cuts_the_text():
    settings = SimulatedEngineSettings(**FAST, min_tokens=30, max_tokens=30)
    (full,) = await run(SimulatedEngine(settings), inp(seed=3))
    text = "".join(o.text_diff for o in full)
    stop = text.split()[5]
    (cut,) = await run(SimulatedEngine(settings), inp(seed=3, stop=(stop,)))
    cut_text = "".join(o.text_diff for o in cut)
    assert cut[-1].finish_reason == FINISH_STOP
    assert stop not in cut_text and text.startswith(cut_text)


async def test_sequences_share_steps_like_a_batch():
    engine = SimulatedEngine(SimulatedEngineSettings(**FAST, min_tokens=10, max_tokens=10))
    results = await run(engine, *(inp(f"r{i}") for i in range(8)))
    assert all(len(outs) == 10 for outs in results)
    assert engine.steps < 8 * 10 / 2  # eight sequences advanced together, not one after another


async def test_abort_ends_within_one_step():
    engine = SimulatedEngine(SimulatedEngineSettings(ttft_ms=1, tokens_per_s=200, min_tokens=1000, max_tokens=1000))
    await engine.start()
    try:
        stream = engine.generate(inp())
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 3:
                stream.abort()
    finally:
        await engine.close()
    assert [o.finish_reason for o in outs] == [None, None, None, FINISH_CANCELLED]
    assert engine.running == 0


async def test_injected_failures_end_with_error():
    engine = SimulatedEngine(SimulatedEngineSettings(**FAST, failure_rate=1.0))
    (outs,) = await run(engine, inp())
    assert outs[-1].finish_reason == FINISH_ERROR and outs[-1].error
