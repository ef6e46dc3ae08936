"""OpenAI's two shapes of log probabilities, made from the ``TokenLogprob`` records token events
carry (one per generated token, where the request asked).

A chat completion's ``logprobs`` is ``{"content": [...]}``, an item a token: its text, its log
probability, its UTF-8 ``bytes`` (a token can hold part of a character) and ``top_logprobs``, the
likeliest tokens in its place, each in the same form. A text completion's (the legacy API's) is
four lists: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict a place, the likeliest
tokens' and the sampled one's, as vLLM's) and ``text_offset``, where each token starts in the text;
with ``echo``, the prompt's tokens come first (``TokenEvent.prompt_logprobs``), the very first with
null for both, since nothing before it scores it.

Only content is scored: the tokens of an event whose text is not what the engine wrote (function
call markup the worker read into ``tool_calls``) are left out, as OpenAI's ``content`` holds the
message's content tokens alone.

A token the logits rule out (a ban, an end token held off by ``min_tokens``) has a log probability
of -inf, which JSON cannot hold (Python writes ``-Infinity``, which a browser's parser refuses):
it is shown as OpenAI and vLLM show it, -9999.0 (``shown``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from tokenbus.schemas import TokenEvent, TokenLogprob
from tokenbus.sse_edge.protocol.json_text import json_float, json_string

LOGPROB_FLOOR = -9999.0  # OpenAI's and vLLM's for a token that cannot be picked


def shown(logprob: float) -> float:
    """A log probability as the API shows it: at least LOGPROB_FLOOR (NaN too)."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def content_logprobs(event: TokenEvent) -> Sequence[TokenLogprob]:
    """The log probabilities of an event's content tokens (none for function-call markup)."""
    return event.logprobs if event.raw_text is None else ()


def chat_logprobs(tokens: Iterable[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion or chunk."""
    return {"content": [_chat_item(t.token, t.logprob) | {"top_logprobs": [_chat_item(a.token, a.logprob) for a in t.top]}
                        for t in tokens]}


def _chat_item(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": shown(logprob), "bytes": list(token.encode())}


# A streamed chunk's are rendered as text, as its other parts are (protocol/completion_bodies.py's ChunkWriter):
# json.dumps of the dict above took 13.3 µs a token with five likeliest here, this 4.3.
def chat_logprobs_json(tokens: Iterable[TokenLogprob]) -> str:
    """``chat_logprobs(tokens)`` as JSON text."""
    items = [_chat_item_json(t.token, t.logprob) + ',"top_logprobs":['
             + ",".join(_chat_item_json(a.token, a.logprob) + "}" for a in t.top) + "]}" for t in tokens]
    return '{"content":[' + ",".join(items) + "]}"


def _chat_item_json(token: str, logprob: float) -> str:
    """An item's fields before its close (the chosen token's go on with its likeliest)."""
    quoted, utf8 = _token_json(token)
    return '{"token":' + quoted + ',"logprob":' + json_float(shown(logprob)) + ',"bytes":' + utf8


@functools.lru_cache(maxsize=65_536)
def _token_json(token: str) -> tuple[str, str]:
    """A token's text and its UTF-8 bytes as JSON: a vocabulary's tokens come round again and again."""
    return json_string(token), "[" + ",".join(map(str, token.encode())) + "]"


class TextLogprobs:
    """``choices[].logprobs`` of a text completion, chunk by chunk: ``text_offset`` runs on over
    the chunks of one stream."""

    __slots__ = ("offset",)

    def __init__(self) -> None:
        self.offset = 0

    def of(self, tokens: Iterable[TokenLogprob], prompt: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """The lists of ``tokens``, after an echoed ``prompt``'s where given (its first token, which
        nothing before it scores, with null for its log probability and likeliest, as OpenAI's)."""
        body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for place, t in enumerate((*prompt, *tokens)):
            unscored = place == 0 and bool(prompt)
            body["tokens"].append(t.token)
            body["token_logprobs"].append(None if unscored else shown(t.logprob))
            body["top_logprobs"].append(None if unscored else
                                        {t.token: shown(t.logprob)} | {a.token: shown(a.logprob) for a in t.top})
            body["text_offset"].append(self.offset)
            self.offset += len(t.token)
        return body
