"""The one interface every engine implements, shaped like TensorRT-LLM's streaming API.

``engine.generate(inp)`` returns a stream; iterating it yields one :class:`StepOutput`
per engine step with that step's text and token-id deltas; the last one carries the
finish reason. ``stream.abort()`` stops the sequence within one step: the stream then
ends with ``finish_reason == "cancelled"``.

A sequence can start part-way: ``prefix_token_ids`` / ``prefix_text`` are output a
previous worker already published (crash takeover). The engine continues after them
as if it had generated them, and counts them in ``completion_tokens`` and ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenbus.schemas import (
    RESPONSE_TEXT,
    TOOL_CHOICE_AUTO,
    TOOL_CHOICE_NONE,
    ChatMessage,
    ChatRequest,
    TokenLogprob,
    ToolSpec,
)
from tokenbus.schemas.request_checks import PROMPT_SCORES_MAX

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_CONTENT_FILTER = "content_filter"  # stopped by output moderation
FINISH_ERROR = "error"
FINISH_TOOL_CALLS = "tool_calls"  # set by the worker when the reply's text held function calls


class InvalidInput(ValueError):
    """What an engine cannot run as asked (a token id outside its vocabulary, say), raised by its
    ``prepare`` or ``generate``: the request is answered with an error and not served again, and no
    other sequence in the batch is touched (on CUDA such an id would stop the whole process)."""


def check_prompt_scores(prompt_tokens: int, sampling: SamplingParams) -> None:
    """``InvalidInput`` where the prompt's log probabilities are asked of more tokens, with their
    likeliest, than one token event carries (``PROMPT_SCORES_MAX``)."""
    if sampling.prompt_logprobs is not None and prompt_tokens * (sampling.prompt_logprobs + 1) > PROMPT_SCORES_MAX:
        raise InvalidInput(f"scoring a prompt of {prompt_tokens} tokens with {sampling.prompt_logprobs} likeliest "
                           f"each is more than {PROMPT_SCORES_MAX} scores (tokens x (likeliest + 1)): "
                           "ask for fewer likeliest, or score a shorter prompt")


def check_token_ids(token_ids: Iterable[int], vocabulary_size: int) -> None:
    """``InvalidInput`` unless every id is one the model has."""
    for token_id in token_ids:
        if not 0 <= token_id < vocabulary_size:
            raise InvalidInput(f"token id {token_id} is not in the model's vocabulary (0 to {vocabulary_size - 1})")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the stop sequence that ends the output stays in its text
    ignore_eos: bool = False  # on past the end-of-sequence token, to max_tokens
    # Off a token's logit: ``presence_penalty`` if the output holds it, ``frequency_penalty`` for
    # each time it does (OpenAI's; vLLM's and TensorRT-LLM's count the output's tokens alone too).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Each generated token's log probability (StepOutput.logprobs), and this many of the likeliest
    # tokens at its place; None: none (vLLM's and TensorRT-LLM's ``logprobs``).
    logprobs: int | None = None
    # Added to the logit of each token (id, bias), before penalties and sampling (OpenAI's
    # ``logit_bias``; vLLM's applies it there too). In token id order.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: sampling keeps the ``top_k`` likeliest tokens (0: all) that are at least ``min_p`` of
    # the likeliest's probability (greedy decoding is unchanged by either); ``stop_token_ids`` end
    # the output as the end-of-sequence token does; neither ends it before ``min_tokens``.
    top_k: int = 0
    min_p: float = 0.0
    # vLLM's (and transformers'): a token the prompt or the output holds has its logit divided by
    # this where positive, multiplied where not, before the presence and frequency penalties. 1: none.
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's: the only tokens the output may hold, the others' logits ruled out with the bias (empty: any).
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's: words the output may not hold, read with the engine's tokenizer (engines/bad_words.py).
    bad_words: tuple[str, ...] = ()
    # OpenAI's response_format (schemas.RESPONSE_*): a JSON answer, of ``json_schema`` (JSON text)
    # where given, or one ``guided_regex`` matches, decoded under that constraint (vLLM's and
    # TensorRT-LLM's guided decoding).
    response_format: str = RESPONSE_TEXT
    json_schema: str = ""
    guided_regex: str = ""  # with schemas.RESPONSE_REGEX: what the whole answer matches (vLLM's guided_regex)
    # Each prompt token's log probability given the ones before it, and this many of the likeliest
    # tokens at its place, under the model's own distribution (no sampling option changes it); None:
    # none (vLLM's and TensorRT-LLM's ``prompt_logprobs``; a text completion's echo with logprobs).
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def named_token_ids(self) -> tuple[int, ...]:
        """The token ids the sampling names (its logit bias's, its stop and allowed token ids): each
        must be one the model has (``check_token_ids``), or indexing the logits by it would fail the
        whole step."""
        return tuple(token_id for token_id, _ in self.logit_bias) + self.stop_token_ids + self.allowed_token_ids


@dataclass(frozen=True, slots=True)
class GenerationInput:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefix_token_ids: tuple[int, ...] = ()
    prefix_text: str = ""
    # Functions the model may call (engines/chat_template.py puts them in the prompt; the worker
    # reads calls back out of the text with engines/tool_calls.py).
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = TOOL_CHOICE_AUTO
    tool_choice_name: str | None = None
    parallel_tool_calls: bool = True
    # A text completion: the one message's content is the prompt, continued with no chat template.
    text_prompt: bool = False
    # vLLM's chat template options: end the prompt with the start of the assistant's reply, or
    # leave the final message open for the model to continue (an assistant's reply begun by the client).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # A text prompt given as the model's token ids: taken as they are (its message holds their text).
    prompt_token_ids: tuple[int, ...] = ()
    # vLLM's: the prompt's last this many tokens alone (left truncation, after templating); None: all.
    truncate_prompt_tokens: int | None = None

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != TOOL_CHOICE_NONE

    @property
    def prompt_key(self) -> tuple[Any, ...]:
        """Everything the prompt is rendered from (not a taken-over sequence's output): equal keys,
        equal prompts. Unhashable where a message holds a list the schema has as a tuple."""
        return (self.request_id, self.messages, self.tools, self.tool_choice, self.tool_choice_name, self.text_prompt,
                self.add_generation_prompt, self.continue_final_message, self.prompt_token_ids,
                self.truncate_prompt_tokens)

    @classmethod
    def from_request(cls, request: ChatRequest, prefix_token_ids: tuple[int, ...] = (), prefix_text: str = "") -> GenerationInput:
        return cls(
            prefix_token_ids=prefix_token_ids,
            prefix_text=prefix_text,
            request_id=request.request_id,
            messages=tuple(request.messages),
            tools=tuple(request.tools),
            tool_choice=request.tool_choice,
            tool_choice_name=request.tool_choice_name,
            parallel_tool_calls=request.parallel_tool_calls,
            text_prompt=request.text_prompt,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            prompt_token_ids=tuple(request.prompt_token_ids),
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            sampling=SamplingParams(
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                stop=tuple(request.stop),
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                logprobs=request.top_logprobs if request.logprobs else None,
                logit_bias=request.token_biases,
                top_k=request.top_k,
                min_p=request.min_p,
                repetition_penalty=request.repetition_penalty,
                min_tokens=request.min_tokens,
                stop_token_ids=tuple(request.stop_token_ids),
                allowed_token_ids=tuple(request.allowed_token_ids),
                bad_words=tuple(request.bad_words),
                response_format=request.response_format,
                json_schema=request.json_schema,
                guided_regex=request.guided_regex,
                prompt_logprobs=request.top_logprobs if request.echo and request.logprobs and request.text_prompt else None,
            ),
        )


# Not frozen: made once per token of every sequence, and a frozen dataclass's __init__ costs
# 1.0 µs here against 0.2.
@dataclass(slots=True)
class StepOutput:
    text_diff: str
    token_ids_diff: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int  # cumulative
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, served from the engine's prefix cache
    logprobs: tuple[TokenLogprob, ...] = ()  # one for each of token_ids_diff, where the sampling asks
    # On the first step of a sequence that asks (SamplingParams.prompt_logprobs) and was not taken
    # over: one for each prompt token, the first with logprob 0 and no top (nothing scores it).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: StepOutput) -> StepOutput:
        """This step and the next as one: what a reader that fell behind the engine takes, so that
        it publishes one token event for the steps that waited rather than one each (vLLM's output
        collector merges a slow reader's deltas the same way). Counts and the finish are the later's."""
        return StepOutput(self.text_diff + later.text_diff, self.token_ids_diff + later.token_ids_diff,
                          later.prompt_tokens, later.completion_tokens, later.finish_reason, later.error,
                          later.cached_tokens, self.logprobs + later.logprobs,
                          self.prompt_logprobs + later.prompt_logprobs)


@dataclass(frozen=True, slots=True)
class PromptLayout:
    """A prompt as an engine's prefix cache sees it: the names the engine gives its full blocks of
    prompt tokens, in order, and the token position where each of the prompt's segments ends
    (schemas/prefixes.py: the offered functions, then each message)."""

    block_tokens: int
    block_hashes: tuple[int, ...]
    segment_ends: tuple[int, ...]


class PrefixCache(Protocol):
    """What an engine's prefix cache holds, for KV-cache-aware routing (gpu_consumers/prefix_reports.py)."""

    def layout(self, inp: GenerationInput) -> PromptLayout: ...

    def resident(self, block_hashes: Iterable[int]) -> set[int]:
        """Which of these blocks the cache holds now."""
        ...


class GenerationStream(Protocol):
    """One request's steps, read with ``async for``. A stream whose ``pushes`` is true also offers
    ``push_to(sink) -> Awaitable[None]``: each step handed to ``sink`` where the engine makes it,
    on the event loop, done at the final one (see ``each_step``)."""

    def __aiter__(self) -> AsyncIterator[StepOutput]: ...

    def abort(self) -> None: ...


StepSink = Callable[[StepOutput], None]


async def each_step(stream: AsyncIterable[StepOutput], sink: StepSink) -> None:
    """Give ``sink`` each of ``stream``'s steps, in order, up to the final one. A stream that can
    push them (``pushes``) calls ``sink`` as the engine hands each step over, so no task wakes per
    step (at 256 sequences that is a wakeup every few microseconds); any other is read here. What
    ``sink`` raises ends it, either way."""
    if getattr(stream, "pushes", False):
        await stream.push_to(sink)  # type: ignore[attr-defined]  # what pushes promises
        return
    async for out in stream:
        sink(out)


class Engine(Protocol):
    name: str

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """None: the engine keeps no prefix cache it can report."""
        ...

    async def start(self) -> None: ...

    async def prepare(self, inp: GenerationInput) -> None:
        """What ``generate`` will need of ``inp`` that can be worked out off the event loop first
        (the prompt's token ids); never raises: a prompt that cannot be made fails in ``generate``."""
        ...

    def generate(self, inp: GenerationInput) -> GenerationStream: ...

    def kv_cache_usage(self) -> float | None:
        """The share of the engine's KV cache in use now, 0 to 1; None while it cannot tell."""
        ...

    async def close(self) -> None: ...
