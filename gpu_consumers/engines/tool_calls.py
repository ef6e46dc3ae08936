"""Function calls in generated text: reading a model's calls back out of what it writes.

Models trained for function calling (Hermes, Qwen 2.5 and later, many Llama fine-tunes) write a
call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; that is the ``hermes``
format, the one parser here, chosen per model (``WorkerSettings.tool_parser``). Every engine
writes text (``engines/chat_template.py`` tells a model about the tools), and the worker runs
the text through the parser, so ``simulated``, ``hf`` and ``trtllm`` share it.

A call is delivered once it is whole and valid: JSON naming an offered function, with object
arguments. Anything else between the tags (broken JSON, an unknown function, a call cut off by
``max_tokens``) is delivered as the text it was, never dropped and never a crash. Whitespace
around calls is markup too (a reply of calls has no content, as with OpenAI). Whole calls go
out as OpenAI streams them: a first piece with the call's id and name, then the arguments in
pieces. Waiting for the closing tag costs the client nothing it could use: a call cannot be run
before its arguments are complete.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from tokenbus.schemas import ToolCallDelta

ARGUMENT_PIECE_CHARS = 16  # arguments stream in pieces of about this size, as a model's tokens would


@dataclass
class ParsedText:
    """What one piece of generated text amounts to."""

    content: str = ""  # text for the client
    calls: list[ToolCallDelta] = field(default_factory=list)
    raw: str = ""  # the generated text this accounts for: content and the markup of calls, in order

    @property
    def raw_text(self) -> str | None:
        """``raw`` where it differs from ``content`` (what a TokenEvent's ``raw_text`` carries)."""
        return None if self.raw == self.content else self.raw


def call_id(request_id: str, index: int) -> str:
    """The same id for the same call of the same request, on whichever worker parses it."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def argument_pieces(arguments: str) -> list[str]:
    return [arguments[i:i + ARGUMENT_PIECE_CHARS] for i in range(0, len(arguments), ARGUMENT_PIECE_CHARS)] or [""]


class HermesToolParser:
    """Splits generated text into content and ``<tool_call>`` calls, incrementally.

    ``offered``: the function names a call may use. ``first_index``: calls already delivered (a
    takeover continues their numbering). ``parallel``: more than one call per reply; without it
    calls after the first are dropped, as the request asked."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, request_id: str, offered: set[str], first_index: int = 0, parallel: bool = True) -> None:
        self._request_id = request_id
        self._offered = offered
        self._parallel = parallel
        self.calls = first_index
        self._held = ""  # text that may still be (the start of) a call
        self._space = ""  # whitespace read but not delivered: content if words follow, markup if a call does

    def feed(self, text: str) -> ParsedText:
        parsed = ParsedText()
        buffer = self._held + text
        while buffer:
            start = buffer.find(self.OPEN)
            if start == -1:
                keep = _partial_suffix(buffer, self.OPEN)
                self._say(buffer[:len(buffer) - keep], parsed)
                buffer = buffer[len(buffer) - keep:]
                break
            self._say(buffer[:start], parsed)
            end = buffer.find(self.CLOSE, start)
            if end == -1:
                buffer = buffer[start:]
                break
            markup = buffer[start:end + len(self.CLOSE)]
            self._take_call(markup, parsed)
            buffer = buffer[end + len(self.CLOSE):]
        consumed = len(self._held) + len(text) - len(buffer)
        parsed.raw = (self._held + text)[:consumed]
        self._held = buffer
        return parsed

    def flush(self) -> ParsedText:
        """The sequence ended: whatever is held (a call never closed) is text."""
        held, space = self._held, self._space
        self._held = self._space = ""
        if self.calls and not held:
            space = ""  # after the last call: markup
        return ParsedText(content=space + held, raw=held)

    def _say(self, text: str, parsed: ParsedText) -> None:
        """Deliver ``text``, but for its trailing whitespace, held until it is known what follows."""
        text = self._space + text
        words = text.rstrip()
        self._space = text[len(words):]
        parsed.content += words

    def _take_call(self, markup: str, parsed: ParsedText) -> None:
        call = self._call(markup[len(self.OPEN):-len(self.CLOSE)])
        if call is None:
            self._say(markup, parsed)
            return
        self._space = ""  # whitespace before a call is markup
        if self.calls and not self._parallel:
            return  # one call was asked for: the markup is consumed and nothing is delivered
        name, arguments = call
        index = self.calls
        self.calls += 1
        pieces = argument_pieces(arguments)
        parsed.calls.append(ToolCallDelta(index, call_id(self._request_id, index), name, ""))
        parsed.calls.extend(ToolCallDelta(index, arguments=piece) for piece in pieces if piece)

    def _call(self, body: str) -> tuple[str, str] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self._offered:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}


def render_call(name: str, arguments: dict[str, object]) -> str:
    """A call as the ``hermes`` format writes it (what the simulated engine generates)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{HermesToolParser.OPEN}\n{body}\n{HermesToolParser.CLOSE}"
