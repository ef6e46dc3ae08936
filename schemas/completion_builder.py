"""A turn's Completion from its token events: the one place it is built, by a GPU consumer as a
turn's events go by and by an edge that closes a stream nothing finishes
(``TokenbusClient.close_incomplete``)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenbus.schemas.records import ChatRequest, Completion, TokenEvent, ToolCall, ToolCallDelta


def whole_tool_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The function calls of a stream, put back together from their pieces."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = [delta.id, delta.name or "", ""]
        if delta.index in calls:
            calls[delta.index][2] += delta.arguments
    return [ToolCall(*calls[i]) for i in sorted(calls)]


class CompletionBuilder:
    """A turn's Completion, gathered as its token events go by: the one record that says how a turn
    ended. It keeps what the record needs of the events (their text, function-call pieces, times,
    the last one) rather than the events: a GPU consumer runs hundreds of turns at once, a token
    event each step."""

    __slots__ = ("count", "last", "_texts", "_deltas", "_started_at_ms", "_first_token_at_ms")

    def __init__(self, events: Iterable[TokenEvent] = ()) -> None:
        self.count = 0  # events added: the next one's seq
        self.last: TokenEvent | None = None
        self._texts: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._started_at_ms = 0
        self._first_token_at_ms: int | None = None
        for event in events:
            self.add(event)

    def add(self, event: TokenEvent) -> None:
        if self.last is None:
            self._started_at_ms = event.created_at_ms
        if event.token_ids and self._first_token_at_ms is None:
            self._first_token_at_ms = event.created_at_ms
        if event.text:
            self._texts.append(event.text)
        if event.tool_calls:
            self._deltas.extend(event.tool_calls)
        self.last = event
        self.count += 1

    def build(self, request: ChatRequest, worker_id: str) -> Completion:
        final = self.last
        if final is None:
            raise ValueError("a completion needs the turn's last token event")
        finish_reason = final.finish_reason or "error"
        return Completion.for_request(
            request,
            text=request.prefix_text + "".join(self._texts),
            tool_calls=whole_tool_calls(self._deltas),
            finish_reason=finish_reason,
            prompt_tokens=final.prompt_tokens or 0,
            completion_tokens=final.completion_tokens or 0,
            cached_prompt_tokens=final.cached_tokens or 0,
            cancelled=finish_reason in ("cancelled", "content_filter"),
            error=final.error,
            worker_id=worker_id,
            started_at_ms=self._started_at_ms,
            first_token_at_ms=self._first_token_at_ms,
            finished_at_ms=final.created_at_ms,
        )
