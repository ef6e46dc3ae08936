import asyncio
import dataclasses
import json
import math
import time

import pytest

from tokenbus.gpu_consumers.engines import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    InvalidInput,
    SamplingParams,
    SimulatedEngine,
    SimulatedEngineSettings,
    StepOutput,
    simulated_prompts,
)
from tokenbus.gpu_consumers.engines.blocks import block_hashes
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY
from tokenbus.gpu_consumers.settings import WorkerSettings
from tokenbus.gpu_consumers.step_events import StepEvents
from tokenbus.gpu_consumers.token_log import Published
from tokenbus.schemas import ChatMessage, ChatRequest, TokenEvent, TokenLogprob, ToolCall, ToolSpec, whole_tool_calls

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


async def test_the_first_token_ends_prefill_and_decode_steps_bring_the_rest():
    """As in a real engine, a sequence's first token comes when it is ready (``ttft_ms`` after
    admission), not one decode step later; each later token takes a step."""
    engine = SimulatedEngine(SimulatedEngineSettings(ttft_ms=1, tokens_per_s=200, min_tokens=3, max_tokens=3))
    await engine.start()
    try:
        steps_before_each_token = [engine.steps async for _ in engine.generate(inp())]
    finally:
        await engine.close()
    assert steps_before_each_token == [0, 1, 2]


async def tokens_after_a_stall(catch_up_all: bool) -> tuple[int, list[StepOutput]]:
    """The tokens of the first output a reader gets after it held the event loop for 20 steps."""
    engine = SimulatedEngine(SimulatedEngineSettings(ttft_ms=1, tokens_per_s=200, min_tokens=60, max_tokens=60,
                                                     catch_up_all=catch_up_all))
    await engine.start()
    try:
        outs = []
        async for out in engine.generate(inp()):
            outs.append(out)
            if len(outs) == 2:
                time.sleep(20 / 200)  # the loop busy: the engine's step loop cannot run
        return len(outs[2].token_ids_diff), outs
    finally:
        await engine.close()


async def test_an_engine_apart_from_the_loop_makes_up_every_step_and_the_reader_takes_them_as_one():
    """``catch_up_all`` models an engine that generates apart from the consumer's event loop
    (TensorRT-LLM's executor): the steps it made meanwhile wait and are read as one output. By
    default a late step loop makes up one step and loses the rest of the time."""
    apart, outs = await tokens_after_a_stall(catch_up_all=True)
    held_back, _ = await tokens_after_a_stall(catch_up_all=False)
    assert apart >= 10
    assert held_back <= 2
    assert sum(len(o.token_ids_diff) for o in outs) == 60 and outs[-1].completion_tokens == 60
    assert [o.completion_tokens for o in outs] == sorted(o.completion_tokens for o in outs)


async def test_a_prompt_is_tokenized_once_for_its_generation_and_its_layout(monkeypatch):
    """As a real engine's ``PromptTokens``: the worker asks for both back to back."""
    made = []
    tokenize = simulated_prompts.tokenize_prompt
    monkeypatch.setattr(simulated_prompts, "tokenize_prompt", lambda i: made.append(i.request_id) or tokenize(i))
    engine = SimulatedEngine(SimulatedEngineSettings(**FAST, min_tokens=2, max_tokens=2))
    await engine.start()
    try:
        layouts = []
        for request_id in ("a", "b"):
            first = inp(request_id)
            stream = engine.generate(first)
            layouts.append(engine.prefix_cache.layout(dataclasses.replace(first)))  # an equal input, not the same
            assert len([out async for out in stream]) == 2
    finally:
        await engine.close()
    assert made == ["a", "b"]
    assert layouts[0].block_hashes == block_hashes(tokenize(inp("a"))[0], engine.settings.kv_block_tokens)


async def test_the_blocks_it_admits_a_prompt_with_are_its_layout(monkeypatch):
    """Named once a request: the worker asks for the layout of the very input the engine admitted."""
    named = []
    hashes = simulated_prompts.block_hashes
    monkeypatch.setattr(simulated_prompts, "block_hashes", lambda ids, size: named.append(size) or hashes(ids, size))
    engine = SimulatedEngine(SimulatedEngineSettings(**FAST, min_tokens=2, max_tokens=2))
    await engine.start()
    try:
        given = inp("a")
        stream = engine.generate(given)
        layout = engine.prefix_cache.layout(given)
        assert len([out async for out in stream]) == 2
    finally:
        await engine.close()
    assert len(named) == 1
    assert layout.block_hashes == hashes(simulated_prompts.tokenize_prompt(given)[0], engine.settings.kv_block_tokens)


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


async def test_a_sequence_whose_step_raises_ends_alone_and_the_others_are_served():
    """A NaN penalty (the bus refuses it; the engine must survive it anyway) makes the second
    draw raise: that sequence ends with an error, and the step loop serves the rest to the end."""
    settings = SimulatedEngineSettings(**FAST, min_tokens=6, max_tokens=6)
    bad, good, later = await run(SimulatedEngine(settings), inp("bad", frequency_penalty=float("nan")),
                                 inp("good"), inp("later", presence_penalty=0.5))
    assert bad[-1].finish_reason == FINISH_ERROR and "weights" in bad[-1].error
    assert bad[-1].completion_tokens == 1
    assert good[-1].finish_reason == later[-1].finish_reason == FINISH_STOP
    assert good[-1].completion_tokens == later[-1].completion_tokens == 6


# -- log probabilities ---------------------------------------------------------------------

async def test_asked_for_logprobs_each_token_has_its_own_and_the_likeliest_words():
    """Unpenalized, every word is equally likely: each token's log probability is -log of the
    vocabulary's size, and the likeliest words are the vocabulary's first (ties go to the first)."""
    settings = SimulatedEngineSettings(**FAST, min_tokens=6, max_tokens=6)
    (outs,) = await run(SimulatedEngine(settings), inp(seed=3, logprobs=3))
    scored = [t for o in outs for t in o.logprobs]
    assert [len(o.logprobs) for o in outs] == [len(o.token_ids_diff) for o in outs]
    assert "".join(t.token for t in scored) == "".join(o.text_diff for o in outs)
    assert {t.logprob for t in scored} == {-math.log(len(VOCABULARY))}
    assert [[a.token.strip() for a in t.top] for t in scored] == [VOCABULARY[:3]] * 6
    (plain,) = await run(SimulatedEngine(settings), inp(seed=3))
    assert all(o.logprobs == () for o in plain)  # not asked: none
    assert "".join(o.text_diff for o in plain) == "".join(o.text_diff for o in outs)  # asking changes no draw


async def test_penalized_logprobs_are_those_of_the_weights_drawn_from():
    """With a presence penalty p and n distinct words (vocabulary places) out already, a word not
    out yet has weight 1 against exp(-p) for each of those: log probability -log(V - n + n exp(-p)),
    and the likeliest words are the first places not out yet."""
    p = 1.5
    settings = SimulatedEngineSettings(**FAST, min_tokens=8, max_tokens=8)
    (outs,) = await run(SimulatedEngine(settings), inp(seed=4, presence_penalty=p, logprobs=4))
    seen: set[int] = set()
    for out in outs:
        (scored,), (token_id,) = out.logprobs, out.token_ids_diff
        n = len(seen)
        unseen = -math.log(len(VOCABULARY) - n + n * math.exp(-p))
        assert scored.logprob == pytest.approx(unseen - p if token_id in seen else unseen)
        assert [a.logprob for a in scored.top] == pytest.approx([unseen] * 4)
        first_unseen = [i for i in range(len(VOCABULARY)) if i not in seen][:4]
        assert [a.token.strip() for a in scored.top] == [VOCABULARY[i] for i in first_unseen]
        seen.add(token_id)
    assert len(seen) > 1


async def test_a_logit_bias_weighs_the_words_it_names_in_draws_and_in_their_logprobs():
    """A bias b on one word gives it weight exp(b) against 1 for every other word: it is drawn that
    much more often, its log probability is b - log(V - 2 + exp(b)) (a word biased by -100 weighs
    next to nothing, and is never drawn) and it heads the likeliest."""
    b = math.log(20)
    settings = SimulatedEngineSettings(**FAST, min_tokens=30, max_tokens=30)
    bias = ((5, b), (6, -100.0))
    (outs,) = await run(SimulatedEngine(settings), inp(seed=9, logit_bias=bias, logprobs=2))
    ids = [t for o in outs for t in o.token_ids_diff]
    total = len(VOCABULARY) - 2 + 20
    assert ids.count(5) > 5 and 6 not in ids  # about 20/61 of the draws (uniform: 1/43)
    for out in outs:
        (scored,), (token_id,) = out.logprobs, out.token_ids_diff
        assert scored.logprob == pytest.approx(math.log(20 / total) if token_id == 5 else -math.log(total))
        assert [a.token.strip() for a in scored.top] == [VOCABULARY[5], VOCABULARY[0]]
    with pytest.raises(InvalidInput, match=f"token id {len(VOCABULARY)} is not in the model's vocabulary"):
        SimulatedEngine(settings).generate(inp(logit_bias=((len(VOCABULARY), 1.0),)))


async def test_min_p_and_top_k_keep_the_heaviest_words_alone():
    """vLLM's ``min_p`` leaves out each word under that share of the heaviest's weight, ``top_k``
    all but the k heaviest (the first in the vocabulary among equals); the scores stay those of the
    weights before either, as the hf slots' are before top-p."""
    settings = SimulatedEngineSettings(**FAST, min_tokens=20, max_tokens=20)
    bias = ((5, 2.0), (9, 2.0), (11, 1.0))  # weights e^2, e^2, e against 1 for the other words
    floored, kept = await run(SimulatedEngine(settings), inp("floored", logit_bias=bias, min_p=0.5, logprobs=1),
                              inp("kept", logit_bias=bias, top_k=3))
    floored_ids = [t for o in floored for t in o.token_ids_diff]
    assert set(floored_ids) <= {5, 9} and len(set(floored_ids)) == 2  # e / e^2 < 0.5
    total = len(VOCABULARY) - 3 + 2 * math.exp(2) + math.e
    assert [t.logprob for o in floored for t in o.logprobs] == pytest.approx([2 - math.log(total)] * 20)
    assert set(t for o in kept for t in o.token_ids_diff) == {5, 9, 11}


async def test_a_tool_call_s_markup_tokens_are_certain():
    request = tool_request(logprobs=True, top_logprobs=2)
    inp_ = GenerationInput.from_request(request)
    [outs] = await run(SimulatedEngine(SimulatedEngineSettings(**FAST)), inp_)
    scored = [t for o in outs for t in o.logprobs]
    assert "".join(t.token for t in scored) == "".join(o.text_diff for o in outs)
    assert {t.logprob for t in scored} == {0.0} and all(len(t.top) == 1 for t in scored)


def test_steps_taken_as_one_keep_every_token_s_logprobs():
    first = StepOutput("a", (1,), 2, 1, logprobs=(TokenLogprob("a", -1.0),))
    later = StepOutput(" b", (2,), 2, 2, "stop", logprobs=(TokenLogprob(" b", -2.0),))
    assert first.followed_by(later).logprobs == (TokenLogprob("a", -1.0), TokenLogprob(" b", -2.0))


# -- function calls ------------------------------------------------------------------------

def tool_request(request_id: str = "tools-1", **overrides) -> ChatRequest:
    fields = dict(request_id=request_id, model="m", tier="standard", reply_topic="t", reply_partition=0, seed=5,
                  messages=[ChatMessage("user", "weather and time?")],
                  tools=[ToolSpec("get_weather", "", '{"type":"object","properties":{"city":{"type":"string"},'
                                                     '"days":{"type":"integer"}}}'),
                         ToolSpec("get_time", "", '{"type":"object","properties":{"tz":{"type":"string"}}}')])
    return ChatRequest(**{**fields, **overrides})


async def worker_events(request: ChatRequest, published: Published | None = None) -> list[TokenEvent]:
    """The token events a GPU consumer publishes for ``request`` (continuing after ``published``)."""
    published = published or Published()
    steps = StepEvents(request, "w", WorkerSettings().tool_parser, published)
    inp = GenerationInput.from_request(request, published.token_ids, published.text)
    [outs] = await run(SimulatedEngine(SimulatedEngineSettings(**FAST)), inp)
    return [steps.event(published.next_seq + i, out) for i, out in enumerate(outs)]


async def test_offered_tools_are_called_a_few_characters_a_token():
    events = await worker_events(tool_request())
    calls = whole_tool_calls(d for e in events for d in e.tool_calls)
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert set(json.loads(calls[0].arguments)) == {"city", "days"}
    assert events[-1].finish_reason == "tool_calls" and "".join(e.text for e in events) == ""
    assert events[-1].completion_tokens == len(events) > 20  # the markup was generated, token by token
    again = await worker_events(tool_request())
    assert again == [dataclasses.replace(e, created_at_ms=a.created_at_ms) for e, a in zip(events, again)]


async def test_after_a_tool_result_it_answers_in_words_unless_a_call_is_required():
    answered = [*tool_request().messages,
                ChatMessage("assistant", "", (ToolCall("call_1", "get_time", "{}"),)),
                ChatMessage("tool", "12:00", tool_call_id="call_1")]
    words = await worker_events(tool_request(messages=answered))
    assert words[-1].finish_reason == "stop" and "".join(e.text for e in words)
    required = await worker_events(tool_request(messages=answered, tool_choice="required"))
    assert required[-1].finish_reason == "tool_calls"
    named = await worker_events(tool_request(tool_choice="function", tool_choice_name="get_time"))
    assert [c.name for c in whole_tool_calls(d for e in named for d in e.tool_calls)] == ["get_time"]
    single = await worker_events(tool_request(parallel_tool_calls=False))
    assert len(whole_tool_calls(d for e in single for d in e.tool_calls)) == 1


async def test_max_tokens_in_the_middle_of_a_call_delivers_the_markup_as_text():
    events = await worker_events(tool_request(max_tokens=6))
    assert events[-1].finish_reason == "length" and not any(e.tool_calls for e in events)
    assert "".join(e.text for e in events).startswith("<tool_call>")


async def test_a_takeover_in_the_middle_of_the_calls_continues_them_exactly():
    whole = await worker_events(tool_request())
    for cut in (3, 20, 30, len(whole) - 1):
        published = Published(whole[:cut])
        rest = await worker_events(tool_request(), published)
        continued = whole[:cut] + rest
        assert whole_tool_calls(d for e in continued for d in e.tool_calls) == \
            whole_tool_calls(d for e in whole for d in e.tool_calls), f"cut after {cut} events"
        assert [e.seq for e in continued] == list(range(len(whole)))
        assert continued[-1].finish_reason == "tool_calls"
