"""What a ChatRequest may ask for (schemas/request_checks.py): each field out of range is named,
the ends of each range are served, and NaN is in no range."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tokenbus.schemas import ChatMessage, ChatRequest, RequestOutOfRange, ToolSpec, check_request, request_problem

REQUEST = ChatRequest("r-1", "m", "standard", [ChatMessage("user", "hi")], "tokens", 0)


def asking(**fields) -> ChatRequest:
    return dataclasses.replace(REQUEST, **fields)


@pytest.mark.parametrize("fields", [
    {}, {"temperature": 0.0}, {"temperature": 2.0}, {"top_p": 1.0}, {"top_p": 1e-9}, {"max_tokens": 1},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0}, {"request_id": "r" * 256},
    {"messages": [ChatMessage(role, "x") for role in ("system", "developer", "user", "assistant", "tool")]},
    {"tools": [ToolSpec("get_weather")], "tool_choice": "function", "tool_choice_name": "get_weather"},
    {"tool_choice": "required"}, {"prefix_token_ids": [0, 5]}, {"logprobs": True},
    {"logprobs": True, "top_logprobs": 20}, {"logit_bias": {"0": -100.0, "4294967295": 100.0}},
    {"logit_bias": {str(i): 1.0 for i in range(300)}},
    {"top_k": 1, "min_p": 1.0, "min_tokens": 8, "max_tokens": 8, "stop_token_ids": [0, *range(1, 256)]},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 5.0}, {"response_format": "json_object"},
    {"allowed_token_ids": list(range(4096))},
    {"bad_words": ["x" * 256] * 128},
    {"response_format": "json_schema", "json_schema": '{"type": "object"}'},
    {"echo": True, "text_prompt": True}, {"echo": True, "text_prompt": True, "logprobs": True, "top_logprobs": 5},
    {"echo": True}, {"add_generation_prompt": False}, {"continue_final_message": True, "add_generation_prompt": False},
    {"text_prompt": True, "prompt_token_ids": [0, 2**31 - 1]},
    {"response_format": "regex", "guided_regex": "(yes|no)"}, {"truncate_prompt_tokens": 1},
], ids=str)
def test_a_request_within_range_has_no_problem(fields):
    assert request_problem(asking(**fields)) is None
    check_request(asking(**fields))


@pytest.mark.parametrize(("fields", "problem"), [
    ({"request_id": ""}, "request_id must be 1 to 256 characters"),
    ({"request_id": "r" * 257}, "request_id must be 1 to 256 characters"),
    ({"messages": []}, "messages must not be empty"),
    ({"messages": [ChatMessage("user", "a"), ChatMessage("robot", "b")]},
     "messages[1].role 'robot' is not one of system, developer, user, assistant, tool"),
    ({"max_tokens": 0}, "max_tokens 0 is below 1"),
    ({"temperature": -0.5}, "temperature -0.5 is not in [0, 2]"),
    ({"temperature": 2.5}, "temperature 2.5 is not in [0, 2]"),
    ({"temperature": math.nan}, "temperature nan is not in [0, 2]"),
    ({"top_p": 0.0}, "top_p 0.0 is not in (0, 1]"),
    ({"top_p": math.inf}, "top_p inf is not in (0, 1]"),
    ({"presence_penalty": -2.5}, "presence_penalty -2.5 is not in [-2, 2]"),
    ({"frequency_penalty": math.nan}, "frequency_penalty nan is not in [-2, 2]"),
    ({"tool_choice": "sometimes"}, "tool_choice 'sometimes' is not one of none, auto, required, function"),
    ({"tools": [ToolSpec("a")], "tool_choice": "function", "tool_choice_name": "b"},
     "tool_choice_name 'b' names none of the request's tools"),
    ({"prefix_token_ids": [3, -1]}, "prefix_token_ids must not be negative"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs 21 is not in [0, 20]"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs -1 is not in [0, 20]"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"logit_bias": {"7": 100.5}}, "logit_bias of token 7 is 100.5, not in [-100, 100]"),
    ({"logit_bias": {"7": math.nan}}, "logit_bias of token 7 is nan, not in [-100, 100]"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias key '-1' is not a token id (a non-negative integer)"),
    ({"logit_bias": {"07": 1.0}}, "logit_bias key '07' is not a token id (a non-negative integer)"),
    ({"logit_bias": {"\u0663": 1.0}}, "logit_bias key '\u0663' is not a token id (a non-negative integer)"),
    ({"logit_bias": {"hello": 1.0}}, "logit_bias key 'hello' is not a token id (a non-negative integer)"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias names 301 tokens; at most 300 may be biased"),
    ({"top_k": -1}, "top_k -1 is below 0"),
    ({"min_p": 1.5}, "min_p 1.5 is not in [0, 1]"),
    ({"min_p": math.nan}, "min_p nan is not in [0, 1]"),
    ({"min_tokens": -2}, "min_tokens -2 is below 0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty 0.0 is not a finite number above 0"),
    ({"response_format": "yaml"}, "response_format 'yaml' is not one of text, json_object, json_schema, regex"),
    ({"response_format": "json_schema"}, "json_schema must be a JSON Schema object, as JSON text"),
    ({"response_format": "json_schema", "json_schema": "[1]"}, "json_schema must be a JSON Schema object, as JSON text"),
    ({"response_format": "json_object", "json_schema": "{}"}, "json_schema is for response_format json_schema alone"),
    ({"repetition_penalty": math.inf}, "repetition_penalty inf is not a finite number above 0"),
    ({"repetition_penalty": math.nan}, "repetition_penalty nan is not a finite number above 0"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens 9 is more than max_tokens 8"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids names 257 tokens; at most 256 may"),
    ({"stop_token_ids": [4, -4]}, "stop_token_ids must not be negative"),
    ({"allowed_token_ids": list(range(4097))}, "allowed_token_ids names 4097 tokens; at most 4096 may"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids must not be negative"),
    ({"bad_words": ["no"] * 129}, "bad_words names 129 words; at most 128 may"),
    ({"bad_words": ["  "]}, "each of bad_words must be 1 to 256 characters, not all spaces"),
    ({"echo": True, "text_prompt": True, "messages": [ChatMessage("user", "a"), ChatMessage("user", "b")]},
     "a text completion's echo needs its one message"),
    ({"continue_final_message": True}, "continue_final_message is for a chat without add_generation_prompt"),
    ({"prompt_token_ids": [1, 2]}, "prompt_token_ids are a text completion's prompt (text_prompt, one message)"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens 0 is below 1"),
    ({"response_format": "regex"}, "guided_regex is for response_format regex, which needs one"),
    ({"guided_regex": "a+"}, "guided_regex is for response_format regex, which needs one"),
    ({"response_format": "regex", "guided_regex": "(a"},
     "guided_regex is not a regular expression: missing ), unterminated subpattern at position 0"),
    ({"text_prompt": True, "prompt_token_ids": [1, -2]}, "prompt_token_ids must not be negative"),
    ({"continue_final_message": True, "add_generation_prompt": False, "text_prompt": True},
     "continue_final_message is for a chat without add_generation_prompt"),
], ids=str)
def test_a_field_out_of_range_is_named(fields, problem):
    assert request_problem(asking(**fields)) == problem
    with pytest.raises(RequestOutOfRange) as raised:
        check_request(asking(**fields))
    assert str(raised.value) == problem
