"""Streaming text: token ids to text deltas, and stop sequences that never leak into the output."""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Token ids to text deltas with constant work per step: each push decodes only a short window
    (a few tokens already emitted, for context at the boundary, plus the new ones) rather than the
    whole sequence, which made a long output quadratic. This is how vLLM and TGI stream text.

    ``token_ids`` and ``emitted`` may start with what a previous worker already produced and sent:
    decoding continues after them, and text already sent is never sent again. Text of those
    tokens that it held back (the start of a possible stop sequence, a function call's markup)
    was not sent: it comes out with the first push."""

    CONTEXT_TOKENS = 5  # emitted tokens decoded again as context for the first new one
    MAX_SPLIT_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so is split over at most 4 tokens

    def __init__(self, tokenizer: Any, token_ids: tuple[int, ...] = (), emitted: str = "") -> None:
        self._tokenizer = tokenizer
        self.token_ids = list(token_ids)
        self.emitted = emitted  # text given out so far
        self._read = len(self.token_ids)  # tokens whose text is in ``emitted``
        self._unsent = ""
        if self.token_ids:
            self._take_over(emitted)
        self._context = max(0, self._read - self.CONTEXT_TOKENS)  # where the decoded window starts

    def _take_over(self, emitted: str) -> None:
        """Continue after a previous worker's tokens. Tokens that end inside a character gave out
        no text: they stay unread, to be decoded again with the tokens that complete the character
        (counted as read, that character would never come out). Text of the read tokens beyond
        ``emitted`` was held back: it goes out with the first push."""
        decode = self._tokenizer.decode
        whole = decode(self.token_ids, skip_special_tokens=True)
        read = len(self.token_ids)
        while whole.endswith(REPLACEMENT_CHAR) and read > len(self.token_ids) - self.MAX_SPLIT_TOKENS:
            read -= 1
            whole = decode(self.token_ids[:read], skip_special_tokens=True)
        if whole.endswith(REPLACEMENT_CHAR):
            return  # not a split character but bytes that never make one: read them as they are
        self._read = read
        if whole.startswith(emitted):
            self._unsent, self.emitted = whole[len(emitted):], whole

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text they complete (empty while a character is still split).
        Several tokens at once (a reader that fell behind its engine) give out the characters
        they complete and keep back only the tokens of a character still split, which the last
        of them may start: read one by one, they would have given out the same."""
        unsent, self._unsent = self._unsent, ""
        self.token_ids.extend(new_ids)
        decode = self._tokenizer.decode
        known = decode(self.token_ids[self._context:self._read], skip_special_tokens=True)
        end = len(self.token_ids)
        while end > max(self._read, len(self.token_ids) - self.MAX_SPLIT_TOKENS):
            text = decode(self.token_ids[self._context:end], skip_special_tokens=True)
            if len(text) > len(known) and not text.endswith(REPLACEMENT_CHAR):
                break
            end -= 1
        else:
            self._unsent = unsent  # still waiting for a whole character
            return ""
        delta = text[len(known):]
        self._context, self._read = self._read, end
        self.emitted += delta
        return unsent + delta

    def flush(self) -> str:
        """Text a previous worker held back, when no push is coming to carry it: the sequence was
        taken over at its token limit."""
        unsent, self._unsent = self._unsent, ""
        return unsent


class StopFilter:
    """Holds back text that could still turn into a stop sequence, so that no text at or after
    a stop sequence is ever sent, even when the stop spans several deltas."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text safe to send now, and whether a stop sequence was reached."""
        if not self._stops:  # nothing is ever held back (most requests, every token of them)
            return delta, False
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


def held_back_text(detokenizer: IncrementalDetokenizer, stops: StopFilter) -> str:
    """The whole text of a sequence taken over at its token limit: what its previous worker held
    back (the start of a possible stop sequence), which no later token can turn into one now."""
    text, _ = stops.feed(detokenizer.flush())
    return text + stops.flush()
