"""A model's context window: counting a prompt's tokens, refusing a prompt that cannot fit, and
choosing the stored turns that fit before a request's new messages; and, with the model's
tokenizer, reading a prompt given as token ids.

Tokens are counted with the model's tokenizer where one is configured for the edge
(``TOKENBUS_EDGE_TOKENIZERS``: a ``tokenizer.json``), and estimated otherwise the way every
part of tokenbus estimates (``schemas.estimate_prompt_tokens``: about four characters a token,
plus a few a message for its template).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenbus.schemas import ChatMessage, estimate_prompt_tokens, message_text
from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.sse_edge.plumbing.history import History, StoredTurn
from tokenbus.sse_edge.protocol.compaction import SUMMARY_PREFIX
from tokenbus.sse_edge.settings import EdgeSettings

MESSAGE_OVERHEAD = 4  # tokens a chat template adds around each message (as the estimate counts)


class ContextWindows:
    def __init__(self, settings: EdgeSettings) -> None:
        self._windows = settings.context_windows
        self._default_window = settings.default_context_window
        self._tokenizers: dict[str, Any] = {}
        for model, path in settings.tokenizers.items():
            from tokenizers import Tokenizer

            self._tokenizers[model] = Tokenizer.from_file(str(Path(path)))

    def window(self, model: str) -> int:
        return self._windows.get(model, self._default_window)

    def limits(self, model: str) -> bool:
        """Whether a window is configured for ``model`` (every request is then checked against it)."""
        return model in self._windows

    def count(self, model: str, messages: Sequence[ChatMessage]) -> int:
        return self.count_texts(model, [message_text(m) for m in messages])

    def count_texts(self, model: str, texts: Sequence[str]) -> int:
        """The tokens of a prompt's parts (a message's text, a tool's), each with its template's."""
        tokenizer = self._tokenizers.get(model)
        if tokenizer is None:
            return estimate_prompt_tokens(texts)
        return sum(len(tokenizer.encode(text).ids) + MESSAGE_OVERHEAD for text in texts)

    def decode(self, model: str, token_ids: Sequence[int]) -> str:
        """A prompt given as ``model``'s token ids, as text (special tokens included): what moderation,
        the transcript and an echo read. Only with the model's tokenizer here: without it the ids
        cannot be read, and a prompt nobody can read is not published."""
        tokenizer = self._tokenizers.get(model)
        if tokenizer is None:
            raise InvalidRequest(f"Prompts of token ids are served where the edge has the model's tokenizer "
                                 f"(TOKENBUS_EDGE_TOKENIZERS), which `{model}` has not here: send the prompt as text.",
                                 param="prompt", code="unsupported_value")
        size = tokenizer.get_vocab_size()
        outside = next((token_id for token_id in token_ids if token_id >= size), None)
        if outside is not None:
            raise InvalidRequest(f"Token id {outside} is not in the vocabulary of `{model}` (0 to {size - 1}).",
                                 param="prompt", code="invalid_value")
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def check(self, model: str, prompt_tokens: int, max_tokens: int | None, param: str = "messages") -> None:
        """A prompt that cannot fit, with the completion it asks for, is refused as OpenAI refuses it."""
        window = self.window(model)
        completion = max_tokens or 0
        if prompt_tokens + completion > window:
            raise InvalidRequest(
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{prompt_tokens + completion} tokens ({prompt_tokens} in the {param}, {completion} in the "
                f"completion). Please reduce the length of the {param} or completion.",
                param=param, code="context_length_exceeded")

    def check_messages(self, model: str, messages: Sequence[ChatMessage], max_tokens: int | None,
                       param: str = "messages", truncate: int | None = None) -> None:
        """Where ``model`` has a window, ``check`` ``messages`` (counted only then), of which the
        engine keeps the last ``truncate`` tokens where given (vLLM's ``truncate_prompt_tokens``)."""
        if self.limits(model):
            self.check(model, kept(self.count(model, messages), truncate), max_tokens, param)

    def reserve(self, model: str, max_tokens: int | None) -> int:
        """Tokens kept free for the answer: ``max_tokens``, or a quarter of the window when unset."""
        return max_tokens if max_tokens is not None else self.window(model) // 4

    def with_history(self, model: str, messages: list[ChatMessage], history: History,
                     max_tokens: int | None) -> tuple[list[ChatMessage], list[StoredTurn]]:
        """``messages`` with the newest stored turns that fit placed before them (after their
        leading system and developer messages), and the turns left out. A turn goes whole or not
        at all, and once one does not fit no older one is taken. Where turns are left out and the
        conversation has a summary, it goes first (it is budgeted first)."""
        lead = 0
        while lead < len(messages) and messages[lead].role in ("system", "developer"):
            lead += 1
        prompt = self.count(model, messages)
        self.check(model, prompt, max_tokens)
        budget = self.window(model) - self.reserve(model, max_tokens) - prompt
        summary = [ChatMessage("system", SUMMARY_PREFIX + history.summary.content)] if history.summary else []
        summary_cost = self.count(model, summary) if summary else 0
        if summary_cost > budget or self.count(model, [m for t in history.turns for m in t.messages]) <= budget:
            summary, summary_cost = [], 0  # it does not fit, or every turn does
        budget -= summary_cost
        chosen: list[StoredTurn] = []
        for turn in reversed(history.turns):
            cost = self.count(model, turn.messages)
            if cost > budget:
                break
            chosen.append(turn)
            budget -= cost
        chosen.reverse()
        dropped = history.turns[:len(history.turns) - len(chosen)]
        turns = [m for turn in chosen for m in turn.messages]
        return [*messages[:lead], *(summary if dropped else []), *turns, *messages[lead:]], dropped


def kept(prompt_tokens: int, truncate: int | None) -> int:
    """The prompt tokens an engine keeps of ``prompt_tokens``: the last ``truncate`` where given."""
    return prompt_tokens if truncate is None else min(prompt_tokens, truncate)
