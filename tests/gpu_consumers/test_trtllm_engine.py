"""What the `trtllm` engine asks of TensorRT-LLM's LLM API beyond the engine contract, against
tests/fakes/tensorrt_llm (TensorRT-LLM cannot be installed here; the contract suite's
`trtllm-real` runs on a GPU host): token ids only, since the adapter detokenizes them itself, and
the engine's stream interval when one is set."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.gpu_consumers.helpers import fake_tensorrt_llm
from tokenbus.gpu_consumers.engines import GenerationInput, InvalidInput, SamplingParams
from tokenbus.gpu_consumers.engines.detokenize import REPLACEMENT_CHAR
from tokenbus.gpu_consumers.engines.trtllm import TrtLlmEngine, TrtLlmEngineSettings
from tokenbus.schemas import ChatMessage

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module", autouse=True)
def fake():
    with fake_tensorrt_llm():
        yield


async def outputs(tiny_model: Path, **settings) -> tuple[TrtLlmEngine, list]:
    engine = TrtLlmEngine(TrtLlmEngineSettings(model=str(tiny_model), default_max_tokens=24, **settings))
    await engine.start()
    try:
        inp = GenerationInput("trt-1", (ChatMessage("user", "tell me a story"),), SamplingParams(max_tokens=24))
        return engine, [out async for out in engine.generate(inp)]
    finally:
        await engine.close()


async def recording(tiny_model: Path, default_max_tokens: int, **settings) -> tuple[TrtLlmEngine, list]:
    """A started engine whose LLM API calls are recorded: (input ids, SamplingParams) each."""
    asked: list = []
    engine = TrtLlmEngine(TrtLlmEngineSettings(model=str(tiny_model), default_max_tokens=default_max_tokens, **settings))
    await engine.start()
    generate_async = engine._llm.generate_async
    engine._llm.generate_async = lambda ids, params, **kw: asked.append((ids, params)) or generate_async(ids, params, **kw)
    return engine, asked


async def test_the_engine_is_asked_for_token_ids_and_the_adapter_gives_the_text(tiny_model):
    engine, asked = await recording(tiny_model, 24)
    try:
        inp = GenerationInput("trt-0", (ChatMessage("user", "tell me a story"),), SamplingParams(max_tokens=24))
        outs = [out async for out in engine.generate(inp)]
    finally:
        await engine.close()
    assert [params.detokenize for _, params in asked] == [False]
    ids = [t for o in outs for t in o.token_ids_diff]
    assert len(ids) == 24
    # The fake's random bytes may end inside a character, which a stream never gives out.
    whole = engine._llm.tokenizer.decode(ids, skip_special_tokens=True).rstrip(REPLACEMENT_CHAR)
    assert "".join(o.text_diff for o in outs) == whole != ""


async def test_a_stream_interval_gives_fewer_steps_with_the_same_tokens_and_text(tiny_model):
    every, every_outs = await outputs(tiny_model)
    fourth, fourth_outs = await outputs(tiny_model, stream_interval=4)
    assert "stream_interval" not in every._llm.kwargs  # 1 is not passed: not every backend takes it
    assert fourth._llm.kwargs["stream_interval"] == 4
    # Every step's tokens come in fours (a reader that fell behind may take several responses at once).
    assert len(fourth_outs) <= 6 and all(len(o.token_ids_diff) % 4 == 0 for o in fourth_outs)
    assert [t for o in fourth_outs for t in o.token_ids_diff] == [t for o in every_outs for t in o.token_ids_diff]
    assert "".join(o.text_diff for o in fourth_outs) == "".join(o.text_diff for o in every_outs)
    assert (fourth_outs[-1].completion_tokens, fourth_outs[-1].finish_reason) == (24, every_outs[-1].finish_reason)


async def test_penalties_are_asked_for_on_the_output_alone(tiny_model):
    """TensorRT-LLM counts the prompt's tokens too unless ``prompt_ignore_length`` says how many to
    pass over; a taken-over sequence's published output, sent after its prompt, is counted."""
    engine, asked = await recording(tiny_model, 8)
    messages = (ChatMessage("user", "tell me a story"),)
    try:
        for sampling, prefix in ((SamplingParams(max_tokens=8), ()),
                                 (SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.25), (11, 12))):
            inp = GenerationInput("trt-2", messages, sampling, prefix_token_ids=prefix)
            [out async for out in engine.generate(inp)]
    finally:
        await engine.close()
    (plain_ids, plain), (continued_ids, penalized) = asked
    assert (plain.presence_penalty, plain.frequency_penalty, plain.prompt_ignore_length) == (0, 0, 0)
    assert (penalized.presence_penalty, penalized.frequency_penalty) == (0.5, -0.25)
    assert penalized.prompt_ignore_length == len(plain_ids) == len(continued_ids) - 2


async def test_a_structured_response_format_is_guided_decoding_where_a_backend_is_configured(tiny_model):
    """A JSON or regular expression ``response_format`` asks the LLM API's ``GuidedDecodingParams``
    (the schema's JSON text, ``json_object``, or the ``regex``), and the LLM is made with
    ``guided_decoding_backend``; without one configured, such a request is refused, and a plain one
    asks no guide."""
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}}'
    guided, asked = await recording(tiny_model, 8, guided_decoding_backend="xgrammar")
    unguided = TrtLlmEngine(TrtLlmEngineSettings(model=str(tiny_model), default_max_tokens=8))
    await unguided.start()
    messages = (ChatMessage("user", "where to?"),)
    try:
        for sampling in (SamplingParams(response_format="json_schema", json_schema=schema),
                         SamplingParams(response_format="json_object"), SamplingParams(),
                         SamplingParams(response_format="regex", guided_regex="(rail|road)")):
            [out async for out in guided.generate(GenerationInput("trt-json", messages, sampling))]
        with pytest.raises(InvalidInput, match="TOKENBUS_TRTLLM_GUIDED_DECODING_BACKEND"):
            unguided.generate(GenerationInput("trt-json", messages, SamplingParams(response_format="json_object")))
    finally:
        await guided.close()
        await unguided.close()
    assert guided._llm.kwargs["guided_decoding_backend"] == "xgrammar"
    assert "guided_decoding_backend" not in unguided._llm.kwargs
    schema_guide, object_guide, none, regex_guide = (params.guided_decoding for _, params in asked)
    assert (schema_guide.json, schema_guide.json_object) == (schema, False)
    assert (object_guide.json, object_guide.json_object) == (None, True) and none is None
    assert (regex_guide.regex, regex_guide.json, regex_guide.json_object) == ("(rail|road)", None, False)


async def test_prompt_log_probabilities_are_asked_for_and_read_in_either_length_a_build_gives(tiny_model):
    """Asked for (at least one likeliest: a build may read 0 as none), they come with the first step
    alone: the prompt's first token unscored, then an entry a later token (the fake's, and a build
    that gives the first token an entry too, None as vLLM's: passed over); a taken-over sequence,
    whose first step was published, asks for none."""
    engine, asked = await recording(tiny_model, 4)
    messages = (ChatMessage("user", "tell me a story"),)
    try:
        outs = [o async for o in engine.generate(GenerationInput("trt-p1", messages, SamplingParams(max_tokens=4,
                                                                                                      prompt_logprobs=0)))]
        taken_over = [o async for o in engine.generate(GenerationInput("trt-p2", messages, SamplingParams(
            max_tokens=4, prompt_logprobs=2), prefix_token_ids=outs[0].token_ids_diff))]
        stream = engine.generate(GenerationInput("trt-p3", messages, SamplingParams(max_tokens=4, prompt_logprobs=1)))
        prompt = asked[-1][0]
        entries = engine._llm.prompt_logprobs_of(prompt, 1)
        with_first = stream._prompt_logprobs(SimpleNamespace(prompt_logprobs=[None, *entries]))
        stream.abort()
    finally:
        await engine.close()
    tokenizer = engine._llm.tokenizer
    assert [params.prompt_logprobs for _, params in asked] == [1, None, 1]
    first, *rest = outs[0].prompt_logprobs
    assert (first.token, first.logprob, first.top) == (tokenizer.decode([prompt[0]]), 0.0, [])
    expected = engine._llm.prompt_logprobs_of(prompt, 1)
    assert [(t.token, t.logprob) for t in rest] == [(tokenizer.decode([i]), e[i].logprob)
                                                    for i, e in zip(prompt[1:], expected, strict=True)]
    assert all(t.top == [] for t in rest)  # none asked: the one the build was asked for is cut
    assert all(o.prompt_logprobs == () for o in outs[1:] + taken_over)
    assert [t.logprob for t in with_first[1:]] == [t.logprob for t in rest]
    assert len(with_first[1].top) == 1


async def test_log_probabilities_are_asked_for_and_read_in_either_form_a_build_gives(tiny_model):
    """Asked for (``SamplingParams.logprobs``, none where not asked), they come back as vLLM's
    dicts (the fake's, and TensorRT-LLM's PyTorch backend's): the sampled token's and the likeliest;
    a build that returns the sampled token's alone as a float a token is read too, with no likeliest."""
    engine, asked = await recording(tiny_model, 6)
    messages = (ChatMessage("user", "tell me a story"),)
    try:
        scored = [o async for o in engine.generate(GenerationInput("trt-3", messages, SamplingParams(max_tokens=6, logprobs=2)))]
        plain = [o async for o in engine.generate(GenerationInput("trt-4", messages, SamplingParams(max_tokens=6)))]
        floats = SimpleNamespace(logprobs=[-0.5, -1.5])
        stream = engine.generate(GenerationInput("trt-5", messages, SamplingParams(max_tokens=6, logprobs=3)))
        read = stream._logprobs(floats, 0, (5, 6))
        stream.abort()
    finally:
        await engine.close()
    assert [params.logprobs for _, params in asked] == [2, None, 3]
    tokenizer = engine._llm.tokenizer
    for out in scored:
        for token_id, token in zip(out.token_ids_diff, out.logprobs, strict=True):
            assert (token.token, token.logprob) == (tokenizer.decode([token_id]), -0.25)
            assert [(a.token, a.logprob) for a in token.top] == [(tokenizer.decode([token_id]), -0.25),
                                                                 (tokenizer.decode([(token_id + 1) % len(tokenizer)]), -1.25)]
    assert all(o.logprobs == () for o in plain)
    assert [(t.token, t.logprob, t.top) for t in read] == [(tokenizer.decode([5]), -0.5, []), (tokenizer.decode([6]), -1.5, [])]
