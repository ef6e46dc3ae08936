"""What a ``ChatRequest`` may ask for: the ranges of OpenAI's API, in one place.

The edge refuses a client's request outside them with a 400 (its protocol models take these
bounds); internal services publish to the request topics directly, so a GPU consumer checks every
request it fetches too and dead-letters one that asks for what no engine can do as asked (a
negative temperature, a NaN penalty, no messages): served, it would come back as a wrong answer
or stop the engine for every other request in its batch. ``TokenbusClient.publish`` checks before
it sends, so a caller of the SDK learns at once.
"""

from __future__ import annotations

import json
import math
import re

from tokenbus.schemas.records import (
    RESPONSE_JSON_OBJECT,
    RESPONSE_JSON_SCHEMA,
    RESPONSE_REGEX,
    RESPONSE_TEXT,
    TOOL_CHOICE_AUTO,
    TOOL_CHOICE_FUNCTION,
    TOOL_CHOICE_NONE,
    TOOL_CHOICE_REQUIRED,
    ChatRequest,
)

TEMPERATURE_MAX = 2.0  # temperature in [0, TEMPERATURE_MAX]
PENALTY_MAX = 2.0  # presence_penalty and frequency_penalty in [-PENALTY_MAX, PENALTY_MAX]
# top_p in (0, 1]; max_tokens at least 1.
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = (TOOL_CHOICE_NONE, TOOL_CHOICE_AUTO, TOOL_CHOICE_REQUIRED, TOOL_CHOICE_FUNCTION)
REQUEST_ID_MAX_CHARS = 256
# The reason a request out of range is refused with on the bus (a dead letter's reason, and the
# start of its answer's ``error``: "invalid_request: why"), which an edge turns into a 400.
INVALID_REQUEST = "invalid_request"
# The error of a request whose deadline (``deadline_ms``) passed before a GPU consumer began it.
DEADLINE_PASSED = "deadline passed while queued"
TOP_LOGPROBS_MAX = 20  # OpenAI's chat completions: top_logprobs in [0, 20], and only with logprobs
LOGIT_BIAS_MAX = 100.0  # OpenAI's: each bias in [-100, 100]
LOGIT_BIAS_MAX_TOKENS = 300  # tokens one request may bias (OpenAI's limit)
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # a token id as a logit_bias key: decimal, no sign
TOKEN_ID_MAX = 2**31 - 1  # a token id travels as an Avro int
STOP_TOKEN_IDS_MAX = 256  # stop_token_ids one request may name
ALLOWED_TOKEN_IDS_MAX = 4096  # allowed_token_ids one request may name
BAD_WORDS_MAX, BAD_WORD_CHARS_MAX = 128, 256  # vLLM's bad_words: how many one request may name, and how long
# Scores an echo with logprobs may ask of a prompt: its tokens x (the likeliest asked + 1). They go
# on one token event, which must stay well under Kafka's 1 MiB default record (about 15 bytes a
# score: 16k prompt tokens with lm-evaluation-harness's one likeliest, 1.5k with 20).
PROMPT_SCORES_MAX = 32_768
RESPONSE_FORMATS = (RESPONSE_TEXT, RESPONSE_JSON_OBJECT, RESPONSE_JSON_SCHEMA, RESPONSE_REGEX)


class RequestOutOfRange(ValueError):
    """A request no engine can serve as asked; the message says which field and why."""


def check_request(request: ChatRequest) -> None:
    """Raise ``RequestOutOfRange`` naming the first field out of range (nothing about where it is
    served: its model, tier and reply partition are the consumer's to check)."""
    problem = request_problem(request)
    if problem is not None:
        raise RequestOutOfRange(problem)


def request_problem(request: ChatRequest) -> str | None:
    """The first field of ``request`` out of range, said in a sentence; None when there is none."""
    if not request.request_id or len(request.request_id) > REQUEST_ID_MAX_CHARS:
        return f"request_id must be 1 to {REQUEST_ID_MAX_CHARS} characters"
    if not request.messages:
        return "messages must not be empty"
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            return f"messages[{index}].role {message.role!r} is not one of {', '.join(ROLES)}"
    if request.max_tokens is not None and request.max_tokens < 1:
        return f"max_tokens {request.max_tokens} is below 1"
    if request.temperature is not None and not 0 <= request.temperature <= TEMPERATURE_MAX:  # NaN is in no range
        return f"temperature {request.temperature} is not in [0, {TEMPERATURE_MAX:g}]"
    if request.top_p is not None and not 0 < request.top_p <= 1:
        return f"top_p {request.top_p} is not in (0, 1]"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if not -PENALTY_MAX <= value <= PENALTY_MAX:
            return f"{name} {value} is not in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]"
    if not 0 <= request.top_logprobs <= TOP_LOGPROBS_MAX:
        return f"top_logprobs {request.top_logprobs} is not in [0, {TOP_LOGPROBS_MAX}]"
    if request.top_logprobs and not request.logprobs:
        return "top_logprobs needs logprobs"
    if (bias_problem := logit_bias_problem(request.logit_bias)) is not None:
        return bias_problem
    if request.top_k < 0:
        return f"top_k {request.top_k} is below 0"
    if not 0 <= request.min_p <= 1:
        return f"min_p {request.min_p} is not in [0, 1]"
    if not 0 < request.repetition_penalty < math.inf:
        return f"repetition_penalty {request.repetition_penalty} is not a finite number above 0"
    if request.min_tokens < 0:
        return f"min_tokens {request.min_tokens} is below 0"
    if request.max_tokens is not None and request.min_tokens > request.max_tokens:
        return f"min_tokens {request.min_tokens} is more than max_tokens {request.max_tokens}"
    if len(request.stop_token_ids) > STOP_TOKEN_IDS_MAX:
        return f"stop_token_ids names {len(request.stop_token_ids)} tokens; at most {STOP_TOKEN_IDS_MAX} may"
    if any(token_id < 0 for token_id in request.stop_token_ids):
        return "stop_token_ids must not be negative"
    if len(request.allowed_token_ids) > ALLOWED_TOKEN_IDS_MAX:
        return f"allowed_token_ids names {len(request.allowed_token_ids)} tokens; at most {ALLOWED_TOKEN_IDS_MAX} may"
    if any(token_id < 0 for token_id in request.allowed_token_ids):
        return "allowed_token_ids must not be negative"
    if len(request.bad_words) > BAD_WORDS_MAX:
        return f"bad_words names {len(request.bad_words)} words; at most {BAD_WORDS_MAX} may"
    if any(not word.strip() or len(word) > BAD_WORD_CHARS_MAX for word in request.bad_words):
        return f"each of bad_words must be 1 to {BAD_WORD_CHARS_MAX} characters, not all spaces"
    if (format_problem := response_format_problem(request)) is not None:
        return format_problem
    if request.echo and request.text_prompt and len(request.messages) != 1:
        return "a text completion's echo needs its one message"
    if request.continue_final_message and (request.add_generation_prompt or request.text_prompt):
        return "continue_final_message is for a chat without add_generation_prompt"
    if request.prompt_token_ids and not (request.text_prompt and len(request.messages) == 1):
        return "prompt_token_ids are a text completion's prompt (text_prompt, one message)"
    if any(token_id < 0 for token_id in request.prompt_token_ids):
        return "prompt_token_ids must not be negative"
    if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens < 1:
        return f"truncate_prompt_tokens {request.truncate_prompt_tokens} is below 1"
    if request.tool_choice not in TOOL_CHOICES:
        return f"tool_choice {request.tool_choice!r} is not one of {', '.join(TOOL_CHOICES)}"
    if request.tool_choice == TOOL_CHOICE_FUNCTION and request.tool_choice_name not in {t.name for t in request.tools}:
        return f"tool_choice_name {request.tool_choice_name!r} names none of the request's tools"
    if any(token_id < 0 for token_id in request.prefix_token_ids):
        return "prefix_token_ids must not be negative"
    return None


def logit_bias_problem(logit_bias: dict[str, float]) -> str | None:
    """What is wrong with a ``logit_bias`` map, said in a sentence; None when nothing is. (Whether
    each id is in the model's vocabulary is the engine's to say: only it knows the vocabulary.)"""
    if len(logit_bias) > LOGIT_BIAS_MAX_TOKENS:
        return f"logit_bias names {len(logit_bias)} tokens; at most {LOGIT_BIAS_MAX_TOKENS} may be biased"
    for token_id, bias in logit_bias.items():
        if not TOKEN_ID_KEY.fullmatch(token_id):
            return f"logit_bias key {token_id!r} is not a token id (a non-negative integer)"
        if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:  # NaN is in no range
            return f"logit_bias of token {token_id} is {bias}, not in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]"
    return None


def response_format_problem(request: ChatRequest) -> str | None:
    """What is wrong with the response format asked; None when nothing is. (Whether ``json_schema``
    is a valid JSON Schema is the edge's to check, where a client learns it at once.)"""
    if request.response_format not in RESPONSE_FORMATS:
        return f"response_format {request.response_format!r} is not one of {', '.join(RESPONSE_FORMATS)}"
    if (request.response_format == RESPONSE_REGEX) != bool(request.guided_regex):
        return "guided_regex is for response_format regex, which needs one"
    if request.response_format == RESPONSE_REGEX:
        try:
            re.compile(request.guided_regex)
        except re.error as exc:
            return f"guided_regex is not a regular expression: {exc}"
    if request.response_format != RESPONSE_JSON_SCHEMA:
        return "json_schema is for response_format json_schema alone" if request.json_schema else None
    try:
        schema = json.loads(request.json_schema)
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        return "json_schema must be a JSON Schema object, as JSON text"
    return None
