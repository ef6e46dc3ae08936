"""Output moderation's view of each open token stream: the last few hundred characters,
so that a phrase split across token events is found when its last piece arrives."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenbus.moderation import Finding, Policy
from tokenbus.schemas import TokenEvent

MAX_OPEN_STREAMS = 100_000  # streams whose final event never comes are forgotten oldest first


@dataclass(slots=True)
class _Stream:
    tail: str = ""
    reported: set[str] = field(default_factory=set)


class StreamWindows:
    def __init__(self, policy: Policy, max_open: int = MAX_OPEN_STREAMS) -> None:
        self._policy = policy
        self._max_open = max_open
        self._open: OrderedDict[str, _Stream] = OrderedDict()
        self._stopped: OrderedDict[str, None] = OrderedDict()

    @property
    def open_streams(self) -> int:
        return len(self._open)

    def feed(self, event: TokenEvent) -> list[Finding]:
        """New findings this event completes; each category is reported once per stream."""
        request_id = event.request_id
        if event.truncate or request_id in self._stopped:
            return []
        stream = self._open.get(request_id)
        if stream is None:
            stream = self._open[request_id] = _Stream()
            if len(self._open) > self._max_open:
                self._open.popitem(last=False)
        # A function call's arguments are text a policy can match, as much as the reply's words.
        text = stream.tail + event.text + "".join(d.arguments for d in event.tool_calls)
        # Only matches that reach into the new text are new; older ones were seen before.
        findings = [f for f in self._policy.scan(text, "output", new_from=len(stream.tail))
                    if f.category not in stream.reported and (f.end is None or f.end > len(stream.tail))]
        stream.tail = text[-self._policy.window_chars:]
        stream.reported.update(f.category for f in findings)
        if event.is_final:
            del self._open[request_id]
        return findings

    def stop(self, request_id: str) -> None:
        """The stream was truncated: ignore whatever of it still arrives."""
        self._open.pop(request_id, None)
        self._stopped[request_id] = None
        if len(self._stopped) > self._max_open:
            self._stopped.popitem(last=False)
