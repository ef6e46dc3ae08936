"""A prompt's prefixes, named the same way by every part of tokenbus.

An engine's prefix cache holds blocks of prompt tokens, but the router that places a request has
no tokenizer: it sees messages. So prefixes are named at the boundaries every engine's chat
template keeps whole: the offered functions first (one segment), then each message (a final one
left open for the model to continue, vLLM's ``continue_final_message``, is a segment of its own kind). The name of
the first ``k`` segments is a chain hash, ``h_k = blake2b(h_{k-1} || segment_k)``, so it names the
whole prefix and nothing else (each field is length-prefixed, so no two prompts feed it the
same bytes). A text completion's prompt, which no template wraps, is one segment of its own
kind (given as token ids, one of those ids). A GPU consumer reports the ``h_k`` whose tokens its engine holds
(gpu_consumers/prefix_reports.py); the router looks up the longest ``h_k`` of a new request
(producers/placement.py). Both compute them here.

Hashes are signed 64-bit integers, so they travel as Avro ``long``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tokenbus.schemas.records import ChatMessage, ToolSpec

VERSION = b"tokenbus.prefixes.v1"


class Prompt(Protocol):
    """What a prompt is made of: a ChatRequest and an engine's GenerationInput both are one."""

    @property
    def messages(self) -> Sequence[ChatMessage]: ...

    @property
    def tools(self) -> Sequence[ToolSpec]: ...

    @property
    def tool_choice(self) -> str: ...

    @property
    def tool_choice_name(self) -> str | None: ...

    @property
    def offers_tools(self) -> bool: ...

    @property
    def text_prompt(self) -> bool: ...

    @property
    def continue_final_message(self) -> bool: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def truncate_prompt_tokens(self) -> int | None: ...


def _fields(h: Any, *fields: str | None) -> None:
    """Length-prefixed, so no two different segments feed the hash the same bytes."""
    for value in fields:
        if value is None:
            h.update(b"\xff\xff\xff\xff")
            continue
        data = value.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)


def _message(h: Any, message: ChatMessage, kind: str = "message") -> None:
    _fields(h, kind, message.role, message.content, message.tool_call_id)
    for call in message.tool_calls:
        _fields(h, "call", call.id, call.name, call.arguments)


def _open_message(h: Any, message: ChatMessage) -> None:
    _message(h, message, "open message")


def _text(h: Any, message: ChatMessage) -> None:
    _fields(h, "text", message.content)


def _token_ids(h: Any, token_ids: Sequence[int]) -> None:
    _fields(h, "token ids")
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))  # (one call, not one a token: prompts run to 10^4)


def _tools(h: Any, prompt: Prompt) -> None:
    _fields(h, "tools", prompt.tool_choice, prompt.tool_choice_name)
    for tool in prompt.tools:
        _fields(h, "tool", tool.name, tool.description, tool.parameters)


def segment_hashes(prompt: Prompt) -> list[int]:
    """The chain hash of each prefix of ``prompt``: ``[h_1, ..., h_n]``, one per segment (the offered
    functions when there are any, then each message); none for a prompt the engine truncates (vLLM's
    ``truncate_prompt_tokens``: what it keeps begins at no segment's start)."""
    hashes: list[int] = []
    if prompt.truncate_prompt_tokens is not None:
        return hashes
    previous = hashlib.blake2b(VERSION, digest_size=8).digest()

    def chain(write: Callable[[Any, Any], None], segment: Any) -> None:
        nonlocal previous
        h = hashlib.blake2b(previous, digest_size=8)
        write(h, segment)
        previous = h.digest()
        hashes.append(int.from_bytes(previous, "little", signed=True))

    if prompt.text_prompt:  # no chat template around it: not the tokens of a message that says the same
        if prompt.prompt_token_ids:  # (the tokens themselves: another tokenization of its text is not them)
            chain(_token_ids, prompt.prompt_token_ids)
        else:
            chain(_text, prompt.messages[0])
        return hashes
    if prompt.offers_tools:
        chain(_tools, prompt)
    for i, message in enumerate(prompt.messages):
        # A final message left open for the model to continue is not the tokens of that message closed.
        last_open = prompt.continue_final_message and i == len(prompt.messages) - 1
        chain(_open_message if last_open else _message, message)
    return hashes
