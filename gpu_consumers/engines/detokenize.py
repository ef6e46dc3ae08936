"""Streaming text: token ids to text deltas, and stop sequences that never leak into the output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
INVALID_PREFIX = "Invalid prefix"  # how a decode stream says its window decoded differently (tokenizers' words)


class WindowDecodeStream:
    """tokenizers' ``DecodeStream`` for a tokenizer that has no Rust backend, step for step the same
    algorithm in Python: decode a short window (the tokens of the chunk given out last, as context
    at the boundary, plus the new ones); give out what it adds once it does not end inside a split
    character; then slide the window. Constant work per token, however long the output."""

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False) -> None:
        self._skip = skip_special_tokens
        self._ids = list(ids or ())  # the window: context tokens, then tokens not given out yet
        self._prefix = ""  # the context's text
        self._prefix_index = 0  # where the context ends in the window

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        decode, skip = tokenizer.decode, self._skip
        if not self._prefix and self._ids:  # primed (or context without text): it becomes the context
            prefix = decode(self._ids, skip_special_tokens=skip)
            if not prefix.endswith(REPLACEMENT_CHAR):
                self._prefix, self._prefix_index = prefix, len(self._ids)
        self._ids.append(token_id)
        text = decode(self._ids, skip_special_tokens=skip)
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT_CHAR):
            return None
        if not text.startswith(self._prefix):
            raise ValueError(f"{INVALID_PREFIX} encountered")
        new_text = text[len(self._prefix):]
        # What is given out now is the next step's context.
        self._ids, self._prefix_index = self._ids[self._prefix_index:], len(self._ids) - self._prefix_index
        self._prefix = decode(self._ids, skip_special_tokens=skip)
        return new_text


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` under a Hugging Face fast tokenizer, or under TensorRT-LLM's
    wrapper of one (``.tokenizer``); None where there is none, or where the tokenizer cleans up
    spaces after decoding, which the Rust decoder alone would not do."""
    for candidate in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        backend = getattr(candidate, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "decode"):
            return None if getattr(candidate, "clean_up_tokenization_spaces", False) else backend
    return None


class IncrementalDetokenizer:
    """Token ids to text deltas with constant work per token: a decode stream decodes only a short
    window (the tokens of the text given out last, for context at the boundary, plus the new ones)
    rather than the whole sequence, which made a long output quadratic. With a fast tokenizer the
    stream is tokenizers' own ``DecodeStream``, in Rust (~1 µs a token against ~9 µs for the same
    window decoded through ``tokenizer.decode``: this runs on the GPU consumer's event loop for
    every token of every sequence); otherwise ``WindowDecodeStream``, the same steps in Python.
    vLLM streams text the same way.

    ``token_ids`` and ``emitted`` may start with what a previous worker already produced and sent:
    decoding continues after them, and text already sent is never sent again. Text of those
    tokens that it held back (the start of a possible stop sequence, a function call's markup)
    was not sent: it comes out with the first push."""

    CONTEXT_TOKENS = 5  # tokens already read that prime a taken-over sequence's stream
    MAX_SPLIT_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so is split over at most 4 tokens

    def __init__(self, tokenizer: Any, token_ids: tuple[int, ...] = (), emitted: str = "") -> None:
        self._tokenizer = tokenizer
        self._rust = rust_tokenizer(tokenizer)
        self._decoder = tokenizer if self._rust is None else self._rust  # what the stream decodes with
        self.token_ids = list(token_ids)
        self._unsent = ""
        read, context = self._take_over(emitted) if self.token_ids else (0, 0)
        self._unread = self.token_ids[read:]  # a split character's first bytes: decoded with the first push
        self._stream = self._new_stream(self.token_ids[context:read])

    def _new_stream(self, primed: list[int]) -> Any:
        if self._rust is None:
            return WindowDecodeStream(primed, skip_special_tokens=True)
        from tokenizers.decoders import DecodeStream

        return DecodeStream(primed, skip_special_tokens=True)

    def _take_over(self, emitted: str) -> tuple[int, int]:
        """Continue after a previous worker's tokens: how many of them were read, and where the
        tokens that prime the stream start. Tokens that end inside a character gave out no text:
        they stay unread, to be decoded again with the tokens that complete the character (counted
        as read, that character would never come out). Text of the read tokens beyond ``emitted``
        was held back: it goes out with the first push."""
        decode = self._tokenizer.decode
        whole = decode(self.token_ids, skip_special_tokens=True)
        read = len(self.token_ids)
        while whole.endswith(REPLACEMENT_CHAR) and read > len(self.token_ids) - self.MAX_SPLIT_TOKENS:
            read -= 1
            whole = decode(self.token_ids[:read], skip_special_tokens=True)
        if whole.endswith(REPLACEMENT_CHAR):
            # Not a split character but bytes that never make one: read as they are, and no context
            # (a stream primed with text ending in them would give that text out again).
            return len(self.token_ids), len(self.token_ids)
        if whole.startswith(emitted):
            self._unsent = whole[len(emitted):]
        return read, max(0, read - self.CONTEXT_TOKENS)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._decoder, token_id)
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            # The window decoded to text that does not start with what it gave out before (a
            # tokenizer whose decoding is not monotonic): start a fresh window, as vLLM does.
            self._stream = self._new_stream([])
            return self._stream.step(self._decoder, token_id)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (empty while a character is still split).
        Several tokens at once (a reader that fell behind its engine) give out the characters
        they complete and keep back only the tokens of a character still split, which the last
        of them may start: read one by one, they would have given out the same."""
        self.token_ids += new_ids
        if self._unread:
            new_ids, self._unread = self._unread + list(new_ids), []
        if len(new_ids) == 1:  # nearly every push: a step's one token
            delta = self._step(new_ids[0])
        else:
            delta = "".join(text for text in map(self._step, new_ids) if text)
        if not delta:
            return ""  # still waiting for a whole character (held-back text waits with it)
        if self._unsent:
            delta, self._unsent = self._unsent + delta, ""
        return delta

    def flush(self) -> str:
        """Text a previous worker held back, when no push is coming to carry it: the sequence was
        taken over at its token limit."""
        unsent, self._unsent = self._unsent, ""
        return unsent


class StopFilter:
    """Holds back text that could still turn into a stop sequence, so that no text at or after
    a stop sequence is ever sent, even when the stop spans several deltas. None is looked for
    while the output holds fewer than ``min_tokens`` tokens (vLLM's rule: no stop condition ends an
    output before then), so none that ends before then ever stops it."""

    def __init__(self, stops: tuple[str, ...], min_tokens: int = 0, keep_stop: bool = False) -> None:
        """``keep_stop``: the stop sequence reached is sent too (vLLM's ``include_stop_str_in_output``)."""
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._min_tokens = min_tokens
        self._keep_stop = keep_stop

    def feed(self, delta: str, tokens: int | None = None) -> tuple[str, bool]:
        """The text safe to send now, and whether a stop sequence was reached; ``tokens``: the
        output's tokens with this delta's (None: enough)."""
        if not self._stops:  # nothing is ever held back (most requests, every token of them)
            return delta, False
        if tokens is not None and tokens < self._min_tokens:  # (nothing is held back before then)
            return delta, False
        buffer = self._held + delta
        hits = [(i, i + len(stop)) for stop in self._stops if (i := buffer.find(stop)) != -1]
        if hits:
            self._held = ""
            # The first to end: the one a token-by-token feed would have met first.
            start, end = min(hits, key=lambda hit: (hit[1], hit[0]))
            return buffer[: end if self._keep_stop else start], True
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


class TokenTexts:
    """Each token's text on its own, as log probabilities name it (vLLM's too): a token that holds
    part of a character decodes to U+FFFD, and the stream's text, decoded whole, stays the truth.
    Decoded once a token and remembered (at most the vocabulary): a step's scores name up to 21
    tokens a sequence, and a tokenizer's decode costs microseconds a call."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self._tokenizer.decode([token_id]))
        return text
