"""Streaming text: token ids to text deltas, and stop sequences that never leak into the output."""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, token_ids: tuple[int, ...] = (), emitted: str = "") -> None:
        self._tokenizer = tokenizer
        self.token_ids = list(token_ids)
        self.emitted = emitted  # text already given out, e.g. by a previous worker

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty while a character is split)."""
        self.token_ids.extend(new_ids)
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        if not text.startswith(self.emitted):
            # A merge rewrote text already sent; never take back what the client has.
            common = 0
            while common < min(len(text), len(self.emitted)) and text[common] == self.emitted[common]:
                common += 1
            text = self.emitted + text[common:]
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta


class StopFilter:
    """Holds back text that could still turn into a stop sequence, so that no text at or after
    a stop sequence is ever sent, even when the stop spans several deltas."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text safe to send now, and whether a stop sequence was reached."""
        buffer = self._held + delta
        hits = [i for stop in self._stops if (i := buffer.find(stop)) != -1]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        safe = max(len(buffer) - self._hold, 0)
        self._held = buffer[safe:]
        return buffer[:safe], False

    def flush(self) -> str:
        """At the end of the sequence nothing can become a stop any more."""
        held, self._held = self._held, ""
        return held
