"""A request's prompt token ids (gpu_consumers/engines/chat_template.py), against a real byte-level
BPE tokenizer: ``PromptTokens`` templates and tokenizes a request once when its engine and its
engine's prefix cache both ask (back to back, as the worker does), and again for anything else."""

from __future__ import annotations

import dataclasses

import pytest

from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams
from tokenbus.gpu_consumers.engines.chat_template import PromptTokens, Rendered, SegmentEnds, prompt_ids
from tokenbus.schemas import ChatMessage, ToolCall, ToolSpec


class CountingTokenizer:
    """The real tokenizer, counting the prompts it renders."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.rendered = 0

    def apply_chat_template(self, *args, **kwargs):
        self.rendered += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def request(request_id: str = "r-1", content: str = "hello there") -> GenerationInput:
    return GenerationInput(request_id, (ChatMessage("system", "be brief"), ChatMessage("user", content)),
                           SamplingParams())


def test_a_request_asked_for_twice_is_rendered_once_and_gives_the_same_ids(tokenizer):
    counting = CountingTokenizer(tokenizer)
    tokens = PromptTokens(counting)
    first = tokens(request())
    assert first == prompt_ids(tokenizer, request()) != []
    # The prefix cache's layout is asked with an input made from the same request, a takeover's
    # output ids aside (they follow the prompt, not in it).
    again = tokens(dataclasses.replace(request(), prefix_token_ids=(5, 6), prefix_text="ab"))
    assert again is first and counting.rendered == 1


def test_anything_the_prompt_is_rendered_from_renders_it_again(tokenizer):
    counting = CountingTokenizer(tokenizer)
    tokens = PromptTokens(counting)
    base = tokens(request())
    other_request = tokens(request("r-2"))
    other_words = tokens(request("r-2", "goodbye now"))
    offered = tokens(dataclasses.replace(request("r-2", "goodbye now"),
                                         tools=(ToolSpec("get_weather", "Weather now", '{"type":"object"}'),)))
    assert counting.rendered == 4
    assert other_request == base and other_words != base and offered != other_words


def conversation(turns: int, tools: bool = False) -> GenerationInput:
    messages = [ChatMessage("system", "answer as the bus would")]
    for i in range(turns):
        messages += [ChatMessage("user", f"question {i}: héllo 東京 🚀"), ChatMessage("assistant", f"answer {i} ✓")]
    offered = (ToolSpec("get_weather", "Weather now", '{"type":"object"}'),) if tools else ()
    return GenerationInput("conv", (*messages, ChatMessage("user", "and now?")), SamplingParams(), tools=offered)


@pytest.mark.parametrize("tools", [False, True])
def test_segment_ends_from_the_tokens_places_in_the_text_agree_with_tokenizing_each_prefix(tokenizer, tools):
    """With a fast tokenizer a segment's end is read off where the prompt's tokens end in its text
    (one tokenization per request), not found by tokenizing the segment's prefix again."""
    inp = conversation(3, tools)
    tokens = PromptTokens(tokenizer)
    ids, rendered = tokens(inp), tokens.rendered(inp)
    assert rendered is not None and ids == prompt_ids(tokenizer, inp)
    from_text = SegmentEnds(tokenizer)(inp, ids, rendered)
    by_tokenizing = SegmentEnds(tokenizer)(inp, ids)
    assert from_text == by_tokenizing
    assert len(from_text) == len(inp.messages) + tools and list(from_text) == sorted(from_text)
    # Where the template writes the first messages otherwise than as the start of the prompt, each
    # prefix is tokenized after all.
    assert SegmentEnds(tokenizer)(inp, ids, Rendered("another text", rendered.token_ends)) == by_tokenizing


def test_a_final_message_left_open_ends_the_prompt_and_its_segment(tokenizer):
    """vLLM's ``continue_final_message``: the prompt ends with the final message's words (no end of
    turn, no start of a reply), so that the model continues them; the messages before it end where
    they end closed; without ``add_generation_prompt`` the prompt ends with the last turn closed."""
    closed = dataclasses.replace(conversation(1), messages=(*conversation(1).messages[:-1],
                                                            ChatMessage("assistant", "The bus is")))
    left_open = dataclasses.replace(closed, add_generation_prompt=False, continue_final_message=True)
    no_reply = dataclasses.replace(closed, add_generation_prompt=False)
    tokens = PromptTokens(tokenizer)
    ids, rendered = tokens(left_open), tokens.rendered(left_open)
    assert ids == prompt_ids(tokenizer, left_open) and rendered is not None
    assert rendered.text.endswith("The bus is") and tokenizer.decode(ids).endswith("The bus is")
    closed_ends, open_ends = SegmentEnds(tokenizer)(closed, tokens(closed)), SegmentEnds(tokenizer)(left_open, ids, rendered)
    assert open_ends[:-1] == closed_ends[:-1] and open_ends[-1] == len(ids) < closed_ends[-1]
    assert tokens(no_reply) == tokens(closed)[:closed_ends[-1]] != tokens(closed)  # no reply begun after it


def test_a_tokenizer_without_a_rust_tokenizer_gives_no_places_and_the_same_ids(tokenizer):
    class DecodeAndTemplateOnly:
        chat_template = tokenizer.chat_template
        apply_chat_template = tokenizer.apply_chat_template

    tokens = PromptTokens(DecodeAndTemplateOnly())
    inp = conversation(1)
    assert tokens(inp) == prompt_ids(tokenizer, inp) and tokens.rendered(inp) is None


def test_a_prompt_prepared_ahead_is_not_made_again_when_asked_for(tokenizer):
    """``prepare`` (run in a thread by the engines) makes the prompt; the asks that follow take it."""
    counting = CountingTokenizer(tokenizer)
    tokens = PromptTokens(counting)
    tokens.prepare(request("r-1"))
    tokens.prepare(request("r-2", "another"))
    assert counting.rendered == 2
    assert tokens(request("r-2", "another")) == prompt_ids(tokenizer, request("r-2", "another"))
    assert tokens(request("r-1")) == prompt_ids(tokenizer, request("r-1"))
    assert counting.rendered == 2


def test_a_prompt_that_cannot_be_made_ahead_fails_when_asked_for(tokenizer):
    class Failing(CountingTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("the template cannot render this")

    tokens = PromptTokens(Failing(tokenizer))
    tokens.prepare(request())  # never raises: the engine's generate reports it
    with pytest.raises(ValueError):
        tokens(request())


def test_prepared_prompts_of_a_fast_tokenizer_are_its_ids_and_places(tokenizer):
    inp = conversation(2, tools=True)
    tokens = PromptTokens(tokenizer)
    tokens.prepare(inp)
    rendered = tokens.rendered(inp)
    assert tokens(inp) == prompt_ids(tokenizer, inp) and rendered is not None
    assert SegmentEnds(tokenizer)(inp, tokens(inp), rendered) == SegmentEnds(tokenizer)(inp, tokens(inp))


def test_a_conversation_that_cannot_be_a_key_is_made_when_asked_for(tokenizer):
    """A list where the schema has a tuple (an SDK user's message built by hand) cannot be hashed:
    nothing is prepared, and asking still gives the prompt."""
    calls = [ToolCall("c1", "get_weather", '{"city": "Oslo"}')]
    inp = GenerationInput("r-list", (ChatMessage("user", "weather?"), ChatMessage("assistant", "", calls)),  # type: ignore[arg-type]
                          SamplingParams())
    tokens = PromptTokens(tokenizer)
    tokens.prepare(inp)
    assert tokens(inp) == prompt_ids(tokenizer, inp)
