"""OpenAI chat-completions protocol: the request models (the response bodies: completion_bodies.py).

Kept apart from the serving logic (as vLLM does): nothing here knows about Kafka.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tokenbus.schemas import ChatMessage, ToolCall
from tokenbus.schemas.request_checks import (
    ALLOWED_TOKEN_IDS_MAX,
    BAD_WORD_CHARS_MAX,
    BAD_WORDS_MAX,
    PENALTY_MAX,
    STOP_TOKEN_IDS_MAX,
    TEMPERATURE_MAX,
    TOP_LOGPROBS_MAX,
    logit_bias_problem,
)
from tokenbus.sse_edge.protocol.metadata import Metadata


class TextContentPart(BaseModel):
    type: Literal["text"]  # images, audio and files are not served
    text: str


class FunctionCallParam(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text of an object (checked in validation.py)


class ToolCallParam(BaseModel):
    """A call in an assistant message of the history."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)  # tool messages

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def on_the_bus(self) -> ChatMessage:
        """The message as a request on the bus carries it."""
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or [])
        return ChatMessage(self.role, self.text(), calls, self.tool_call_id)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema a JSON answer follows (checked in validation.py)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with its schema)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None  # a JSON Schema object (checked in validation.py)
    strict: bool | None = None


class ToolParam(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


# Parts of OpenAI's API that tokenbus does not serve: a request using one gets a clear 400
# naming it rather than a silently different answer.
UNSUPPORTED = {
    "functions": "the deprecated `functions` (use `tools`)",
    "function_call": "the deprecated `function_call` (use `tool_choice`)", "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
}
# vLLM's sampling extensions that tokenbus does not serve (clients send them in ``extra_body``),
# with the values that change nothing (and None): a request that sets one to anything else gets a
# 400 naming it, not an answer sampled as if it had not. (``top_k``, ``min_p``, ``repetition_penalty``,
# ``min_tokens``, ``stop_token_ids``, ``allowed_token_ids``, ``include_stop_str_in_output``,
# ``truncate_prompt_tokens`` and ``bad_words`` are served: GenerationRequest.)
VLLM_SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "length_penalty": (1,),
    "use_beam_search": (False,),
    "prompt_logprobs": (), "guided_grammar": (),
}
INT64 = 2**63 - 1
GUIDE_MAX_CHARS = 4096  # a guided_regex's length, and each of guided_choice's
CHOICES_MAX = 256  # guided_choice's choices
PROMPT_CACHE_KEY_MAX = 64  # OpenAI's limit on a prompt_cache_key's length
HISTORY_CLIENT, HISTORY_SERVER = "client", "server"
CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def choice_pattern(choices: list[str]) -> str:
    """The regular expression an answer that is one of ``choices`` matches (vLLM's own reading)."""
    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


class GenerationRequest(BaseModel):
    """What a chat completion request and a text completion request (protocol/completions.py)
    share: the model, streaming and sampling. Fields OpenAI defines that change nothing here
    (``safety_identifier``, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)  # choices (each prompt's): at most TOKENBUS_EDGE_MAX_CHOICES in all
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64 - 1, le=INT64)
    presence_penalty: float | None = Field(default=None, ge=-PENALTY_MAX, le=PENALTY_MAX)
    frequency_penalty: float | None = Field(default=None, ge=-PENALTY_MAX, le=PENALTY_MAX)
    user: str | None = Field(default=None, max_length=256)
    # OpenAI's: requests naming one key share a GPU consumer's prefix cache (ChatRequest.partition_key).
    prompt_cache_key: str | None = Field(default=None, max_length=PROMPT_CACHE_KEY_MAX)
    # OpenAI's: which tier runs it (protocol/service_tiers.py; checked against the deployment's tiers).
    service_tier: str | None = Field(default=None, max_length=64)
    # vLLM's extension: generate on past the end-of-sequence token, to the token limit (benchmarks
    # ask for it, ``--ignore-eos``, so that every output has the length they set).
    ignore_eos: bool = False
    # OpenAI's: a bias from -100 to 100 added to the logit of each token named by its id (JSON keys:
    # decimal strings). Whether an id is in the model's vocabulary is the engine's to say.
    logit_bias: dict[str, float] | None = None
    # OpenAI's structured outputs (and vLLM's, for text completions too): a JSON answer. vLLM's
    # clients may ask for it their ways: its older ``guided_json``, its newer ``structured_outputs``
    # (``json`` or ``json_object``). ``answer_format`` reads whichever way was used.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: an answer this regular expression matches, or one of these choices (its
    # ``structured_outputs`` ``regex`` and ``choice`` too).
    guided_regex: str | None = Field(default=None, min_length=1, max_length=GUIDE_MAX_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1, max_length=GUIDE_MAX_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=CHOICES_MAX)
    # vLLM's sampling extensions: sample from the ``top_k`` likeliest tokens (-1 or 0: all) that are
    # at least ``min_p`` of the likeliest's probability; ``repetition_penalty`` shrinks the logits of
    # tokens the prompt or output holds (1: none); ``stop_token_ids`` end the output as the
    # end-of-sequence token does, and neither ends it before ``min_tokens``.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=STOP_TOKEN_IDS_MAX)
    # vLLM's: the only tokens the answer may hold.
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1,
                                                                         max_length=ALLOWED_TOKEN_IDS_MAX)
    # vLLM's: words the answer may not hold (as the model's tokenizer reads each, with a space before
    # it and without).
    bad_words: list[Annotated[str, Field(min_length=1, max_length=BAD_WORD_CHARS_MAX, pattern=r"\S")]] | None = Field(
        default=None, max_length=BAD_WORDS_MAX)
    # vLLM's: the stop sequence that ended the answer stays in its text.
    include_stop_str_in_output: bool = False
    # vLLM's: the engine keeps the prompt's last this many tokens (left truncation, after templating).
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        problem = logit_bias_problem(value) if value else None
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s or len(s) > 256 for s in stops):
            raise ValueError("stop sequences must be 1 to 256 characters")
        return value

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def logprobs_asked(self) -> tuple[bool, int]:
        """Whether each token's log probability is asked for, and how many likeliest tokens' with it."""
        return False, 0

    @property
    def answer_format(self) -> tuple[str, Any]:
        """The response format asked, whichever way (validation.py makes sure at most one was): its
        type (``text``, ``json_object``, ``json_schema``, ``regex``) and, for ``json_schema``, the
        schema, for ``regex`` the regular expression (a choice's: the alternation of its choices)."""
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            return self.response_format.type, schema.json_schema if schema is not None else None
        outputs = self.structured_outputs or {}
        guide = self.guided_json if self.guided_json is not None else outputs.get("json")
        if guide is not None:
            return "json_schema", json.loads(guide) if isinstance(guide, str) else guide
        regex = self.guided_regex if self.guided_regex is not None else outputs.get("regex")
        if regex is not None:
            return "regex", regex
        choices = self.guided_choice if self.guided_choice is not None else outputs.get("choice")
        if choices is not None:
            return "regex", choice_pattern(choices)
        return ("json_object", None) if outputs.get("json_object") else ("text", None)


class ChatCompletionRequest(GenerationRequest):
    """The part of OpenAI's chat completion request that tokenbus serves."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    modalities: list[str] | None = None
    # OpenAI's request metadata; tokenbus reads `conversation_id` from it to group transcripts.
    metadata: Metadata | None = None
    # OpenAI's: keep the completion, its messages and metadata for retrieval (stored_completions.py).
    store: bool = False
    tools: list[ToolParam] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS_MAX)
    # vLLM's chat extensions: the prompt ends with the start of the assistant's reply (or not), or
    # its final message is left open for the model to continue (an assistant's reply the client
    # began); ``echo`` gives that final message back before the reply, where it is the assistant's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_a_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):  # vLLM's rule
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt to false)")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # OpenAI's rule (and vLLM's)
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def logprobs_asked(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0

    @field_validator("metadata")
    @classmethod
    def _conversation_id_is_a_name(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        conversation = value.get("conversation_id")
        if conversation is not None and not CONVERSATION_ID.fullmatch(conversation):
            raise ValueError("conversation_id must be 1 to 128 of A-Z a-z 0-9 . _ : -")
        if value.get("history", HISTORY_CLIENT) not in (HISTORY_CLIENT, HISTORY_SERVER):
            raise ValueError("history must be 'client' (the messages hold it) or 'server' (stored turns are loaded)")
        if value.get("history") == HISTORY_SERVER and conversation is None:
            raise ValueError("history 'server' needs a conversation_id")
        return value

    @property
    def conversation_id(self) -> str | None:
        return (self.metadata or {}).get("conversation_id")

    @property
    def server_history(self) -> bool:
        """tokenbus's extension in OpenAI's ``metadata``: the stored turns of the conversation go
        before this request's messages."""
        return (self.metadata or {}).get("history") == HISTORY_SERVER

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ContinueRequest(BaseModel):
    """The body of ``POST /v1/chat/completions/{id}/continue`` (optional): how to answer."""

    model_config = ConfigDict(extra="forbid")

    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)
