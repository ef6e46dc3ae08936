"""Reading function calls out of generated text (engines/tool_calls.py), and telling a model about
its tools through its chat template (engines/chat_template.py)."""

import json

import pytest
from transformers import AutoTokenizer

from tokenbus.gpu_consumers.engines import GenerationInput
from tokenbus.gpu_consumers.engines.chat_template import prompt_ids
from tokenbus.gpu_consumers.engines.tool_calls import ARGUMENT_PIECE_CHARS, HermesToolParser, call_id, render_call
from tokenbus.schemas import ChatMessage, ToolCall, ToolSpec, whole_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'


def parse(pieces, offered=("get_weather", "get_time"), parallel=True, first_index=0):
    parser = HermesToolParser("req-1", set(offered), first_index, parallel)
    results = [parser.feed(p) for p in pieces] + [parser.flush()]
    content = "".join(r.content for r in results)
    raw = "".join(r.raw for r in results)
    calls = whole_tool_calls(d for r in results for d in r.calls)
    return content, calls, raw, results


def split_every(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_call_split_anywhere_is_read_whole(size):
    text = "Let me look. " + WEATHER + " Done."
    content, calls, raw, _ = parse(split_every(text, size))
    assert content == "Let me look. Done."  # whitespace next to a call is markup
    assert calls == [ToolCall(call_id("req-1", 0), "get_weather", '{"city":"Oslo","unit":"celsius"}')]
    assert raw == text  # every character is accounted for, in order


def test_a_call_streams_as_a_header_then_argument_pieces():
    arguments = {"query": "x" * 40}
    _, _, _, results = parse([render_call("get_time", arguments)], offered=("get_time",))
    deltas = [d for r in results for d in r.calls]
    assert (deltas[0].index, deltas[0].id, deltas[0].name, deltas[0].arguments) == (0, call_id("req-1", 0), "get_time", "")
    pieces = [d.arguments for d in deltas[1:]]
    assert all(d.id is None and d.name is None for d in deltas[1:])
    assert len(pieces) > 1 and all(len(p) <= ARGUMENT_PIECE_CHARS for p in pieces)
    assert json.loads("".join(pieces)) == arguments


def test_parallel_calls_are_numbered_and_raw_text_says_what_was_consumed():
    text = WEATHER + "\n" + render_call("get_time", {"tz": "UTC"})
    content, calls, raw, results = parse([text])
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [c.id for c in calls] == [call_id("req-1", 0), call_id("req-1", 1)]
    assert content == "" and raw == text  # the newline between the calls is markup
    assert results[0].raw_text == text  # differs from the content, so a TokenEvent carries it


def test_without_parallel_calls_only_the_first_is_delivered():
    content, calls, raw, _ = parse([WEATHER + render_call("get_time", {})], parallel=False)
    assert [c.name for c in calls] == ["get_weather"] and content == ""


def test_a_takeover_numbers_its_calls_after_those_already_delivered():
    _, calls, _, _ = parse([WEATHER], first_index=2)
    assert calls[0].id == call_id("req-1", 2)


@pytest.mark.parametrize("body", [
    '{"name": "get_weather", "arguments": {"city": ',  # broken JSON
    '{"name": "rm_rf", "arguments": {}}',  # a function that was not offered
    '{"name": "get_weather", "arguments": [1, 2]}',  # arguments that are not an object
    '"just a string"',
])
def test_markup_that_is_not_a_valid_call_is_delivered_as_text(body):
    text = f"Sure. <tool_call>{body}</tool_call>"
    content, calls, _, _ = parse(split_every(text, 5))
    assert calls == [] and content == text


def test_a_call_cut_off_by_the_end_of_the_sequence_is_text():
    text = 'Hmm <tool_call>{"name": "get_weather", "argu'
    content, calls, raw, results = parse(split_every(text, 4))
    assert calls == [] and content == text and raw == text
    assert results[-1].content == " " + text[4:]  # held back until the end


def test_text_that_only_looks_like_the_start_of_a_tag_is_released():
    content, calls, _, results = parse(["a <tool", "s are fine"])
    assert content == "a <tools are fine" and calls == []
    assert results[0].content == "a"  # "<tool" was held back (it could have opened a call), and the space before it


def test_arguments_written_as_json_text_are_accepted():
    body = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Rome"})})
    _, calls, _, _ = parse([f"<tool_call>{body}</tool_call>"])
    assert calls[0].arguments == '{"city":"Rome"}'


# -- the prompt --------------------------------------------------------------------------

@pytest.fixture
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def tool_turn(**overrides) -> GenerationInput:
    fields = dict(
        request_id="r",
        messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Oslo?"),
                  ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city":"Oslo"}'),)),
                  ChatMessage("tool", "3 C and rain", tool_call_id="call_1")),
        tools=(ToolSpec("get_weather", "The weather now", '{"type":"object","properties":{"city":{"type":"string"}}}'),),
    )
    return GenerationInput(**{**fields, **overrides})


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer):
    assert "tools" not in tokenizer.chat_template
    prompt = tokenizer.decode(prompt_ids(tokenizer, tool_turn(tool_choice="function", tool_choice_name="get_weather")))
    assert prompt.count("Be brief.") == 1 and "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "You must call the function get_weather" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\n3 C and rain\n</tool_response>" in prompt
    plain = tokenizer.decode(prompt_ids(tokenizer, tool_turn(tool_choice="none")))
    assert "<tools>" not in plain  # tools not offered this turn are not shown


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    knowing = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    knowing.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
        "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
    )
    prompt = knowing.decode(prompt_ids(knowing, tool_turn()))
    assert "TOOL get_weather" in prompt and "<tools>" not in prompt
    assert "CALL get_weather" in prompt and "FOR call_1" in prompt
