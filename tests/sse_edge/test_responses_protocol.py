"""The Responses API's shapes, without a stack: how a request reads as a chat completion's, what an
error about it names, and the events of a streamed response (ids, order, sequence numbers), as the
openai client reads them."""

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tokenbus.schemas import TokenEvent
from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.sse_edge.plumbing.relay import REFUSED_AS_ASKED
from tokenbus.sse_edge.plumbing.response_relay import Ending
from tokenbus.sse_edge.protocol.response_objects import ResponseEvents, response_object, usage_of
from tokenbus.sse_edge.protocol.responses import ResponsesRequest, chat_body, in_responses_terms, parse_input_items
from tokenbus.sse_edge.protocol.validation import parse_responses_request
from tokenbus.sse_edge.settings import EdgeSettings

EVENTS = TypeAdapter(ResponseStreamEvent)


def chat_of(body: dict) -> tuple[dict, list[str]]:
    asked = ResponsesRequest.model_validate({"model": "m", **body})
    return chat_body(asked, parse_input_items(asked.input))


def test_input_items_read_as_chat_messages_with_calls_joined_to_the_assistant_turn():
    chat, sources = chat_of({"instructions": "Be kind.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                               "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ], "max_output_tokens": 9, "text": {"format": {"type": "json_object"}},
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "w"}})
    assert chat["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather ?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    assert sources == ["instructions", "input[0]", "input[1]", "input[4]"]
    assert chat["max_completion_tokens"] == 9 and chat["response_format"] == {"type": "json_object"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert "logprobs" not in chat and "temperature" not in chat


def test_a_chat_checks_error_names_the_responses_parameter():
    error = in_responses_terms(InvalidRequest("Bad 'messages[2].tool_calls[0].function.arguments'.",
                                              param="messages[2].tool_calls[0].function.arguments"),
                               ["instructions", "input[0]", "input[3]"])
    assert error.param == "input[3].tool_calls[0].function.arguments" and "'input[3]." in error.message
    assert in_responses_terms(InvalidRequest("x", param="tools[1].function.parameters"), []).param == \
        "tools[1].parameters"
    assert in_responses_terms(InvalidRequest("x", param="response_format.json_schema.schema"), []).param == \
        "text.format.schema"
    with pytest.raises(InvalidRequest) as refused:
        parse_responses_request(json.dumps({"model": "m", "input": [{"role": "user", "content": "hi"}],
                                            "tool_choice": "required"}).encode(), EdgeSettings())
    assert refused.value.param == "tool_choice"


def test_a_streamed_response_is_events_the_openai_client_reads_in_order():
    start = response_object("resp_1", 5, "m", ResponsesRequest(model="m", input="x").echoed())
    events = ResponseEvents(start, logprobs=False)
    written = events.started() + events.text("Hel") + events.text("lo") + events.call(0, "call_a", "f", '{"a"')
    written += events.call(0, None, None, ": 1}") + events.call(1, "call_b", "g", "{}")
    end, response = events.ended("incomplete", usage_of(7, 5, 2), incomplete_reason="max_output_tokens")
    parsed = [EVENTS.validate_python(json.loads(block.split("\ndata: ")[1]))
              for block in (written + end).decode().split("\n\n") if block]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.incomplete"]
    assert [e.output_index for e in parsed if e.type == "response.output_item.added"] == [0, 1, 2]
    assert parsed[2].item.status == "in_progress" and parsed[2].item.content == []
    done = Response.model_validate(response)
    assert done.output_text == "Hello" and done.incomplete_details.reason == "max_output_tokens"
    assert [(c.call_id, c.name, c.arguments, c.status) for c in done.output[1:]] == [
        ("call_a", "f", '{"a": 1}', "incomplete"), ("call_b", "g", "{}", "incomplete")]
    assert done.usage.input_tokens_details.cached_tokens == 2 and done.usage.total_tokens == 12

    again = ResponseEvents({**start}, logprobs=False).replayed(response)
    replayed = [json.loads(block.split("\ndata: ")[1]) for block in again.decode().split("\n\n") if block]
    assert replayed[-1]["response"] == response
    assert [e["item"]["id"] for e in replayed if e["type"] == "response.output_item.done"] == [
        item["id"] for item in response["output"]]


@pytest.mark.parametrize(("finish_reason", "error", "status", "code"), [
    ("error", "engine out of memory", "failed", "server_error"),
    ("error", f"{REFUSED_AS_ASKED}its grammar cannot be compiled", "failed", "invalid_prompt"),
    ("cancelled", None, "cancelled", None),
])
def test_a_response_that_failed_names_it_as_strict_openai_clients_read_it(finish_reason, error, status, code):
    """A failure's own code (``generation_failed``, ...) is the HTTP error's; the response's
    ``error`` takes one of OpenAI's codes, which typed clients check, and a cancelled response has
    none (its status says it), as OpenAI's."""
    ending = Ending.of(TokenEvent("resp_1", 3, finish_reason=finish_reason, error=error, prompt_tokens=4,
                                  completion_tokens=2))
    assert ending.status == status and ending.failure is not None
    start = response_object("resp_1", 5, "m", ResponsesRequest(model="m", input="x").echoed())
    _, response = ResponseEvents(start, logprobs=False).ended(ending.status, ending.usage, ending.error)
    strict = Response.model_validate(response)  # (openai's models, validated: every code checked)
    assert strict.status == status and (strict.error.code if strict.error else None) == code
    if code is not None:
        assert error.removeprefix(REFUSED_AS_ASKED) in strict.error.message


@pytest.mark.parametrize(("item", "param", "message"), [
    ({"type": "function_call_output", "output": "rain"}, "input[1].call_id",
     "Missing required parameter: 'input[1].call_id'."),
    ({"type": "message", "content": "x"}, "input[1].role", "Missing required parameter: 'input[1].role'."),
    ({"role": "user", "content": 7}, "input[1].content", "Invalid value for 'input[1].content'"),
])
def test_an_input_items_error_names_it_by_its_place_in_the_request(item, param, message):
    with pytest.raises(InvalidRequest) as refused:
        parse_input_items([{"role": "user", "content": "hi"}, item])
    assert refused.value.param == param and refused.value.message.startswith(message)
