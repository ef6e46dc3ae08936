"""OpenAI's Responses API protocol, the response side: the ``response`` object, its output items,
and a streamed response's events (``ResponseEvents``). The request is responses.py's.

A streamed response is SSE with each event named (``event: response.output_text.delta``), its
data carrying the same ``type`` and a ``sequence_number`` that counts the stream's events from 0;
it ends with ``response.completed`` (or ``.incomplete``, ``.failed``, or an ``error`` event),
and no ``[DONE]``."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tokenbus.schemas import TokenLogprob
from tokenbus.sse_edge.protocol.json_text import json_string
from tokenbus.sse_edge.protocol.logprobs import chat_logprobs

# How a generation's finish reason reads as a response's status, and why it is incomplete.
INCOMPLETE_BECAUSE = {"length": "max_output_tokens", "content_filter": "content_filter"}
# The event that ends a stream, by the response's status (any other: ``response.failed``).
ENDED_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


def item_id(kind: str, response_id: str | None = None, index: int = 0) -> str:
    """An item's id, as OpenAI's look: ``msg_...`` for a message, ``fc_...`` for a function call.
    An output item's is made from its response's id and its place in the output, so that the
    stream read again from the log (resumed on any edge) names each item as it went out live."""
    if response_id is None:
        return f"{kind}_{uuid.uuid4().hex}"
    return f"{kind}_{hashlib.blake2b(f'{response_id}/{index}'.encode(), digest_size=16).hexdigest()}"


def status_of(finish_reason: str | None, failed: bool) -> str:
    if failed:
        return "cancelled" if finish_reason == "cancelled" else "failed"
    return "incomplete" if finish_reason in INCOMPLETE_BECAUSE else "completed"


def usage_of(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A response's usage. ``cache_write_tokens`` counts what OpenAI bills for writing its explicit
    prompt cache; the engines here cache prefixes as they go, at no charge: 0."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def logprobs_of(scored: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Output text's token scores as the Responses API writes them (a chat's ``logprobs.content``)."""
    return list(chat_logprobs(scored)["content"]) if scored else []


def message_item(id_: str, text: str, status: str, scored: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if scored is not None:
        part["logprobs"] = logprobs_of(scored)
    return {"type": "message", "id": id_, "status": status, "role": "assistant", "content": [part]}


def function_call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": id_, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(response_id: str, text: str, calls: Sequence[tuple[str, str, str]], status: str,
                 scored: Sequence[TokenLogprob] | None = None) -> list[dict[str, Any]]:
    """A whole answer's items: its message (where it has text, or nothing else), then its calls
    ((call id, name, arguments) each)."""
    item_status = "incomplete" if status == "incomplete" else "completed"
    items = [message_item(item_id("msg", response_id), text, item_status, scored)] if text or not calls else []
    items += [function_call_item(item_id("fc", response_id, len(items) + i), call_id, name, arguments, item_status)
              for i, (call_id, name, arguments) in enumerate(calls)]
    return items


def response_object(response_id: str, created_at: int, model: str, echoed: dict[str, Any]) -> dict[str, Any]:
    """A ``response`` as it begins (``in_progress``, no output): ``echoed``, the request's settings
    as it repeats them (ResponsesRequest.echoed). ``ended_as`` gives it its end."""
    return ended_as({"id": response_id, "object": "response", "created_at": created_at, "model": model, **echoed},
                    "in_progress", [], None)


def ended_as(response: dict[str, Any], status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None, incomplete_reason: str | None = None,
             completed_at: int | None = None) -> dict[str, Any]:
    """``response`` with what its end says (``in_progress``: as it began again): its status, output,
    usage, error, why it is incomplete, and when it completed (now, unless ``completed_at``)."""
    return {**response, "status": status, "output": output, "usage": usage, "error": error,
            "completed_at": (completed_at or int(time.time())) if status == "completed" else None,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None}


def output_text(response: dict[str, Any]) -> str:
    """The text of a response's messages (the openai client's ``output_text``)."""
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


class ResponseEvents:
    """The events of one streamed response, as SSE frames: its items opened as their first piece
    comes, added to as more come, and closed, in the order they were opened, once it ends.

    Text and arguments deltas are the hot path (an event a token): they are written from fixed
    parts (ids are hex, output indexes numbers: nothing in them needs escaping), and an item's
    pieces are kept as a list, joined once when it closes."""

    __slots__ = ("response", "logprobs", "skip_through", "completed_at", "_sequence", "_items", "_pieces", "_message",
                 "_calls")

    def __init__(self, response: dict[str, Any], logprobs: bool, skip_through: int = -1,
                 completed_at: int | None = None) -> None:
        """``response``: the response object as it is in progress (no output, no usage);
        ``logprobs``: whether the text's token scores were asked for; ``skip_through``: the events
        up to this sequence number are made but not written (a client resuming has them);
        ``completed_at``: when it completed, where it has (a stream read again): now otherwise."""
        self.response = response
        self.logprobs = logprobs
        self.skip_through = skip_through
        self.completed_at = completed_at
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # every output item, in output order
        self._pieces: list[list[str]] = []  # each item's text or arguments so far, in pieces
        self._message: int | None = None  # the output index of the message being written
        self._calls: dict[int, int] = {}  # the output index of each call, by the engine's index

    def _event(self, kind: str, **fields: Any) -> bytes:
        if self._sequence <= self.skip_through:
            self._sequence += 1
            return b""
        data = json.dumps({"type": kind, "sequence_number": self._sequence, **fields}, separators=(",", ":"),
                          ensure_ascii=False)
        self._sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def _delta(self, kind: str, index: int, delta: str, tail: str) -> bytes:
        sequence, self._sequence = self._sequence, self._sequence + 1
        if sequence <= self.skip_through:
            return b""
        return (f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{sequence},'
                f'"item_id":"{self._items[index]["id"]}","output_index":{index},{tail}'
                f'"delta":{json_string(delta)}}}\n\n').encode()

    def started(self) -> bytes:
        return (self._event("response.created", response=self.response)
                + self._event("response.in_progress", response=self.response))

    def _added(self, item: dict[str, Any]) -> tuple[int, bytes]:
        self._items.append(item)
        self._pieces.append([])
        index = len(self._items) - 1
        return index, self._event("response.output_item.added", output_index=index, item=item)

    def text(self, delta: str, scores: list[dict[str, Any]] | None = None, id_: str | None = None) -> bytes:
        """A piece of the answer's text, with its tokens' scores (``logprobs_of``) where they were
        asked for; ``id_``: the message's, where it is known (a stored response sent again)."""
        out = b""
        index = self._message
        if index is None:
            message = message_item(id_ or item_id("msg", self.response["id"], len(self._items)), "", "in_progress",
                                   [] if self.logprobs else None)
            part = message["content"].pop()  # (each event is written as it is made: the item, then its part)
            index, out = self._added(message)
            self._message = index
            message["content"].append(part)
            out += self._event("response.content_part.added", item_id=message["id"], output_index=index,
                               content_index=0, part=part)
        self._pieces[index].append(delta)
        scored = "[]"
        if self.logprobs and scores:
            self._items[index]["content"][0]["logprobs"] += scores
            scored = json.dumps(scores, separators=(",", ":"), ensure_ascii=False)
        return out + self._delta("response.output_text.delta", index, delta,
                                 f'"content_index":0,"logprobs":{scored},')

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str, id_: str | None = None) -> bytes:
        """A piece of a function call: the first of a call has its id and name (``id_``: its item's,
        where it is known)."""
        out = b""
        output_index = self._calls.get(index)
        if output_index is None:
            item = function_call_item(id_ or item_id("fc", self.response["id"], len(self._items)),
                                      call_id or item_id("call"), name or "", "", "in_progress")
            output_index, out = self._added(item)
            self._calls[index] = output_index
        if not arguments:
            return out
        self._pieces[output_index].append(arguments)
        return out + self._delta("response.function_call_arguments.delta", output_index, arguments, "")

    def _closed(self, status: str) -> bytes:
        """Each item, whole, and its done events, in output order."""
        out = b""
        item_status = "incomplete" if status == "incomplete" else "completed"
        for index, item in enumerate(self._items):
            item["status"] = item_status
            whole = "".join(self._pieces[index])
            if item["type"] == "message":
                part = item["content"][0]
                part["text"] = whole
                out += self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=whole, logprobs=part.get("logprobs", []))
                out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)
            else:
                item["arguments"] = whole
                out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=whole)
            out += self._event("response.output_item.done", output_index=index, item=item)
        return out

    def ended(self, status: str, usage: dict[str, Any], error: dict[str, Any] | None = None,
              incomplete_reason: str | None = None) -> tuple[bytes, dict[str, Any]]:
        """The events that end the stream, and the response as it ended."""
        out = self._closed(status)
        response = ended_as(self.response, status, self._items, usage, error, incomplete_reason, self.completed_at)
        return out + self._event(ENDED_EVENTS.get(status, "response.failed"), response=response), response

    def replayed(self, stored: dict[str, Any]) -> bytes:
        """A whole stored response's events (one asked for again): each item written in one piece,
        with the ids it was stored with, and the stored response last."""
        out = self.started()
        for item in stored["output"]:
            if item["type"] == "message":
                part = item["content"][0]
                out += self.text(part["text"], part.get("logprobs"), item["id"])
            else:
                out += self.call(len(self._calls), item["call_id"], item["name"], item["arguments"], item["id"])
        status = stored["status"]
        return out + self._closed(status) + self._event(ENDED_EVENTS.get(status, "response.failed"), response=stored)

    def error(self, error: dict[str, Any]) -> bytes:
        """An error that ends the stream before the response could (OpenAI's ``error`` event):
        ``error`` is an OpenAI error's ``error`` object."""
        return self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))
