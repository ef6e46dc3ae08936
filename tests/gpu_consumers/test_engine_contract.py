"""One contract, every engine: `simulated`, `hf` (a tiny random Llama built offline, on
CPU; `hf-slots` the same engine with slot batching, its default on CUDA) and `trtllm` (against
tests/fakes/tensorrt_llm, a fake of TensorRT-LLM's LLM API, because TensorRT-LLM cannot be
installed here; with TOKENBUS_TRTLLM_MODEL set on a GPU host with tensorrt_llm installed,
`trtllm-real` runs the same contract for real)."""

import asyncio
import dataclasses

import pytest

from tests.gpu_consumers.engine_contract import collect, continues_after_takeover, published, request, text_of
from tokenbus.gpu_consumers.engines import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    InvalidInput,
    SamplingParams,
    each_step,
)
from tokenbus.schemas import ChatMessage, ToolCall, ToolSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_streams_deltas_and_ends_with_a_finish_reason(engine):
    results = await asyncio.gather(*(collect(engine, request(i, f"question {i}", max_tokens=12)) for i in range(4)))
    for outs in results:
        assert all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].finish_reason in {FINISH_STOP, FINISH_LENGTH}
        counts = [o.completion_tokens for o in outs]
        assert counts == sorted(counts)
        assert outs[-1].completion_tokens == sum(len(o.token_ids_diff) for o in outs) <= 12
        assert all(o.prompt_tokens > 0 for o in outs)


async def test_max_tokens_caps_the_output(engine):
    outs = await collect(engine, request(max_tokens=5))
    assert outs[-1].completion_tokens <= 5
    if outs[-1].completion_tokens == 5:
        assert outs[-1].finish_reason == FINISH_LENGTH


async def test_a_request_prepared_first_streams_what_it_would_have(engine):
    """``prepare`` (what the worker awaits before ``generate``: the prompt tokenized in a thread)
    moves work, and changes nothing in the outputs."""
    plain = await collect(engine, request(11, "prepared or not", max_tokens=6))
    inp = request(11, "prepared or not", max_tokens=6)
    await engine.prepare(inp)
    prepared = await collect(engine, inp)
    # The same tokens, text and counts (how steps group depends on how fast the reader reads).
    assert [t for o in prepared for t in o.token_ids_diff] == [t for o in plain for t in o.token_ids_diff]
    assert text_of(prepared) == text_of(plain)
    assert (prepared[-1].prompt_tokens, prepared[-1].completion_tokens, prepared[-1].finish_reason) == \
        (plain[-1].prompt_tokens, plain[-1].completion_tokens, plain[-1].finish_reason)


async def test_longer_prompts_count_more_prompt_tokens(engine):
    short = await collect(engine, request(content="hi", max_tokens=2))
    long = await collect(engine, request(content="hi " * 30, max_tokens=2))
    assert long[-1].prompt_tokens > short[-1].prompt_tokens


async def test_a_text_prompt_is_continued_as_it_is_without_the_chat_template(engine):
    """A text completion (``text_prompt``): the words alone, where a chat message adds its template's
    markup; made ahead or not, the same prompt; tokenized with the tokenizer's own special tokens
    where the engine has a tokenizer."""
    words = "Once upon a time there was"
    chat = await collect(engine, request(21, words, max_tokens=4))
    text = await collect(engine, dataclasses.replace(request(21, words, max_tokens=4), text_prompt=True))
    assert 0 < text[-1].prompt_tokens < chat[-1].prompt_tokens
    assert text[-1].finished and text[-1].completion_tokens <= 4
    inp = dataclasses.replace(request(22, words, max_tokens=4), text_prompt=True)
    await engine.prepare(inp)
    assert (await collect(engine, inp))[-1].prompt_tokens == text[-1].prompt_tokens
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        assert text[-1].prompt_tokens == len(tokenizer(words)["input_ids"])


async def test_a_text_prompt_of_token_ids_is_those_tokens(engine):
    """A text prompt given as token ids (``prompt_token_ids``; its message holds their text): the
    engine's prompt is those ids as they are. Where the engine has a tokenizer, the ids of the text
    give what the text gives, and an id outside the vocabulary is refused."""
    words = "Once upon a time there was"
    text = dataclasses.replace(request(24, words, max_tokens=4), text_prompt=True)
    tokenizer = getattr(engine, "tokenizer", None)
    ids = tuple(tokenizer(words)["input_ids"]) if tokenizer is not None else (3, 1, 4, 1, 5, 9, 2)
    given = dataclasses.replace(text, prompt_token_ids=ids)
    outs = await collect(engine, given)
    assert outs[-1].prompt_tokens == len(ids) and outs[-1].finished and outs[-1].error is None
    if tokenizer is not None:
        assert text_of(outs) == text_of(await collect(engine, text))
        with pytest.raises(InvalidInput, match="not in the model's vocabulary"):
            engine.generate(dataclasses.replace(given, prompt_token_ids=(*ids, 10**9)))


async def test_a_truncated_prompt_is_its_last_tokens_and_names_no_prefix(engine):
    """vLLM's ``truncate_prompt_tokens``: the engine's prompt is the last tokens of the templated
    one (a text prompt of those ids gives what it gives, where the engine has a tokenizer), and its
    layout names no segment; a prompt shorter than the cut is whole."""
    long = request(25, "tell me a story about the bus and every token it carries to the edge", max_tokens=4)
    cut = dataclasses.replace(long, truncate_prompt_tokens=5)
    outs, whole = await collect(engine, cut), await collect(engine, long)
    assert outs[-1].prompt_tokens == 5 < whole[-1].prompt_tokens and outs[-1].error is None
    roomy = await collect(engine, dataclasses.replace(long, truncate_prompt_tokens=10_000))
    assert roomy[-1].prompt_tokens == whole[-1].prompt_tokens
    if engine.prefix_cache is not None:
        assert engine.prefix_cache.layout(cut).segment_ends == ()
    if hasattr(engine, "prompt_ids"):
        ids = engine.prompt_ids(long)[-5:]
        given = dataclasses.replace(long, text_prompt=True, prompt_token_ids=tuple(ids))
        assert engine.prompt_ids(cut) == ids and text_of(outs) == text_of(await collect(engine, given))


async def test_a_final_message_left_open_is_continued_and_taken_over_exactly(engine):
    """vLLM's ``continue_final_message``: the prompt ends inside the assistant's begun reply (fewer
    tokens than the reply closed and a new one begun), and a sequence taken over continues it as the
    uninterrupted one did."""
    begun = (ChatMessage("user", "tell me a story"), ChatMessage("assistant", "Once upon a"))
    closed = GenerationInput("contract-23", begun, SamplingParams(max_tokens=12))
    left_open = dataclasses.replace(closed, add_generation_prompt=False, continue_final_message=True)
    outs = await collect(engine, left_open)
    replied = await collect(engine, closed)
    if hasattr(engine, "tokenizer"):  # (the simulated engine counts a message's words, open or not)
        assert outs[-1].prompt_tokens < replied[-1].prompt_tokens
    await continues_after_takeover(engine, left_open, outs, 5)


async def test_offered_tools_and_earlier_calls_reach_the_prompt(engine):
    """Every engine tells the model about the functions offered (engines/chat_template.py)."""
    history = (ChatMessage("user", "weather?"), ChatMessage("assistant", "", (ToolCall("c1", "get_weather", '{"city":"Oslo"}'),)),
               ChatMessage("tool", "3 C", tool_call_id="c1"))
    plain = GenerationInput("contract-tools", history, SamplingParams(max_tokens=2), tool_choice="none",
                            tools=(ToolSpec("get_weather", "Weather now", '{"type":"object"}'),))
    offered = dataclasses.replace(plain, tool_choice="auto")
    without_tools = await collect(engine, plain)
    with_tools = await collect(engine, offered)
    assert with_tools[-1].prompt_tokens > without_tools[-1].prompt_tokens > 0


async def test_kv_cache_usage_is_reported_while_sequences_run(engine):
    """Each engine reports the share of its KV cache in use (TensorRT-LLM's from its iteration
    stats, which arrive within about a second). The sequences are long enough to still run then:
    an engine generates ahead of its reader, and frees a finished sequence's blocks."""
    streams = [engine.generate(request(i, "tell me a long story", max_tokens=1000)) for i in range(3)]
    iterators = [aiter(s) for s in streams]
    try:
        for it in iterators:
            await anext(it)
        usage = engine.kv_cache_usage()
        for _ in range(30):
            if usage:
                break
            await asyncio.sleep(0.1)
            usage = engine.kv_cache_usage()
        assert usage is not None and 0 < usage <= 1
    finally:
        for s in streams:
            s.abort()
        for it in iterators:
            async for _ in it:
                pass


async def test_abort_ends_the_stream_within_one_step(engine):
    stream = engine.generate(request(max_tokens=400))
    outs = []
    async for out in stream:
        outs.append(out)
        if len(outs) == 2:
            stream.abort()
    assert outs[-1].finish_reason == FINISH_CANCELLED
    assert len(outs) <= 4  # two before the abort, at most one step in flight, then the final


async def test_an_abort_ends_the_stream_at_its_next_read_however_far_the_engine_ran_ahead(engine):
    """A worker that falls behind its engine (a slow publish, a busy loop) must not give out
    tokens made after it cancelled, nor count them in the final."""
    stream = engine.generate(request(max_tokens=400))
    outs = []
    async for out in stream:
        outs.append(out)
        if len(outs) == 2:
            await asyncio.sleep(0.5)  # the engine goes on stepping meanwhile
            stream.abort()
    assert [o.finish_reason for o in outs] == [None, None, FINISH_CANCELLED]
    assert outs[-1].completion_tokens == sum(len(o.token_ids_diff) for o in outs)


async def test_a_reader_that_fell_behind_gets_the_steps_that_waited_as_one(engine):
    """A worker behind its engine publishes one token event for the steps that waited (vLLM's
    output collector merges a slow reader's deltas the same way): fewer events to encode and relay
    just when it needs to catch up, and the same tokens and text. (TensorRT-LLM queues a response
    per step for its reader; its adapter handles those that waited at once.)"""
    full = await collect(engine, request(9, "tell me a story", max_tokens=24))
    outs = []
    async for out in engine.generate(request(9, "tell me a story", max_tokens=24)):
        outs.append(out)
        if len(outs) == 1:
            await asyncio.sleep(0.5)  # the engine goes on stepping meanwhile
    assert len(full) > 2
    assert len(outs) < len(full)
    assert [t for o in outs for t in o.token_ids_diff] == [t for o in full for t in o.token_ids_diff]
    assert text_of(outs) == text_of(full)
    assert (outs[-1].completion_tokens, outs[-1].finish_reason) == (full[-1].completion_tokens, full[-1].finish_reason)


async def pushed(engine, inp: GenerationInput, sink=None):
    """The steps ``each_step`` hands over (pushed by the engine where its stream can push)."""
    outs = []
    stream = engine.generate(inp)
    await asyncio.wait_for(each_step(stream, sink(stream, outs) if sink else outs.append), 60)
    return outs


async def test_steps_handed_over_through_each_step_are_the_steps_read(engine):
    """The worker takes an engine's steps through ``each_step``: pushed where the engine's stream
    can (no task woken per token), read otherwise; the same tokens, text and final either way."""
    read = await collect(engine, request(11, "tell me a story", max_tokens=16))
    handed = await pushed(engine, request(11, "tell me a story", max_tokens=16))
    assert [t for o in handed for t in o.token_ids_diff] == [t for o in read for t in o.token_ids_diff]
    assert text_of(handed) == text_of(read)
    assert (handed[-1].completion_tokens, handed[-1].finish_reason) == (read[-1].completion_tokens, read[-1].finish_reason)
    assert all(o.finish_reason is None for o in handed[:-1])


async def test_an_abort_from_the_sink_ends_the_handed_over_steps_with_a_cancel(engine):
    def sink(stream, outs):
        def take(out):
            outs.append(out)
            if len(outs) == 2:
                stream.abort()
        return take

    outs = await pushed(engine, request(12, max_tokens=400), sink)
    assert outs[-1].finish_reason == FINISH_CANCELLED
    assert len(outs) <= 4  # two before the abort, at most one step in flight, then the final
    assert outs[-1].completion_tokens == sum(len(o.token_ids_diff) for o in outs)


async def test_a_sink_that_raises_fails_its_own_stream_only(engine):
    """A step the worker cannot publish fails that request; the engine goes on serving the rest."""
    def failing(stream, outs):
        def take(out):
            outs.append(out)
            if len(outs) == 2:
                raise ValueError("this request's step would not publish")
        return take

    failed = engine.generate(request(13, "first", max_tokens=30))
    outs: list = []
    healthy = asyncio.ensure_future(pushed(engine, request(14, "second", max_tokens=12)))
    with pytest.raises(ValueError, match="would not publish"):
        await asyncio.wait_for(each_step(failed, failing(failed, outs)), 60)
    failed.abort()  # as the worker stops a stream it leaves
    assert len(outs) == 2
    served = await asyncio.wait_for(healthy, 60)
    assert served[-1].finish_reason in {FINISH_STOP, FINISH_LENGTH}
    after = await collect(engine, request(15, "third", max_tokens=5))
    assert after[-1].finish_reason in {FINISH_STOP, FINISH_LENGTH}


async def test_continuing_after_a_prefix_equals_the_uninterrupted_output(engine):
    full = await collect(engine, request(7, "tell me a story", max_tokens=16))
    prefix_ids, prefix_text = published(full, 6)
    rest = await collect(engine, GenerationInput("contract-7", (ChatMessage("user", "tell me a story"),),
                                                 SamplingParams(max_tokens=16), prefix_ids, prefix_text))
    assert prefix_text + text_of(rest) == text_of(full), (
        f"uninterrupted {[(o.token_ids_diff, o.text_diff) for o in full]}, "
        f"continued after {list(prefix_ids)} with {[(o.token_ids_diff, o.text_diff) for o in rest]}")
    assert rest[-1].completion_tokens == full[-1].completion_tokens
    assert rest[-1].finish_reason == full[-1].finish_reason


async def test_a_continuation_gives_out_what_the_previous_worker_held_back(engine):
    """A worker holds back text that may become a stop sequence or a function call; if it dies
    there, its successor must still give that text out."""
    full = await collect(engine, request(8, "tell me a story", max_tokens=16))
    ids = [t for o in full for t in o.token_ids_diff]
    prefix_ids, prefix_text = published(full, 6)
    sent = prefix_text[:-3]  # the last three characters were held back, never published
    rest = await collect(engine, GenerationInput("contract-8", (ChatMessage("user", "tell me a story"),),
                                                 SamplingParams(max_tokens=16), prefix_ids, sent))
    assert sent + text_of(rest) == text_of(full), \
        f"token ids: uninterrupted {ids}, continued {list(prefix_ids)} + {[t for o in rest for t in o.token_ids_diff]}"


async def test_a_continuation_at_its_token_limit_only_ends(engine):
    """A worker that published a sequence's last token but not its end: the successor generates
    nothing more, gives out the text held back, and ends it for its length."""
    full = await collect(engine, request(10, "tell me a story", max_tokens=12))
    ids = tuple(t for o in full for t in o.token_ids_diff)
    assert len(ids) == 12, "the contract's engines run to max_tokens on this prompt"
    sent = text_of(full)[:-3]
    rest = await collect(engine, GenerationInput("contract-10", (ChatMessage("user", "tell me a story"),),
                                                 SamplingParams(max_tokens=12), ids, sent))
    assert [(o.token_ids_diff, o.finish_reason, o.completion_tokens) for o in rest] == [((), FINISH_LENGTH, 12)]
    assert sent + text_of(rest) == text_of(full)


async def test_a_prefix_outside_the_vocabulary_is_refused_and_the_engine_serves_on(engine):
    """A takeover's prefix comes off the bus: an id the model does not have is refused before it
    reaches the model (on CUDA it would stop the process), and the engine serves the next request."""
    full = await collect(engine, request(16, "tell me a story", max_tokens=6))
    ids = [t for o in full for t in o.token_ids_diff]
    for bad in (10**9, -1):
        inp = GenerationInput("contract-16", (ChatMessage("user", "tell me a story"),), SamplingParams(max_tokens=6),
                              (ids[0], bad), "")
        with pytest.raises(InvalidInput, match=f"token id {bad} is not in the model's vocabulary"):
            await engine.prepare(inp)
            engine.generate(inp)
    again = await collect(engine, request(16, "tell me a story", max_tokens=6))
    assert (text_of(again), again[-1].finish_reason) == (text_of(full), full[-1].finish_reason)



async def test_a_shared_prefix_is_served_from_the_cache_and_reported(engine):
    """The second prompt with the same long system message reuses its blocks (``cached_tokens``),
    and the engine's prefix cache says it holds the block where that message ends (what the worker
    reports for KV-cache-aware routing). Every engine here keeps one."""
    system = ChatMessage("system", "Answer as the shared assistant of the contract test would. " * 12)
    first, second = (GenerationInput(f"cached-{i}", (system, ChatMessage("user", f"question number {i}")),
                                     SamplingParams(max_tokens=4)) for i in (1, 2))
    cache = engine.prefix_cache
    assert cache is not None
    layout = cache.layout(second)
    system_blocks = layout.segment_ends[0] // layout.block_tokens
    assert system_blocks >= 2, "the system message should span blocks"
    anchor = layout.block_hashes[system_blocks - 1]

    first_outs = await collect(engine, first)
    for _ in range(100):  # engines that report through events (trtllm) catch up within a poll
        if cache.resident([anchor]):
            break
        await asyncio.sleep(0.05)
    assert cache.resident([anchor]) == {anchor}
    second_outs = await collect(engine, second)

    assert first_outs[-1].cached_tokens == 0
    cached = second_outs[-1].cached_tokens
    assert system_blocks * layout.block_tokens <= cached < second_outs[-1].prompt_tokens
    assert cached % layout.block_tokens == 0
