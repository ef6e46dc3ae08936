"""OpenAI's text completions protocol (the legacy ``/v1/completions``): the request model. Its
response bodies are the chat protocol's in their text form (``ChunkWriter(text=True)``,
``completion_body(text_completion=True)``, protocol/completion_bodies.py).

What vLLM's, TGI's and TensorRT-LLM's servers take from benchmark and evaluation clients (vLLM's
``bench serve`` defaults to it): one prompt, continued as it is, with no chat template."""

from __future__ import annotations

from typing import cast

from pydantic import Field

from tokenbus.schemas.request_checks import TOP_LOGPROBS_MAX
from tokenbus.sse_edge.protocol.chat import GenerationRequest

# What the legacy API offers that tokenbus does not serve, with what a request may send for it.
TEXT_UNSUPPORTED = {"suffix": "a suffix (insertion)"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's for text completions (and vLLM's)


class CompletionRequest(GenerationRequest):
    """The part of OpenAI's text completion request that tokenbus serves: a prompt, as text or as
    the model's token ids, or a batch of such prompts (a list of them), each with its ``n`` choices."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    best_of: int | None = Field(default=None, ge=1, le=1)
    # The legacy API's one field: each token's log probability and this many likeliest tokens'
    # (OpenAI takes up to 5; vLLM, as here, up to 20).
    logprobs: int | None = Field(default=None, ge=0, le=TOP_LOGPROBS_MAX)
    # The prompt back before the completion (with ``logprobs``, its tokens scored as well, the first
    # with none: what evaluation harnesses score a text by).
    echo: bool = False

    @property
    def logprobs_asked(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each its text or its token ids: one, or a batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]  # one prompt of token ids
        return cast(list[str | list[int]], list(prompt))  # texts, or lists of token ids
