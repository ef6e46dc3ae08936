"""vLLM's bad words of more than one token for the slot batching (hf_slots.py); a one-token word
is ruled out in its slot's bias row (hf_slot_bias.py). The rule is engines/bad_words.py's: a
word's last token is ruled out wherever the output's last tokens are the rest of it.

Each slot with such words keeps its output's last tokens on the device (a window as long as the
longest word less one), shifted with each step's picks there: the steps run ahead of the host,
which learns a step's tokens only after the next step is queued, so the check cannot wait for
them. A step compares every (slot, word) pair's window with the word at once and adds -inf to the
logit of each matching word's last token: no host work and no sync a step. The windows and the
table of words are made at the first request with such a word, and cost nothing while no running
sequence has one. A taken-over sequence's window starts with its published output."""

from __future__ import annotations

from typing import Any


class SlotBadWords:
    def __init__(self, slots: int, device: Any) -> None:
        import torch

        self._torch = torch
        self._slots, self._device = slots, device
        self._words: dict[int, tuple[tuple[int, ...], ...]] = {}  # slot: its words of two tokens or more
        self._recent: Any = None  # [slots, width]: each slot's last output tokens (-1: none yet)
        self._width = 0
        self._table: tuple[Any, Any, Any, Any] | None = None  # the running words, compiled (``_compiled``)
        self._row_of: Any = None  # [slots]: each slot's row in a step's logits (-1: none), rewritten each step
        self._rows: Any = None  # [slots]: 0, 1, 2, ... (a step's rows, its first ones)

    def admitted(self, slot: int, words: tuple[tuple[int, ...], ...], published: list[int]) -> None:
        """A request takes ``slot``: its bad words' token sequences (the one-token ones are the bias
        row's), its window starting with the output already ``published`` (a taken-over sequence's)."""
        self.released(slot)
        longer = tuple(word for word in words if len(word) > 1)
        if not longer:
            return
        torch = self._torch
        width = max(len(word) - 1 for word in longer)
        if width > self._width:
            grown = torch.full((self._slots, width), -1, dtype=torch.long, device=self._device)
            if self._recent is not None:
                grown[:, width - self._width:] = self._recent
            self._recent, self._width = grown, width
        if self._row_of is None:
            self._row_of = torch.full((self._slots,), -1, dtype=torch.long, device=self._device)
            self._rows = torch.arange(self._slots, device=self._device)
        self._recent[slot].fill_(-1)
        tail = published[len(published) - self._width:] if published else []
        if tail:
            self._recent[slot, self._width - len(tail):] = torch.tensor(tail, device=self._device)
        self._words[slot] = longer
        self._table = None

    def released(self, slot: int) -> None:
        if self._words.pop(slot, None) is not None:
            self._table = None

    def _compiled(self) -> tuple[Any, Any, Any, Any]:
        """Every running (slot, word) pair: its slot, the word less its last token right-aligned in
        the window's width, which of those places it needs, and its last token."""
        if self._table is None:
            torch, width = self._torch, self._width
            pairs = [(slot, word) for slot, words in self._words.items() for word in words]
            rest = torch.full((len(pairs), width), -1, dtype=torch.long)
            needed = torch.zeros((len(pairs), width), dtype=torch.bool)
            for i, (_, word) in enumerate(pairs):
                rest[i, width - len(word) + 1:] = torch.tensor(word[:-1])
                needed[i, width - len(word) + 1:] = True
            self._table = (torch.tensor([slot for slot, _ in pairs], device=self._device), rest.to(self._device),
                           needed.to(self._device), torch.tensor([word[-1] for _, word in pairs], device=self._device))
        return self._table

    def apply(self, logits: Any, slots: Any) -> Any:
        """The logits of the rows whose slots are ``slots``, with -inf for each word's last token in
        the rows whose window ends with the rest of the word."""
        if not self._words:
            return logits
        torch = self._torch
        pair_slots, rest, needed, last = self._compiled()
        matched = ((self._recent[pair_slots] == rest) | ~needed).all(-1)
        row_of = self._row_of.fill_(-1)  # kept, not made a step: two small allocations less
        row_of[slots] = self._rows[:slots.shape[0]]
        rows = row_of[pair_slots]
        ruled_out = torch.where(matched & (rows >= 0), float("-inf"), 0.0)
        # Added, not set: pairs of slots with no row here add 0 to row 0, and two pairs may name one place.
        return logits.float().index_put((rows.clamp(min=0), last), ruled_out, accumulate=True)

    def picked(self, slots: Any, ids: Any) -> None:
        """Each row's picked token, at the end of its slot's window."""
        if self._words:
            self._recent[slots] = self._torch.cat([self._recent[slots, 1:], ids[:, None]], dim=1)
