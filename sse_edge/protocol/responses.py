"""OpenAI's Responses API protocol, the request side: ``POST /v1/responses``'s body and how it reads
as a chat completion's (``chat_body``), which is how the pipeline serves it. The response object
and the stream's events are response_objects.py's. Nothing here knows about Kafka.

What a Responses request adds to a chat's is its shapes (``input`` items, flat function tools,
``text.format``, ``instructions``) and state kept between turns (``store``, ``previous_response_id``,
``conversation``, served at the edge); the generation itself is a chat turn's. Hosted tools (web search, file
search, computer use, MCP, ...) and non-text input are not served: a request that asks for one
gets a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tokenbus.schemas import ChatMessage
from tokenbus.schemas.request_checks import TEMPERATURE_MAX, TOP_LOGPROBS_MAX
from tokenbus.sse_edge.errors import ApiError, InvalidRequest, from_validation_error
from tokenbus.sse_edge.protocol.chat import PROMPT_CACHE_KEY_MAX, ChatMessageParam
from tokenbus.sse_edge.protocol.compaction import SUMMARY_PREFIX, CompactionItem

# Fields of OpenAI's Responses request that tokenbus does not serve (beyond the hosted tools and
# non-text input, which are refused where they appear).
RESPONSES_UNSUPPORTED = {
    "prompt": "stored prompt templates",
    "context_management": "compaction within a turn (POST /v1/responses/compact compacts a context, and a later "
                          "turn takes its output)",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextPart(BaseModel):
    """A text part of an input message: the user's (``input_text``) or an earlier answer's (``output_text``)."""

    model_config = ConfigDict(extra="ignore")  # an output_text's annotations and logprobs

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # an earlier output's id and status

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier turn, given back with its output."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | CompactionItem
ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "compaction": CompactionItem}


class FunctionTool(BaseModel):
    """A function tool, flat as the Responses API writes it (a chat's nests it under ``function``)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ConversationRef(BaseModel):
    id: str = Field(min_length=1, max_length=64)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: the models here have one

    format: TextFormat | None = None


def one_context(conversation: str | ConversationRef | None, info: ValidationInfo) -> None:
    """OpenAI's rule: a turn continues a conversation object or a previous response, not both."""
    if conversation is not None and info.data.get("previous_response_id") is not None:
        raise ValueError("a turn continues a conversation or a previous response, not both")


class ResponsesRequest(BaseModel):
    """The part of OpenAI's Responses request that tokenbus serves. ``reasoning`` and the like are
    accepted and change nothing (the models here do not reason)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    # Answered at once, in progress; generated whatever becomes of the client (stored: retrieve it,
    # or read its stream, later).
    background: bool = False
    previous_response_id: str | None = None
    # A conversation object (Conversations API): its items are the turn's context, and the turn's
    # input and output are added to it once it ends.
    conversation: str | ConversationRef | None = None
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=PROMPT_CACHE_KEY_MAX)
    service_tier: str | None = Field(default=None, max_length=64)  # as a chat's (protocol/service_tiers.py)
    # OpenAI's cap on calls to built-in tools: there are none here (hosted tools are refused), so
    # it caps nothing; a response repeats it. (Function calls are the client's to cap.)
    max_tool_calls: int | None = Field(default=None, ge=0)
    safety_identifier: str | None = Field(default=None, max_length=64)  # OpenAI's end-user id: repeated
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS_MAX)
    reasoning: dict[str, Any] | None = None
    seed: int | None = None  # vLLM's sampling extension, as a chat's (OpenAI's Responses API has none)

    @field_validator("background")
    @classmethod
    def _background_is_stored(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("store") is False:  # OpenAI's rule
            raise ValueError("background responses must be stored (store: true)")
        return value

    @field_validator("conversation")
    @classmethod
    def _conversation_alone(cls, value: str | ConversationRef | None,
                            info: ValidationInfo) -> str | ConversationRef | None:
        one_context(value, info)
        if value is not None and info.data.get("store") is False:
            raise ValueError("a turn in a conversation is stored (store: true)")
        return value

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format else None
        return {
            "background": self.background, "instructions": self.instructions,
            "conversation": {"id": self.conversation_id} if self.conversation_id else None,
            "max_output_tokens": self.max_output_tokens, "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id, "prompt_cache_key": self.prompt_cache_key,
            "safety_identifier": self.safety_identifier,
            "reasoning": self.reasoning or {"effort": None, "summary": None}, "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": text or {"format": {"type": "text"}},
            "tool_choice": self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction)
            else self.tool_choice or "auto",
            "tools": self.tools or [], "top_logprobs": self.top_logprobs or 0,
            "top_p": 1.0 if self.top_p is None else self.top_p, "truncation": self.truncation or "disabled",
            "user": self.user,
        }


class InputTokensRequest(BaseModel):
    """OpenAI's ``POST /v1/responses/input_tokens``: what a turn would be prompted with (its input,
    instructions, tools, and the conversation or chain it continues), counted rather than sent."""

    model_config = ConfigDict(extra="ignore")  # text, reasoning, tool_choice, ...: they add no input here

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("conversation")
    @classmethod
    def _conversation_alone(cls, value: str | ConversationRef | None,
                            info: ValidationInfo) -> str | ConversationRef | None:
        one_context(value, info)
        return value

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation


def parse_input_items(given: str | list[dict[str, Any]]) -> list[InputItem]:
    """A request's ``input`` as items (text alone is one user message), each checked as its type says."""
    if isinstance(given, str):
        return [MessageItem(role="user", content=given)]
    return parse_items(given, "input")


def parse_items(raw_items: list[dict[str, Any]], param: str) -> list[InputItem]:
    """Items (a request's ``input``, those added to a conversation), each checked as its type says;
    an error names the item as the request's ``param`` holds it."""
    if not raw_items:
        raise InvalidRequest(f"'{param}' is empty.", param=param, code="invalid_value")
    items: list[InputItem] = []
    for i, raw in enumerate(raw_items):
        kind = raw.get("type", "message")
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise InvalidRequest(f"Input items of type '{kind}' are not supported: tokenbus serves messages, "
                                 "function calls and their outputs, and compactions.", param=f"{param}[{i}].type",
                                 code="unsupported_value")
        content = raw.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text"):
                raise InvalidRequest(f"Content of type '{part.get('type')}' is not supported: tokenbus serves text.",
                                     param=f"{param}[{i}].content[{j}].type", code="unsupported_value")
        try:
            items.append(model.model_validate(raw))
        except ValidationError as exc:
            raise from_validation_error(exc, within=(param, i)) from None
    return items


def function_tools(given: list[dict[str, Any]] | None) -> list[FunctionTool]:
    tools = []
    for i, raw in enumerate(given or []):
        if raw.get("type") != "function":
            raise InvalidRequest(f"Tools of type '{raw.get('type')}' are not supported: tokenbus serves function "
                                 "tools.", param=f"tools[{i}].type", code="unsupported_value")
        try:
            tools.append(FunctionTool.model_validate(raw))
        except ValidationError as exc:
            raise from_validation_error(exc, within=("tools", i)) from None
    return tools


def text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(instructions: str | None, items: list[InputItem]) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages ``instructions`` and input items read as, and for each the parameter it
    came from (what an error about the message names). Function calls given back join the
    assistant message before them, as a chat's ``tool_calls``; their outputs are tool messages; a
    compaction is the system message of its summary."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
        elif isinstance(item, CompactionItem):
            messages.append({"role": "system", "content": SUMMARY_PREFIX + item.summary})
        else:
            messages.append({"role": item.role, "content": text_of(item.content)})
        sources.append(f"input[{i}]")
    return messages, sources


def bus_messages(instructions: str | None, items: list[InputItem]) -> list[ChatMessage]:
    """``instructions`` and input items as the messages a turn is prompted with on the bus."""
    messages, _ = chat_messages(instructions, items)
    return [ChatMessageParam.model_validate(m).on_the_bus() for m in messages]


def chat_body(request: ResponsesRequest, items: list[InputItem]) -> tuple[dict[str, Any], list[str]]:
    """The chat completion request this Responses request is served as (checked then as a chat's
    is, ``in_responses_terms`` renaming what an error names), and its messages' sources."""
    messages, sources = chat_messages(request.instructions, items)
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "metadata": request.metadata,
        "user": request.user, "prompt_cache_key": request.prompt_cache_key, "service_tier": request.service_tier,
        "parallel_tool_calls": request.parallel_tool_calls, "seed": request.seed,
    }
    tools = function_tools(request.tools)
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in tools]
    if request.tool_choice is not None:
        choice = request.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    answer = request.text.format if request.text else None
    if answer is not None and answer.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": answer.name or "response", "schema": answer.json_schema, "strict": answer.strict}}
    elif answer is not None:
        body["response_format"] = {"type": answer.type}
    if request.logprobs:
        body.update(logprobs=True, top_logprobs=request.top_logprobs)
    return {k: v for k, v in body.items() if v is not None}, sources


# What a chat's parameter is called in the Responses request it was made from.
RENAMED = (("max_completion_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("logprobs", "include"))


def in_responses_terms(error: ApiError, sources: list[str]) -> ApiError:
    """An error the chat request's checks raised, naming the Responses request's parameter."""
    param = error.param
    if not param:
        return error
    renamed = param
    if param.startswith("messages["):
        index, _, rest = param[len("messages["):].partition("]")
        source = sources[int(index)] if index.isdigit() and int(index) < len(sources) else "input"
        renamed = source + rest
    elif param.startswith("tools[") and ".function." in param:
        renamed = param.replace(".function.", ".", 1)
    else:
        for chat_name, responses_name in RENAMED:
            if param == chat_name or param.startswith(chat_name + "."):
                renamed = responses_name + param[len(chat_name):]
                break
    error.message = error.message.replace(f"'{param}'", f"'{renamed}'")
    error.param = renamed
    return error
