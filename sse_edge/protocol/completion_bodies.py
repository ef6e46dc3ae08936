"""OpenAI's response bodies for chat and text completions: a streamed response's chunks
(``ChunkWriter``), a whole completion (``completion_body``), usage, and the model list. The
request models are chat.py's and completions.py's; nothing here knows about Kafka either."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from tokenbus.schemas import TokenLogprob
from tokenbus.sse_edge.protocol.json_text import json_string
from tokenbus.sse_edge.protocol.logprobs import TextLogprobs, chat_logprobs, chat_logprobs_json


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage: ``prompt_tokens_details.cached_tokens`` are the prompt tokens the engine
    served from its prefix cache (counted in ``prompt_tokens`` too, billed cheaper)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChunkWriter:
    """Builds the ``chat.completion.chunk`` bodies of one streamed response; with ``text``, the
    ``text_completion`` chunks of a text completion (OpenAI's legacy ``/v1/completions``), whose
    choices carry ``text`` where a chat's carry a ``delta`` (and no role chunk, nor calls)."""

    __slots__ = ("request_id", "model", "created", "include_usage", "text", "index", "service_tier",
                 "_content_head", "_content_tail", "_text_logprobs")

    def __init__(self, request_id: str, model: str, include_usage: bool, created: int | None = None,
                 text: bool = False, index: int = 0, service_tier: str | None = None) -> None:
        """``created``: the request's time in seconds, so that a stream resumed later carries the
        same ``created`` as the chunks before it (now when unknown). ``index``: the choice whose
        chunks these are (a response with several, OpenAI's ``n``, has a writer for each).
        ``service_tier``: the tier it runs at in OpenAI's words, on every chunk as OpenAI's are
        (a part of the fixed head: it costs bytes, not time)."""
        self.request_id = request_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.include_usage = include_usage
        self.text = text
        self.index = index
        self.service_tier = service_tier
        # Content chunks are the hot path: everything but the delta and finish reason is fixed.
        head = json.dumps(self._chunk([]), separators=(",", ":"), ensure_ascii=False)
        choice = f'"choices":[{{"index":{index},' + ('"text":' if text else '"delta":')
        self._content_head = head[: head.index('"choices":[')] + choice
        self._content_tail = "]" + (',"usage":null}' if include_usage else "}")
        self._text_logprobs = TextLogprobs() if text else None

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "text_completion" if self.text else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
        }
        if self.service_tier is not None:  # (before the choices: the content chunks' head holds it)
            body["service_tier"] = self.service_tier
        body.update(system_fingerprint=None, choices=choices)
        if self.include_usage:
            body["usage"] = usage
        return body

    def for_choice(self, index: int) -> ChunkWriter:
        """A writer of the same response's choice ``index``."""
        return ChunkWriter(self.request_id, self.model, self.include_usage, self.created, self.text, index,
                           self.service_tier)

    def role(self) -> dict[str, Any]:
        return self._chunk([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta(self, text: str, finish_reason: str | None, logprobs: Sequence[TokenLogprob] = (),
              prompt_logprobs: Sequence[TokenLogprob] = ()) -> str:
        """A content chunk as JSON text, rendered from the fixed parts; ``logprobs``, its tokens'
        (protocol/logprobs.py), where the request asked for them, after an echoed prompt's
        (``prompt_logprobs``: a text completion's first chunk, whose text begins with the prompt)."""
        if self.text:
            delta = json_string(text)
        else:
            delta = '{"content":' + json_string(text) + "}" if text else "{}"
        finish = "null" if finish_reason is None else json_string(finish_reason)
        scored = "null"
        if (logprobs or prompt_logprobs) and self._text_logprobs is not None:
            scored = json.dumps(self._text_logprobs.of(logprobs, prompt_logprobs), separators=(",", ":"),
                                ensure_ascii=False)
        elif logprobs:
            scored = chat_logprobs_json(logprobs)
        return f'{self._content_head}{delta},"logprobs":{scored},"finish_reason":{finish}}}{self._content_tail}'

    def tool_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> str:
        """A chunk of a function call: the first one of a call has its id and name, later ones
        more of its arguments (OpenAI's ``delta.tool_calls``)."""
        call: dict[str, Any] = {"index": index}  # the call's, within the choice's calls
        if call_id is not None:
            call.update(id=call_id, type="function", function={"name": name, "arguments": arguments})
        else:
            call["function"] = {"arguments": arguments}
        delta = json.dumps({"tool_calls": [call]}, separators=(",", ":"), ensure_ascii=False)
        return f'{self._content_head}{delta},"logprobs":null,"finish_reason":null}}{self._content_tail}'

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        return self._chunk([], usage_body(prompt_tokens, completion_tokens, cached_tokens))


def tool_calls_body(calls: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a response: (id, name, arguments) each."""
    return [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
    tool_calls: list[tuple[str, str, str]] | None = None, cached_tokens: int = 0, text_completion: bool = False,
    logprobs: Sequence[TokenLogprob] = (), prompt_logprobs: Sequence[TokenLogprob] = (), created: int | None = None,
    service_tier: str | None = None,
) -> dict[str, Any]:
    """A ``chat.completion``; with ``text_completion``, the ``text_completion`` of OpenAI's legacy
    ``/v1/completions`` (a choice's ``text`` in place of its message: with ``echo``, the prompt and
    then the completion). ``logprobs``: its content tokens', where the request asked for them, after
    an echoed prompt's (``prompt_logprobs``, protocol/logprobs.py). ``created``: now, unless given.
    ``service_tier``: the tier it ran at, in OpenAI's words (a chat's, where known)."""
    created = int(time.time()) if created is None else created
    if text_completion:
        scored = TextLogprobs().of(logprobs, prompt_logprobs) if logprobs or prompt_logprobs else None
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "text": text, "logprobs": scored, "finish_reason": finish_reason}],
                "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens)}
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message.update(content=text or None, tool_calls=tool_calls_body(tool_calls))
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens),
    }
    if service_tier is not None:
        body["service_tier"] = service_tier
    return body


def choices_body(bodies: Sequence[dict[str, Any]], prompt_tokens: int, completion_tokens: int,
                 cached_tokens: int = 0) -> dict[str, Any]:
    """One response of several choices (OpenAI's ``n``, a batch of prompts) from each choice's
    own body (``completion_body``), in index order, with the response's usage."""
    choices = [{**body["choices"][0], "index": index} for index, body in enumerate(bodies)]
    return {**bodies[0], "choices": choices, "usage": usage_body(prompt_tokens, completion_tokens, cached_tokens)}


def model_body(model: str, owned_by: str = "tokenbus") -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": owned_by}


def model_list_body(models: list[str], owned_by: str = "tokenbus") -> dict[str, Any]:
    return {"object": "list", "data": [model_body(m, owned_by) for m in models]}
