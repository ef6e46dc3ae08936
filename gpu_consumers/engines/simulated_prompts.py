"""The simulated engine's prompts (engines/simulated.py): its tokenizer, a token per word plus a
few for each message's and function's template, and its model of a paged engine's prefix cache:
a prompt cut into blocks of ``kv_block_tokens`` named by chain hashes, the leading blocks already
held not prefilled again, the most recently used ``prefix_cache_tokens`` kept and reported for
KV-cache-aware routing."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from tokenbus.gpu_consumers.engines.base import GenerationInput, PromptLayout
from tokenbus.gpu_consumers.engines.blocks import block_hashes, leading_held
from tokenbus.schemas import message_text

TEMPLATE_TOKENS = 4  # a message's or a function's markup in the prompt


def _token_id(piece: str) -> int:
    return zlib.crc32(piece.encode())


def tokenize_prompt(inp: GenerationInput) -> tuple[list[int], list[int]]:
    """``template_tokens``, left-truncated where the request asks (vLLM's ``truncate_prompt_tokens``:
    the last tokens alone, which begin at no segment's start)."""
    ids, ends = template_tokens(inp)
    if inp.truncate_prompt_tokens is not None:
        return ids[-inp.truncate_prompt_tokens:], []
    return ids, ends


def template_tokens(inp: GenerationInput) -> tuple[list[int], list[int]]:
    """The simulated tokenizer: a token per word plus a few for each function's and message's
    template, functions first (a text prompt's words alone, or the token ids it was given); returns
    the ids and where each segment (schemas/prefixes.py) ends."""
    ids: list[int] = []
    ends: list[int] = []

    def add(kind: str, text: str) -> None:
        ids.extend(_token_id(f"<{kind}:{i}>") for i in range(TEMPLATE_TOKENS))
        ids.extend(_token_id(word) for word in text.split())

    if inp.prompt_token_ids:  # a text prompt given as token ids: those
        return list(inp.prompt_token_ids), [len(inp.prompt_token_ids)]
    if inp.text_prompt:  # no template: the words alone
        ids.extend(_token_id(word) for word in inp.messages[0].content.split())
        return ids, [len(ids)]
    if inp.offers_tools:
        for t in inp.tools:
            add("function", t.text)
        ends.append(len(ids))
    for m in inp.messages:
        add(m.role, message_text(m))
        ends.append(len(ids))
    return ids, ends


def count_prompt_tokens(inp: GenerationInput) -> int:
    return len(tokenize_prompt(inp)[0])


class LastPrompt:
    """``tokenize_prompt``, remembering the last prompt: the worker asks the engine for a request's
    generation and its prefix cache for the request's layout back to back, and a real engine
    tokenizes the prompt once for both (engines/chat_template.py's ``PromptTokens``)."""

    def __init__(self) -> None:
        self._last: tuple[tuple[Any, ...], tuple[list[int], list[int]]] | None = None

    def __call__(self, inp: GenerationInput) -> tuple[list[int], list[int]]:
        key = inp.prompt_key
        if self._last is None or self._last[0] != key:
            self._last = (key, tokenize_prompt(inp))
        return self._last[1]


class PrefixCacheModel:
    """The most recently used prompt blocks, up to a capacity; a prompt reuses its leading held blocks.

    The last layout is remembered: the engine names a prompt's blocks when it admits the prompt,
    and the worker asks for the same input's layout right after (gpu_consumers/prefix_reports.py),
    so the blocks are hashed once a request."""

    def __init__(self, capacity_tokens: int, block_tokens: int,
                 tokenize: Callable[[GenerationInput], tuple[list[int], list[int]]] = tokenize_prompt) -> None:
        self.block_tokens = block_tokens
        self._tokenize = tokenize
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._last: tuple[GenerationInput, PromptLayout] | None = None

    def layout(self, inp: GenerationInput) -> PromptLayout:
        if self._last is not None and self._last[0] is inp:
            return self._last[1]
        ids, ends = self._tokenize(inp)
        layout = PromptLayout(self.block_tokens, block_hashes(ids, self.block_tokens), tuple(ends))
        self._last = (inp, layout)
        return layout

    def resident(self, hashes: Iterable[int]) -> set[int]:
        return {h for h in hashes if h in self._blocks}

    def admit(self, hashes: tuple[int, ...], prompt_tokens: int) -> int:
        """Prefill a prompt of these blocks: returns its tokens served from the cache (never the whole
        prompt: its last token is always computed) and keeps its blocks, evicting the least used."""
        hit = leading_held(hashes, self._blocks)
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return min(hit * self.block_tokens, max(0, prompt_tokens - 1))
