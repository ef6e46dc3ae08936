"""Turn a request body into its protocol model (a ChatCompletionRequest above all, or a text
completion's CompletionRequest), or an OpenAI-format error naming the problem."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, TypeVar

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from tokenbus.schemas.request_checks import TOKEN_ID_MAX
from tokenbus.sse_edge.errors import ApiError, InvalidRequest, PayloadTooLarge, RequestTimeout, from_validation_error
from tokenbus.sse_edge.protocol.chat import (
    UNSUPPORTED,
    VLLM_SAMPLING_NEUTRAL,
    ChatCompletionRequest,
    GenerationRequest,
)
from tokenbus.sse_edge.protocol.completions import TEXT_UNSUPPORTED, CompletionRequest
from tokenbus.sse_edge.protocol.responses import (
    RESPONSES_UNSUPPORTED,
    InputItem,
    ResponsesRequest,
    chat_body,
    in_responses_terms,
    parse_input_items,
)
from tokenbus.sse_edge.protocol.service_tiers import tier_asked
from tokenbus.sse_edge.settings import EdgeSettings


def too_large(max_body_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body is larger than {max_body_bytes} bytes.", code="request_too_large")


async def read_body(request: Request, max_body_bytes: int, timeout_s: float) -> bytes:
    """The whole body within ``timeout_s``: a client that announces a body and trickles it, or
    stops, would otherwise hold its connection (and this handler) for as long as it likes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large(max_body_bytes)
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > max_body_bytes:
                    raise too_large(max_body_bytes)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s.") from None
    return bytes(raw)


def page_params(request: Request, default_limit: int, max_limit: int = 500) -> tuple[int, str | None]:
    """A list's page: its ``limit`` (1 to ``max_limit``) and the ``after`` cursor, if any."""
    raw = request.query_params.get("limit", str(default_limit))
    if not raw.isdigit() or not 1 <= int(raw) <= max_limit:
        raise InvalidRequest(f"limit must be an integer from 1 to {max_limit}.", param="limit", code="invalid_value")
    return int(raw), request.query_params.get("after") or None


def list_order(request: Request, default: str = "desc") -> str:
    """A list's ``order`` by creation time: ``desc`` (newest first; the default unless ``default``
    says otherwise) or ``asc``."""
    order = request.query_params.get("order", default)
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be `asc` or `desc`.", param="order", code="invalid_value")
    return order


Listed = TypeVar("Listed")


def cursor_page(items: Sequence[Listed], ids: Sequence[str], request: Request, default_limit: int,
                max_limit: int) -> tuple[list[Listed], bool]:
    """A page of ``items`` (``ids``, theirs) after the one the ``after`` parameter names, of
    ``limit`` items; and whether more follow."""
    limit, after = page_params(request, default_limit, max_limit)
    start = 0
    if after:
        if after not in ids:
            raise invalid_cursor()
        start = ids.index(after) + 1
    return list(items[start:start + limit]), start + limit < len(items)


def invalid_cursor() -> InvalidRequest:
    return InvalidRequest("The 'after' cursor is not one this list gave.", param="after", code="invalid_cursor")


def body_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


Body = TypeVar("Body", bound=BaseModel)


def json_object(raw: bytes, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object (an empty body as ``{}`` where it may be left out)."""
    if empty_ok and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("We could not parse the JSON body of your request.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


def parse_body(body: dict[str, Any], model: type[Body]) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def parse_chat_request(raw: bytes, settings: EdgeSettings) -> ChatCompletionRequest:
    return chat_request_of(json_object(raw), settings)


def chat_request_of(body: dict[str, Any], settings: EdgeSettings) -> ChatCompletionRequest:
    """A chat completion's body, checked (an ``ApiError`` says what is wrong): an HTTP request's, or
    a line's of a batch; its model the one that serves it (an alias resolved)."""
    reject_unsupported(body)
    reject_vllm_sampling(body)
    chat = parse_body(body, ChatCompletionRequest)
    chat.model = settings.served_model(chat.model)
    check_serving_limits(chat, settings)
    check_tools(chat)
    check_tool_messages(chat)
    return chat


def parse_responses_request(raw: bytes, settings: EdgeSettings) -> tuple[ResponsesRequest, list[InputItem],
                                                                          ChatCompletionRequest]:
    """A Responses request's body (``/v1/responses``), its input items, and the chat request it is
    served as, checked as a chat's is (an error names the Responses request's parameter)."""
    body = json_object(raw)
    reject_unsupported(body, RESPONSES_UNSUPPORTED)
    asked = parse_body(body, ResponsesRequest)
    items = parse_input_items(asked.input)
    chat, sources = chat_body(asked, items)
    try:
        return asked, items, chat_request_of(chat, settings)
    except ApiError as exc:
        raise in_responses_terms(exc, sources) from None


def parse_completion_request(raw: bytes, settings: EdgeSettings) -> CompletionRequest:
    return completion_request_of(json_object(raw), settings)


def completion_request_of(body: dict[str, Any], settings: EdgeSettings) -> CompletionRequest:
    """A text completion's body (``/v1/completions``): a prompt, as text or as token ids, or a batch of them."""
    reject_unsupported(body, TEXT_UNSUPPORTED)
    reject_vllm_sampling(body)
    completion = parse_body(body, CompletionRequest)
    completion.model = settings.served_model(completion.model)
    prompts = completion.prompts
    if not prompts:
        raise InvalidRequest("The prompt is empty.", param="prompt", code="invalid_value")
    check_generation_limits(completion, settings, len(prompts))
    for prompt in prompts:
        check_prompt(prompt, settings)
    return completion


def check_prompt(prompt: str | list[int], settings: EdgeSettings) -> None:
    """One prompt of a text completion: its text, or its token ids."""
    if not prompt:
        raise InvalidRequest("The prompt is empty.", param="prompt", code="invalid_value")
    if len(prompt) > settings.max_prompt_chars:  # (a token is a character at least)
        unit = "characters" if isinstance(prompt, str) else "tokens"
        raise InvalidRequest(f"The prompt is longer than {settings.max_prompt_chars} {unit}.", param="prompt",
                             code="context_length_exceeded")
    if not isinstance(prompt, str) and not all(0 <= token_id <= TOKEN_ID_MAX for token_id in prompt):
        raise InvalidRequest(f"Token ids are 0 to {TOKEN_ID_MAX}.", param="prompt", code="invalid_value")


def reject_unsupported(body: dict[str, Any], unsupported: dict[str, str] = UNSUPPORTED) -> None:
    for name, feature in unsupported.items():
        value = body.get(name)  # (not ``in (None, False)``: a text completion's ``logprobs: 0`` asks for some)
        if not (value is None or value is False or value == [] or value == {}):
            raise InvalidRequest(f"'{name}' is not supported: tokenbus does not serve {feature}.", param=name,
                                 code="unsupported_parameter")


def reject_vllm_sampling(body: dict[str, Any]) -> None:
    for name, neutral in VLLM_SAMPLING_NEUTRAL.items():
        value = body.get(name)
        if value is not None and not _neutral(value, neutral):
            raise InvalidRequest(f"'{name}' is not supported: tokenbus's engines do not take vLLM's '{name}'.",
                                 param=name, code="unsupported_parameter")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if isinstance(value, bool):  # True == 1: a boolean is neutral only where that boolean is listed
        return any(value is n for n in neutral)
    return value in neutral


def check_generation_limits(request: GenerationRequest, settings: EdgeSettings, prompts: int = 1) -> None:
    """What a chat and a text completion (of ``prompts`` prompts) alike may not ask for."""
    choices = request.n * prompts
    if choices > settings.max_choices:
        raise InvalidRequest(f"A response may have at most {settings.max_choices} choices (n for each prompt); this "
                             f"one asks for {choices}.", param="n" if prompts == 1 else "prompt",
                             code="too_many_choices")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                             param="stream_options", code="invalid_value")
    if request.token_limit is not None and request.token_limit > settings.max_output_tokens:
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        raise InvalidRequest(f"'{param}' may be at most {settings.max_output_tokens}.", param=param,
                             code="invalid_value")
    check_response_format(request)
    try:
        tier_asked(request.service_tier, settings.bus.tiers)
    except ValueError as exc:
        raise InvalidRequest(f"Invalid value for 'service_tier': {exc}.", param="service_tier",
                             code="invalid_value") from None
    if request.token_limit is not None and request.min_tokens > request.token_limit:
        raise InvalidRequest("'min_tokens' may be at most the token limit.", param="min_tokens", code="invalid_value")


def check_serving_limits(chat: ChatCompletionRequest, settings: EdgeSettings) -> None:
    check_generation_limits(chat, settings)
    if chat.n > 1 and chat.conversation_id is not None:
        raise InvalidRequest("A conversation's turn has one answer: 'n' must be 1 with a conversation_id.",
                             param="n", code="invalid_value")
    if chat.modalities and chat.modalities != ["text"]:
        raise InvalidRequest("Only the 'text' modality is supported.", param="modalities", code="unsupported_value")
    if len(chat.messages) > settings.max_messages:
        raise InvalidRequest(f"At most {settings.max_messages} messages are allowed.", param="messages",
                             code="too_many_messages")
    if sum(len(m.text()) for m in chat.messages) > settings.max_prompt_chars:
        raise InvalidRequest(f"The messages are longer than {settings.max_prompt_chars} characters in total.",
                             param="messages", code="context_length_exceeded")



# Of vLLM's structured_outputs: a JSON answer, or one a regular expression matches, or a choice.
STRUCTURED_OUTPUTS_SERVED = ("json", "json_object", "regex", "choice")


def check_response_format(request: GenerationRequest) -> None:
    """A structured answer is asked one way at most (OpenAI's ``response_format``, vLLM's
    ``guided_json``, ``guided_regex``, ``guided_choice`` or its ``structured_outputs``), a schema
    given is a valid JSON Schema object, a regular expression one Python reads, and no other
    structure is asked of vLLM's ``structured_outputs``."""
    answer, outputs = request.response_format, request.structured_outputs or {}
    for key, value in outputs.items():
        if key not in STRUCTURED_OUTPUTS_SERVED and value not in (None, False):
            raise InvalidRequest(f"'structured_outputs.{key}' is not supported: tokenbus constrains answers to JSON, "
                                 "a regular expression or a choice.", param=f"structured_outputs.{key}",
                                 code="unsupported_parameter")
    asked = [("response_format", answer is not None and answer.type != "text"),
             ("guided_json", request.guided_json is not None), ("guided_regex", request.guided_regex is not None),
             ("guided_choice", request.guided_choice is not None)]
    asked += [(f"structured_outputs.{key}", outputs.get(key) not in (None, False)) for key in STRUCTURED_OUTPUTS_SERVED]
    ways = [name for name, is_asked in asked if is_asked]
    if len(ways) > 1:
        raise InvalidRequest(f"Ask for a structured answer one way, not with both '{ways[0]}' and '{ways[1]}'.",
                             param=ways[1], code="invalid_value")
    check_guide_types(outputs)
    if not ways:
        return
    param = "response_format.json_schema.schema" if ways[0] == "response_format" else ways[0]
    if answer is not None and answer.type == "json_schema" and answer.json_schema is None:
        raise InvalidRequest("response_format type 'json_schema' needs its 'json_schema'.",
                             param="response_format.json_schema", code="missing_required_parameter")
    try:
        kind, guide = request.answer_format
    except ValueError:  # a JSON guide given as text that is not JSON
        kind, guide = "json_schema", None
    if kind == "regex":
        try:
            re.compile(guide)
        except re.error as exc:
            raise InvalidRequest(f"Invalid regular expression: {exc}.", param=param, code="invalid_value") from None
    elif kind == "json_schema":
        if not isinstance(guide, dict):
            raise InvalidRequest("The JSON Schema must be a JSON object.", param=param, code="invalid_value")
        if (problem := schema_problem(guide)) is not None:
            raise InvalidRequest(f"Invalid JSON Schema for the response format: {problem}.", param=param,
                                 code="invalid_value")


def check_guide_types(outputs: dict[str, Any]) -> None:
    """vLLM's ``structured_outputs`` ``regex`` is text and its ``choice`` a list of texts (its
    ``guided_regex`` and ``guided_choice`` are typed by the request's model)."""
    regex, choices = outputs.get("regex"), outputs.get("choice")
    if regex is not None and not (isinstance(regex, str) and regex):
        raise InvalidRequest("'structured_outputs.regex' must be a regular expression, as text.",
                             param="structured_outputs.regex", code="invalid_value")
    if choices is not None and not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequest("'structured_outputs.choice' must be a list of texts.", param="structured_outputs.choice",
                             code="invalid_value")


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a valid JSON Schema (Draft 2020-12, as OpenAI's); None when it is."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return str(exc.message)
    return None


def check_tools(chat: ChatCompletionRequest) -> None:
    """Each tool's ``parameters`` is a JSON Schema for an object; names are unique; a named
    ``tool_choice`` names one of them."""
    tools = chat.tools or []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        if function.name in names:
            raise InvalidRequest(f"Tool names must be unique; '{function.name}' appears twice.",
                                 param=f"tools[{i}].function.name", code="invalid_value")
        names.add(function.name)
        parameters = function.parameters
        if parameters is None:
            continue
        param = f"tools[{i}].function.parameters"
        if (problem := schema_problem(parameters)) is not None:
            raise InvalidRequest(f"Invalid schema for function '{function.name}': {problem}.", param=param,
                                 code="invalid_function_parameters")
        if parameters.get("type", "object") != "object":
            raise InvalidRequest(f"Invalid schema for function '{function.name}': the parameters must be a JSON "
                                 f"Schema of type 'object', not '{parameters.get('type')}'.", param=param,
                                 code="invalid_function_parameters")
    choice = chat.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise InvalidRequest("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice",
                             code="invalid_value")
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise InvalidRequest(f"'tool_choice' names the function '{choice.function.name}', which is not in 'tools'.",
                             param="tool_choice", code="invalid_value")


def check_tool_messages(chat: ChatCompletionRequest) -> None:
    """Calls in the history carry JSON object arguments; a tool message says which call it answers."""
    for i, message in enumerate(chat.messages):
        if message.role == "tool" and message.tool_call_id is None:
            raise InvalidRequest("A message with role 'tool' needs its 'tool_call_id'.",
                                 param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequest("Only assistant messages carry 'tool_calls'.", param=f"messages[{i}].tool_calls",
                                 code="invalid_value")
        for j, call in enumerate(message.tool_calls or []):
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise InvalidRequest("A tool call's arguments must be a JSON object, as JSON text.",
                                     param=f"messages[{i}].tool_calls[{j}].function.arguments", code="invalid_value")
