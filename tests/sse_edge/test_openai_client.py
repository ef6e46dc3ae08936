"""Acceptance: the official openai package against the real embedded stack
(edge -> tansu -> GPU consumer -> tansu -> edge)."""

import asyncio
import json
import re

import httpx
import openai
import pydantic
import pytest

from tests.conftest import ALIAS, MODEL, SLOW_MODEL, UNSERVED_MODEL
from tests.expected import expected_output
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def messages_for(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"Tell me fact number {i}."}]


async def stream_one(client, i: int):
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages_for(i), seed=i, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    return chunks


async def test_32_streams_and_8_plain_completions_are_exact(client):
    streamed, plain = await asyncio.gather(
        asyncio.gather(*(stream_one(client, i) for i in range(32))),
        asyncio.gather(*(client.chat.completions.create(model=MODEL, messages=messages_for(i), seed=i)
                         for i in range(100, 108))),
    )

    for i, chunks in enumerate(streamed):
        expected = await expected_output(messages_for(i), seed=i)
        assert chunks[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert pieces == expected.pieces, f"stream {i} lost, repeated or reordered tokens"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [expected.finish_reason]
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        assert usage.completion_tokens == len(pieces) == expected.completion_tokens
        assert usage.prompt_tokens == expected.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert len({c.id for c in chunks}) == 1

    for i, completion in zip(range(100, 108), plain):
        expected = await expected_output(messages_for(i), seed=i)
        assert completion.object == "chat.completion"
        assert completion.choices[0].message.content == expected.text
        assert completion.choices[0].finish_reason == expected.finish_reason
        assert completion.usage.completion_tokens == expected.completion_tokens
        assert completion.usage.prompt_tokens == expected.prompt_tokens


async def test_max_tokens_limits_the_stream(client):
    chunks = await client.chat.completions.create(model=MODEL, messages=messages_for(1), seed=1, max_tokens=2, stream=True)
    chunks = [c async for c in chunks]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    expected = await expected_output(messages_for(1), seed=1, max_tokens=2)
    assert pieces == expected.pieces and len(pieces) == 2
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_lists_the_served_model(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL, SLOW_MODEL, UNSERVED_MODEL, ALIAS]


async def test_a_model_named_by_its_alias_is_served_as_itself(client):
    """A client that names an OpenAI model the deployment serves another by (an alias) is served
    by that model, the same answer as naming it, which its answer names."""
    aliased = await client.chat.completions.create(model=ALIAS, messages=messages_for(3), seed=71)
    named = await client.chat.completions.create(model=MODEL, messages=messages_for(3), seed=71)
    assert aliased.model == MODEL and aliased.choices[0].message.content == named.choices[0].message.content
    assert (await client.models.retrieve(ALIAS)).id == ALIAS
    response = await client.responses.create(model=ALIAS, input="Hello.", extra_body={"seed": 72})
    assert response.model == MODEL and response.status == "completed"


async def test_responses_name_their_completion_as_openai_s_request_id(client):
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages_for(0), max_tokens=2)
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id == completion._request_id
    async with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages_for(1), max_tokens=2, stream=True) as streamed:
        chunks = [chunk async for chunk in await streamed.parse()]
    assert streamed.headers["x-request-id"] == chunks[0].id


async def test_a_served_model_is_retrieved_and_an_unknown_one_is_not_found(client):
    model = await client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "tokenbus")
    with pytest.raises(openai.NotFoundError) as exc:
        await client.models.retrieve("no-such-model")
    assert (exc.value.code, exc.value.param) == ("model_not_found", "model")


async def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(model="no-such-model", messages=messages_for(0))
    assert exc.value.code == "model_not_found"


async def test_wrong_type_is_a_bad_request_naming_the_param(client):
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=messages_for(0), temperature="warm")
    assert exc.value.param == "temperature"


async def test_presence_and_frequency_penalties_reach_the_engine(client):
    """OpenAI's penalties travel on the bus to the engine, for chat and text completions: each
    answer is what the stack's engine gives the penalized request, not the plain one; out of
    OpenAI's range (-2 to 2) they are refused naming the param."""
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    messages = [{"role": "user", "content": "Say it again."}]
    penalized = await expected_output(messages, seed=41, max_tokens=30, **penalties)
    assert penalized.text != (await expected_output(messages, seed=41, max_tokens=30)).text
    chat = await client.chat.completions.create(model=MODEL, messages=messages, seed=41, max_tokens=30, **penalties)
    assert chat.choices[0].message.content == penalized.text
    prompted = await expected_output(messages, seed=41, max_tokens=30, text_prompt=True, **penalties)
    text = await client.completions.create(model=MODEL, prompt="Say it again.", seed=41, max_tokens=30, **penalties)
    assert text.choices[0].text == prompted.text
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model=MODEL, messages=messages, frequency_penalty=2.5)
    assert exc.value.param == "frequency_penalty"


async def test_a_logit_bias_reaches_the_engine_and_an_id_it_lacks_is_a_bad_request(client):
    """OpenAI's ``logit_bias`` travels on the bus to the engine, for chat and text completions,
    streamed and whole: each answer is what the stack's engine gives the biased request (a word's id
    is its place in the simulated vocabulary). An id the engine's vocabulary lacks is a 400 naming
    it, from the engine (only it knows its vocabulary); a bias out of OpenAI's range is refused at once."""
    messages = [{"role": "user", "content": "Lean on a word."}]
    bias = {"3": 2.0, "7": -100.0}
    biased = await expected_output(messages, seed=43, max_tokens=30, logit_bias=((3, 2.0), (7, -100.0)))
    assert biased.text != (await expected_output(messages, seed=43, max_tokens=30)).text
    chat = await client.chat.completions.create(model=MODEL, messages=messages, seed=43, max_tokens=30, logit_bias=bias)
    assert chat.choices[0].message.content == biased.text
    stream = await client.chat.completions.create(model=MODEL, messages=messages, seed=43, max_tokens=30,
                                                  logit_bias=bias, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == biased.text
    prompted = await expected_output(messages, seed=43, max_tokens=30, text_prompt=True, logit_bias=((3, 2.0), (7, -100.0)))
    text = await client.completions.create(model=MODEL, prompt="Lean on a word.", seed=43, max_tokens=30, logit_bias=bias)
    assert text.choices[0].text == prompted.text
    with pytest.raises(openai.BadRequestError) as lacking:
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logit_bias={"40000": 5})
    assert lacking.value.code == "invalid_request" and "token id 40000 is not in the model's vocabulary" in str(lacking.value)
    with pytest.raises(openai.BadRequestError) as out_of_range:
        await client.completions.create(model=MODEL, prompt="x", logit_bias={"3": -150})
    assert out_of_range.value.param == "logit_bias" and "not in [-100, 100]" in str(out_of_range.value)


async def test_vllm_s_sampling_extensions_reach_the_engine(client):
    """vLLM's sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
    ``stop_token_ids``, ``allowed_token_ids``, ``bad_words``), as its clients send them (``extra_body``), travel on the bus to the
    engine, for chat and text completions: each answer is what the stack's engine gives the request
    asking them (a word's id is its place in the simulated vocabulary)."""
    messages = [{"role": "user", "content": "Keep to the likeliest."}]
    asked = {"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.5, "min_tokens": 12, "stop_token_ids": [4, 17]}
    sampling = dict(top_k=3, min_p=0.1, repetition_penalty=1.5, min_tokens=12, stop_token_ids=(4, 17),
                    logit_bias=((4, 1.0), (17, 1.0)))
    expected = await expected_output(messages, seed=47, max_tokens=30, **sampling)
    assert expected.completion_tokens >= 12 and expected.finish_reason == "stop"  # at a stop id, after 12
    chat = await client.chat.completions.create(model=MODEL, messages=messages, seed=47, max_tokens=30,
                                                logit_bias={"4": 1, "17": 1}, extra_body=asked)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (expected.text, "stop")
    assert chat.usage.completion_tokens == expected.completion_tokens
    prompted = await expected_output(messages, seed=47, max_tokens=30, text_prompt=True, **sampling)
    text = await client.completions.create(model=MODEL, prompt="Keep to the likeliest.", seed=47, max_tokens=30,
                                           logit_bias={"4": 1, "17": 1}, extra_body=asked)
    assert text.choices[0].text == prompted.text
    allowed = await client.chat.completions.create(model=MODEL, messages=messages, seed=47, max_tokens=12,
                                                   extra_body={"allowed_token_ids": [2, 3]})
    expected = await expected_output(messages, seed=47, max_tokens=12, allowed_token_ids=(2, 3))
    assert allowed.choices[0].message.content == expected.text
    assert set(expected.text.split()) <= {VOCABULARY[2], VOCABULARY[3]}
    plain = await expected_output(messages, seed=47, max_tokens=20)
    said = plain.text.split()
    bad = [f"  {said[2]} {said[3]}", said[5]]  # a word of two tokens (leading spaces dropped) and one of one
    refused = await client.chat.completions.create(model=MODEL, messages=messages, seed=47, max_tokens=20,
                                                   extra_body={"bad_words": bad})
    expected = await expected_output(messages, seed=47, max_tokens=20, bad_words=tuple(bad))
    assert refused.choices[0].message.content == expected.text != plain.text
    kept = expected.text.split()
    assert said[5] not in kept and (said[2], said[3]) not in set(zip(kept, kept[1:], strict=False))


class Trip(pydantic.BaseModel):
    city: str
    days: int
    rail: bool


async def test_a_json_response_format_answers_in_json_of_its_schema(client):
    """OpenAI's structured outputs through the official client: ``chat.completions.parse`` with a
    pydantic model (``json_schema``, strict) gets an answer that parses into it, and a streamed
    ``json_object`` request a JSON object; each is what the stack's engine answers the request with
    that response format on the bus. A text completion asks it as vLLM's clients do, and so do
    vLLM's own ways of asking (``guided_json``, ``structured_outputs``)."""
    messages = [{"role": "user", "content": "Plan a trip."}]
    parsed = await client.chat.completions.parse(model=MODEL, messages=messages, seed=61, response_format=Trip)
    trip = parsed.choices[0].message.parsed
    assert isinstance(trip, Trip) and parsed.choices[0].finish_reason == "stop"
    # (the client sends the model's schema made strict; the simulated engine draws from its properties alone)
    expected = await expected_output(messages, seed=61, response_format="json_schema",
                                     json_schema=json.dumps(Trip.model_json_schema()))
    assert parsed.choices[0].message.content == expected.text
    stream = await client.chat.completions.create(model=MODEL, messages=messages, seed=61, stream=True,
                                                  response_format={"type": "json_object"})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert isinstance(json.loads(text), dict)
    assert text == (await expected_output(messages, seed=61, response_format="json_object")).text
    completion = await client.completions.create(model=MODEL, prompt="Plan a trip.", seed=61, max_tokens=100,
                                                 extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(completion.choices[0].text), dict)  # (vLLM's extension of the legacy API)
    for vllm_s in ({"guided_json": Trip.model_json_schema()}, {"structured_outputs": {"json": Trip.model_json_schema()}}):
        guided = await client.chat.completions.create(model=MODEL, messages=messages, seed=61, extra_body=vllm_s)
        assert guided.choices[0].message.content == expected.text


async def test_a_guided_choice_or_regex_answers_with_what_it_allows(client):
    """vLLM's ``guided_choice`` and ``guided_regex`` (and the same through its ``structured_outputs``):
    the answer is one of the choices, or matches the regular expression whole, streamed or not; each
    is what the stack's engine answers the request with the regular expression on the bus."""
    messages = [{"role": "user", "content": "How shall we travel?"}]
    choices = ["rail", "road", "sea (slow)"]
    choice_pattern = "(rail|road|sea\\ \\(slow\\))"
    for asked in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        chosen = await client.chat.completions.create(model=MODEL, messages=messages, seed=63, extra_body=asked)
        want = await expected_output(messages, seed=63, response_format="regex", guided_regex=choice_pattern)
        assert chosen.choices[0].message.content == want.text and want.text in choices
    pattern = r"[A-Z][a-z]{2,6}-\d{2}"
    stream = await client.chat.completions.create(model=MODEL, messages=messages, seed=64, stream=True,
                                                  extra_body={"guided_regex": pattern})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert re.fullmatch(pattern, text)
    assert text == (await expected_output(messages, seed=64, response_format="regex", guided_regex=pattern)).text
    completion = await client.completions.create(model=MODEL, prompt="Travel by", seed=65, max_tokens=50,
                                                 extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, completion.choices[0].text) and completion.choices[0].finish_reason == "stop"


async def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client, stack):
    """A second prompt sharing a long system message is partly served from the engine's prefix
    cache: the client sees it as OpenAI shows it, in ``usage.prompt_tokens_details.cached_tokens``,
    streaming and not; the first prompt had nothing cached. The GPU consumer counts the cached
    tokens and the edge its placement decisions in their metrics."""
    system = {"role": "system", "content": "Follow the long shared house rules of the usage test. " * 20}

    def turn(question: str) -> list[dict[str, str]]:
        return [system, {"role": "user", "content": question}]

    first = await client.chat.completions.create(model=MODEL, messages=turn("first question"))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    plain = await client.chat.completions.create(model=MODEL, messages=turn("second question"))
    stream = await client.chat.completions.create(model=MODEL, messages=turn("third question"), stream=True,
                                                  stream_options={"include_usage": True})
    usage = [chunk async for chunk in stream][-1].usage
    for result in (plain.usage, usage):
        assert 150 <= result.prompt_tokens_details.cached_tokens < result.prompt_tokens

    async with httpx.AsyncClient(timeout=10) as http:
        worker = (await http.get(f"http://127.0.0.1:{stack.settings.worker_port}/metrics")).text
        edge = (await http.get(f"{stack.edge_url}/metrics")).text
    cached = [line for line in worker.splitlines() if line.startswith("tokenbus:prompt_tokens_cached_total")]
    assert cached and float(cached[0].split()[-1]) >= 300
    followed = [line for line in edge.splitlines()
                if line.startswith(('tokenbus:prefix_routing_decisions_total{route="prefix"}',
                                    'tokenbus:prefix_routing_decisions_total{route="expected"}'))]
    assert followed and sum(float(line.split()[-1]) for line in followed) >= 2  # the second and third
