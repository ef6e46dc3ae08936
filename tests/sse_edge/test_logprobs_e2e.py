"""Log probabilities (OpenAI's ``logprobs``) through the real embedded stack with the official
openai package: the simulated engine scores each token it draws (tests/expected.py computes the
same in process), the GPU consumer carries the scores on its token events, and the edge renders
them in the chat shape (``logprobs.content``) and the legacy text-completion shape, streamed and
whole, the same either way."""

import math

import openai
import pytest

from tests.conftest import MODEL
from tests.expected import expected_output
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY

MESSAGES = [{"role": "user", "content": "Score every word you say."}]
UNIFORM = -math.log(len(VOCABULARY))  # the simulated engine's words are equally likely, unpenalized


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def as_sent(logprob: float) -> float:
    """A log probability as the bus carries it (an Avro float: single precision)."""
    return pytest.approx(logprob, rel=1e-6)


async def test_a_chat_completion_scores_each_content_token_streamed_and_whole(client):
    want = await expected_output(MESSAGES, seed=41, max_tokens=12, logprobs=2)
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=41, max_tokens=12,
                                                 logprobs=True, top_logprobs=2)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=41, max_tokens=12,
                                                  logprobs=True, top_logprobs=2, stream=True)
    chunks = [chunk async for chunk in stream]
    content = whole.choices[0].logprobs.content
    assert [t.token for t in content] == [t.token for t in want.logprobs]
    assert "".join(t.token for t in content) == whole.choices[0].message.content == want.text
    for got, expected in zip(content, want.logprobs, strict=True):
        assert got.logprob == as_sent(expected.logprob) == as_sent(UNIFORM)
        assert got.bytes == list(got.token.encode())
        assert [(a.token, a.logprob) for a in got.top_logprobs] == [(a.token, as_sent(a.logprob)) for a in expected.top]
        assert all(a.bytes == list(a.token.encode()) for a in got.top_logprobs)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    assert chunks[0].choices[0].logprobs is None  # the role chunk scores nothing


async def test_not_asked_there_are_none(client):
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=42, max_tokens=6)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=42, max_tokens=6, stream=True)
    assert whole.choices[0].logprobs is None
    chunks = [c async for c in stream if c.choices]
    assert chunks and all(c.choices[0].logprobs is None for c in chunks)


async def test_logprobs_without_top_logprobs_score_the_tokens_alone(client):
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=43, max_tokens=5, logprobs=True)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(t.top_logprobs == [] for t in content)


async def test_tokens_a_stop_sequence_holds_back_are_scored_all_the_same(client):
    """A stop sequence holds back as many characters as it has, less one, while they may be its
    start: the first words' events under a long one carry no text, and their scores still reach
    the stream, so streamed and whole agree on every token."""
    full = await expected_output(MESSAGES, seed=44, max_tokens=30, logprobs=0)
    stop = "@" * 32  # never there: only held back
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=44, max_tokens=30,
                                                 logprobs=True, stop=[stop])
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=44, max_tokens=30,
                                                  logprobs=True, stop=[stop], stream=True)
    chunks = [c async for c in stream if c.choices]
    streamed = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert any(c.choices[0].logprobs and not c.choices[0].delta.content for c in chunks)  # a held word, scored
    assert whole.choices[0].message.content == full.text
    assert streamed == [t.token for t in whole.choices[0].logprobs.content] == [t.token for t in full.logprobs]


async def test_a_text_completion_scores_tokens_in_the_legacy_shape(client):
    prompt = "Once the bus scored"
    want = await expected_output([{"role": "user", "content": prompt}], seed=45, max_tokens=8, text_prompt=True,
                                 logprobs=2)
    whole = await client.completions.create(model=MODEL, prompt=prompt, seed=45, max_tokens=8, logprobs=2)
    stream = await client.completions.create(model=MODEL, prompt=prompt, seed=45, max_tokens=8, logprobs=2, stream=True)
    chunks = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs]
    scored = whole.choices[0].logprobs
    assert scored.tokens == [t.token for t in want.logprobs] and "".join(scored.tokens) == whole.choices[0].text
    assert scored.token_logprobs == [as_sent(t.logprob) for t in want.logprobs]
    assert scored.top_logprobs == [{t.token: as_sent(t.logprob)} | {a.token: as_sent(a.logprob) for a in t.top}
                                   for t in want.logprobs]
    assert scored.text_offset == [len("".join(scored.tokens[:i])) for i in range(len(scored.tokens))]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):  # streamed: the same, run on
        assert [v for c in chunks for v in getattr(c, field)] == getattr(scored, field)


async def test_an_echo_scores_the_prompt_before_the_completion_as_evaluation_harnesses_read_it(client):
    """``echo`` with ``logprobs`` (what lm-evaluation-harness sends to score a text): the text is the
    prompt and then the completion, and the legacy lists score the prompt's tokens first (the
    simulated tokenizer's: a word each, with the space before it), the very first with null, then
    the completion's as without echo; streamed, the first chunk carries the prompt with them."""
    prompt = "Once  the bus zebra carries"
    plain = await client.completions.create(model=MODEL, prompt=prompt, seed=46, max_tokens=4, logprobs=1)
    whole = await client.completions.create(model=MODEL, prompt=prompt, seed=46, max_tokens=4, logprobs=1, echo=True)
    stream = await client.completions.create(model=MODEL, prompt=prompt, seed=46, max_tokens=4, logprobs=1, echo=True,
                                             stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    scored, generated = whole.choices[0].logprobs, plain.choices[0].logprobs
    assert whole.choices[0].text == prompt + plain.choices[0].text
    words = ["Once", "  the", " bus", " zebra", " carries"]
    assert scored.tokens == words + generated.tokens
    assert scored.token_logprobs == [None, as_sent(UNIFORM), as_sent(UNIFORM), -9999.0, as_sent(UNIFORM),
                                     *generated.token_logprobs]  # "zebra" is no word the simulated model says
    assert scored.top_logprobs[0] is None and scored.top_logprobs[1] == {"  the": as_sent(UNIFORM),
                                                                         " the": as_sent(UNIFORM)}
    assert scored.top_logprobs[len(words):] == generated.top_logprobs
    assert scored.text_offset == [len("".join(scored.tokens[:i])) for i in range(len(scored.tokens))]
    assert whole.usage == plain.usage  # the prompt is not generated again
    assert chunks[0].text.startswith(prompt) and "".join(c.text for c in chunks) == whole.choices[0].text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c.logprobs for v in getattr(c.logprobs, field)] == getattr(scored, field)


async def test_an_echo_without_logprobs_gives_the_prompt_back_unscored(client):
    prompt = "Echo the bus"
    plain = await client.completions.create(model=MODEL, prompt=prompt, seed=47, max_tokens=5)
    whole = await client.completions.create(model=MODEL, prompt=prompt, seed=47, max_tokens=5, echo=True)
    stream = await client.completions.create(model=MODEL, prompt=prompt, seed=47, max_tokens=5, echo=True, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert whole.choices[0].text == prompt + plain.choices[0].text and whole.choices[0].logprobs is None
    assert "".join(c.text for c in chunks) == whole.choices[0].text and all(c.logprobs is None for c in chunks)


async def test_an_echo_asking_more_scores_than_a_token_event_carries_is_a_bad_request(client):
    """1,600 prompt tokens with 20 likeliest each: more than ``PROMPT_SCORES_MAX`` scores; the engine
    refuses it, and the client is told why, as of any request an engine cannot serve as asked."""
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=MODEL, prompt="the bus " * 800, max_tokens=2, logprobs=20, echo=True)
    assert exc.value.code == "invalid_request" and "more than 32768 scores" in exc.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
async def test_logprobs_out_of_range_are_a_bad_request(client, body, param):
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)
    assert raised.value.body["param"] == param
