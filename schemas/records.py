"""The records of a turn that travel on the bus, as dataclasses: the request, its token events, its
completion, and their parts (records about turns, such as a cancel: signals.py).

Each class names the Avro schema (``schemas/avro/<name>.avsc``) it is written with.
Field names and defaults mirror the schema, so ``to_avro`` / ``from_avro`` are plain
conversions; the codec does the bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenbus.schemas.record_fields import now_ms, shallow_fields
from tokenbus.schemas.signals import CacheReport, Control, ModerationDecision

# Finish reasons of a turn that did not finish: its transcript says "incomplete", and it can be
# continued. "incomplete" itself is written by an edge that closed a stream nothing answered.
FINISH_INCOMPLETE = "incomplete"
INCOMPLETE_FINISH_REASONS = frozenset({"cancelled", "error", FINISH_INCOMPLETE})

TOOL_CHOICE_NONE = "none"
TOOL_CHOICE_AUTO = "auto"
TOOL_CHOICE_REQUIRED = "required"
TOOL_CHOICE_FUNCTION = "function"  # the function named by tool_choice_name
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# OpenAI's response_format types: the answer as the model writes it, a JSON object, or JSON that a
# request's json_schema describes (an engine constrains its decoding to it, or refuses the request).
RESPONSE_TEXT = "text"
RESPONSE_JSON_OBJECT = "json_object"
RESPONSE_JSON_SCHEMA = "json_schema"
RESPONSE_REGEX = "regex"  # a text guided_regex matches (vLLM's guided_regex, and guided_choice as one)


def estimate_prompt_tokens(texts: Iterable[str]) -> int:
    """Prompt tokens of messages with these texts, without a tokenizer: about four characters a
    token, plus a few per message. For budgets and admission only; engines count exactly."""
    return sum(len(text) // 4 + 4 for text in texts)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the assistant made: ``arguments`` is JSON text, as the model wrote it."""

    schema_name: ClassVar[str] = "tokenbus.ToolCall"  # a record inside a request and a completion

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function a request offers the model: ``parameters`` is its JSON Schema as JSON text."""

    schema_name: ClassVar[str] = "tokenbus.ToolSpec"  # a record inside a request

    name: str
    description: str = ""
    parameters: str = "{}"

    @classmethod
    def of(cls, name: str, description: str | None, parameters: dict[str, Any] | None) -> ToolSpec:
        """A function as a request's ``tools`` give it (no parameters: an object of none, as OpenAI takes it)."""
        return cls(name, description or "", json.dumps(parameters or EMPTY_PARAMETERS, separators=(",", ":")))

    @property
    def text(self) -> str:
        """What a prompt holds of it, as the estimates count it."""
        return f"{self.name} {self.description} {self.parameters}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a function call in a token stream. The first piece of a call carries its ``id``
    and ``name``; every piece may carry more ``arguments`` text. ``index`` orders the calls of a reply."""

    schema_name: ClassVar[str] = "tokenbus.ToolCallDelta"  # a record inside a token event

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


# Not frozen, as TokenEvent is not: a scored token event is read into as many of these as the token
# has likeliest ones, plus one, and a frozen dataclass's __init__ costs ~1.2 µs against ~0.3.
@dataclass(slots=True)
class TopLogprob:
    """One of the likeliest tokens at a place in the output, and its log probability."""

    schema_name: ClassVar[str] = "tokenbus.TopLogprob"  # a record inside a token event

    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's text and log probability (under the distribution it was sampled from),
    and the ``top_logprobs`` likeliest tokens in its place, likeliest first (OpenAI's ``logprobs``)."""

    schema_name: ClassVar[str] = "tokenbus.TokenLogprob"  # a record inside a token event

    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    schema_name: ClassVar[str] = "tokenbus.ChatMessage"  # a record inside a request and a completion

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


def _tool_calls_to_avro(calls: Iterable[ToolCall]) -> list[dict[str, str]]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def _tool_calls_from_avro(items: list[dict[str, Any]]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(**c) for c in items)


def _messages_to_avro(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content, "tool_calls": _tool_calls_to_avro(m.tool_calls),
             "tool_call_id": m.tool_call_id} for m in messages]


def _messages_from_avro(items: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"], _tool_calls_from_avro(m["tool_calls"]), m["tool_call_id"])
            for m in items]


def message_text(message: ChatMessage) -> str:
    """What a message says in words a tokenizer or a policy sees: its content and its calls' names
    and arguments."""
    if not message.tool_calls:
        return message.content
    return " ".join([message.content, *(f"{c.name} {c.arguments}" for c in message.tool_calls)])


@dataclass(slots=True)
class ChatRequest:
    schema_name: ClassVar[str] = "tokenbus.ChatRequest"
    # ``to_avro`` is its fields as they are (its messages', their calls' and its tools' too): the
    # codec writes a request straight from its attributes (an edge, every request) and reads one
    # straight into these classes (a GPU consumer, every request; ``from_avro`` is for older schemas).
    avro_from_attributes: ClassVar[bool] = True
    avro_record_classes: ClassVar[tuple[type, ...]] = (ChatMessage, ToolCall, ToolSpec)

    request_id: str
    model: str
    tier: str
    messages: list[ChatMessage]
    reply_topic: str
    reply_partition: int
    tenant: str = ""
    key_id: str = ""
    conversation_id: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    created_at_ms: int = field(default_factory=now_ms)
    deadline_ms: int | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str = TOOL_CHOICE_AUTO  # none, auto, required, or function (tool_choice_name)
    tool_choice_name: str | None = None
    parallel_tool_calls: bool = True
    # A continuation of an incomplete turn: generated after what that turn delivered, and stored
    # as that turn (its request id and time).
    continues_request_id: str | None = None
    continues_turn_at_ms: int | None = None
    prefix_token_ids: list[int] = field(default_factory=list)
    prefix_text: str = ""
    # Notes tokenbus's own parts leave on a request (and its Completion), e.g. ``purpose=summary``.
    annotations: dict[str, str] = field(default_factory=dict)
    # A text completion (OpenAI's legacy ``/v1/completions``): the one user message is a prompt the
    # model continues as it is, with no chat template. Moderation, transcripts and billing see it as
    # that message.
    text_prompt: bool = False
    # Generate on past the end-of-sequence token, to ``max_tokens`` (vLLM's extension: a benchmark's
    # output lengths stay what it asked for).
    ignore_eos: bool = False
    # OpenAI's penalties on tokens the output already holds: ``presence_penalty`` off each one's
    # logit once, ``frequency_penalty`` once for every time it occurs (0: none).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's log probabilities: each generated token's, and with ``top_logprobs`` that many of the
    # likeliest tokens at each place (TokenEvent.logprobs).
    logprobs: bool = False
    top_logprobs: int = 0
    # OpenAI's logit bias: added to the logit of each token named, by its id as a decimal string
    # (the keys of OpenAI's JSON object, and of an Avro map); ``token_biases`` reads it.
    logit_bias: dict[str, float] = field(default_factory=dict)
    # vLLM's sampling extensions: sample from the ``top_k`` likeliest tokens (0: all) that are at
    # least ``min_p`` of the likeliest's probability; ``repetition_penalty`` divides the positive
    # logits of tokens the prompt or output holds and multiplies the others (1: none);
    # ``stop_token_ids`` end the output as the end-of-sequence token does, and neither ends it
    # before it holds ``min_tokens``.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)  # vLLM's: the only tokens it may pick (empty: any)
    include_stop_str_in_output: bool = False  # vLLM's: the stop sequence that ended the output stays in its text
    # OpenAI's response_format: RESPONSE_TEXT, or a JSON answer (RESPONSE_JSON_OBJECT, or
    # RESPONSE_JSON_SCHEMA following ``json_schema``, a JSON Schema as JSON text); or vLLM's
    # RESPONSE_REGEX, an answer ``guided_regex`` matches.
    response_format: str = RESPONSE_TEXT
    json_schema: str = ""
    guided_regex: str = ""  # with RESPONSE_REGEX: the regular expression the whole answer matches
    # ``echo``: the prompt comes back before the output, on the first token event: a text
    # completion's (OpenAI's legacy API), with its tokens' log probabilities where ``logprobs`` is
    # set; a chat's final message, where it is the assistant's (vLLM's chat ``echo``).
    echo: bool = False
    # vLLM's chat template options: the prompt ends with the start of the assistant's reply, or
    # (``continue_final_message``) the final message is left open for the model to continue.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # A text completion's prompt given as the model's token ids (OpenAI's and vLLM's): the engine
    # takes them as they are; the one message holds their text (the edge decodes them), for
    # moderation, transcripts and an echo.
    prompt_token_ids: list[int] = field(default_factory=list)
    # vLLM's: the engine keeps the prompt's last this many tokens (None: all of it).
    truncate_prompt_tokens: int | None = None
    # One choice of a response with several (OpenAI's ``n``) is a request of its own; all but the
    # first of a prompt's choices name the first here, whose billing carries their shared prompt.
    prompt_billed_with: str | None = None
    # vLLM's: words the output may not hold (engines/bad_words.py reads them with the model's tokenizer).
    bad_words: list[str] = field(default_factory=list)
    # OpenAI's ``prompt_cache_key``: the client's name for requests that share a prompt's start
    # (an agent's session, a common system prompt), which share a GPU consumer's cache by it.
    prompt_cache_key: str | None = None

    @property
    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` by token id, in id order (its keys as ``request_checks`` requires them)."""
        return tuple(sorted((int(token_id), bias) for token_id, bias in self.logit_bias.items()))

    @property
    def partition_key(self) -> str:
        """Requests of one prompt cache key, else of one conversation, share a partition, so they
        share a GPU consumer's caches. A cache key is the client's own word on what its prompts
        share, so it comes first; it is scoped by tenant, so that tenants naming theirs alike
        (``default``, ``v1``) are not all placed on one partition."""
        if self.prompt_cache_key:
            return f"{self.tenant}/{self.prompt_cache_key}"
        return self.conversation_id or self.request_id

    @property
    def estimated_prompt_tokens(self) -> int:
        if self.prompt_token_ids:
            return len(self.prompt_token_ids)
        texts = [message_text(m) for m in self.messages] + [t.text for t in self.tools]
        return estimate_prompt_tokens(texts)

    @property
    def offers_tools(self) -> bool:
        """Whether the model may answer with function calls."""
        return bool(self.tools) and self.tool_choice != TOOL_CHOICE_NONE

    def to_avro(self) -> dict[str, Any]:
        return {**shallow_fields(self), "messages": _messages_to_avro(self.messages),
                "tools": [shallow_fields(t) for t in self.tools]}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> ChatRequest:
        return cls(**{**data, "messages": _messages_from_avro(data["messages"]),
                      "tools": [ToolSpec(**t) for t in data["tools"]]})


@dataclass(slots=True)
class TokenEvent:
    """One engine step's delta for one request; the final one carries finish_reason and usage."""

    schema_name: ClassVar[str] = "tokenbus.TokenEvent"
    # ``to_avro`` is its fields as they are (its tool-call deltas' too): the codec writes a token
    # event, one per token of every sequence, straight from its attributes, and reads one straight
    # into this class and those of the records inside it (``from_avro`` is for older schemas).
    avro_from_attributes: ClassVar[bool] = True
    avro_record_classes: ClassVar[tuple[type, ...]] = (ToolCallDelta, TokenLogprob, TopLogprob)

    request_id: str
    seq: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # The engine's own text of this event where it differs from ``text`` (tool-call markup the
    # worker parsed into ``tool_calls``): what a takeover continues after (token_log.Published).
    raw_text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    worker_id: str = ""
    created_at_ms: int = field(default_factory=now_ms)
    # Output moderation's stop signal: ends the stream wherever its reader is (see ReplyStream.offer).
    truncate: bool = False
    # Who asked, on the first event only: output moderation applies the tier's actions.
    tenant: str | None = None
    tier: str | None = None
    admitted_at_ms: int | None = None  # on the first event: when the GPU consumer admitted the request
    cached_tokens: int | None = None  # of prompt_tokens, served from the engine's prefix cache (set with them)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, where the request asked
    # On the first event, where the request asked for its prompt back (ChatRequest.echo): the prompt
    # as sent, and with logprobs its tokens' (the first token's is 0, with no top: nothing comes
    # before it to score it by; the API shows null).
    echo: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    def to_avro(self) -> dict[str, Any]:
        fields = shallow_fields(self)
        if self.tool_calls:
            fields["tool_calls"] = [shallow_fields(d) for d in self.tool_calls]
        for name in ("logprobs", "prompt_logprobs"):
            if fields[name]:
                fields[name] = [{"token": t.token, "logprob": t.logprob, "top": [shallow_fields(a) for a in t.top]}
                                for t in fields[name]]
        return fields

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> TokenEvent:
        if data["tool_calls"]:
            data = {**data, "tool_calls": [ToolCallDelta(**d) for d in data["tool_calls"]]}
        for name in ("logprobs", "prompt_logprobs"):
            if data.get(name):
                data = {**data, name: [TokenLogprob(t["token"], t["logprob"], [TopLogprob(**a) for a in t["top"]])
                                       for t in data[name]]}
        return cls(**data)


@dataclass(slots=True)
class Completion:
    """Closes a request: the source of transcripts and billing."""

    schema_name: ClassVar[str] = "tokenbus.Completion"
    # Written from its attributes and read into these classes, as a request is.
    avro_from_attributes: ClassVar[bool] = True
    avro_record_classes: ClassVar[tuple[type, ...]] = (ChatMessage, ToolCall)

    request_id: str
    model: str
    tier: str
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    created_at_ms: int
    started_at_ms: int
    finished_at_ms: int
    tenant: str = ""
    key_id: str = ""
    conversation_id: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    cancelled: bool = False
    error: str | None = None
    worker_id: str = ""
    first_token_at_ms: int | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    continues_request_id: str | None = None
    continues_turn_at_ms: int | None = None
    carried_tokens: int = 0
    annotations: dict[str, str] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # of prompt_tokens, served from the engine's prefix cache
    prompt_billed_with: str | None = None  # the request's: its prompt is billed with that choice's

    @property
    def incomplete(self) -> bool:
        return self.finish_reason in INCOMPLETE_FINISH_REASONS

    @property
    def billed_prompt_tokens(self) -> tuple[int, int]:
        """The prompt tokens this request bills, and of them the cached ones: none where another
        choice of its response bills the prompt they share."""
        if self.prompt_billed_with is not None:
            return 0, 0
        return self.prompt_tokens, min(self.cached_prompt_tokens, self.prompt_tokens)

    @property
    def billed_completion_tokens(self) -> int:
        """What this request generated: a continuation's carried tokens were billed with its turn."""
        return max(0, self.completion_tokens - self.carried_tokens)

    @classmethod
    def for_request(cls, request: ChatRequest, **outcome: Any) -> Completion:
        """The Completion that closes ``request``: who asked and what is carried over from the
        request, plus ``outcome`` (text, finish_reason, token counts, timings, worker_id, ...)."""
        return cls(request_id=request.request_id, model=request.model, tier=request.tier, tenant=request.tenant,
                   key_id=request.key_id, conversation_id=request.conversation_id, messages=request.messages,
                   created_at_ms=request.created_at_ms, continues_request_id=request.continues_request_id,
                   continues_turn_at_ms=request.continues_turn_at_ms, carried_tokens=len(request.prefix_token_ids),
                   annotations=request.annotations, prompt_billed_with=request.prompt_billed_with, **outcome)

    def to_avro(self) -> dict[str, Any]:
        return {**shallow_fields(self), "messages": _messages_to_avro(self.messages),
                "tool_calls": _tool_calls_to_avro(self.tool_calls)}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Completion:
        return cls(**{**data, "messages": _messages_from_avro(data["messages"]),
                      "tool_calls": list(_tool_calls_from_avro(data["tool_calls"]))})


Record = ChatRequest | TokenEvent | Completion | Control | ModerationDecision | CacheReport
RECORD_TYPES: tuple[type[Record], ...] = (ChatRequest, TokenEvent, Completion, Control, ModerationDecision,
                                          CacheReport)
