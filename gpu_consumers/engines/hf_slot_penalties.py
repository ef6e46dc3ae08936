"""OpenAI's presence and frequency penalties for the slot batching (hf_slots.py).

Each slot's count of every token its output holds is kept on the device beside the cache, taken
off the logits before a token is picked and added to right after, on the device: the steps run
ahead of the host, which learns a step's tokens only after the next step is queued. The counts
are made at the first penalized request (slots x vocabulary floats) and cost nothing while no
running sequence is penalized. A taken-over sequence's published output, the end of its prompt
here, is counted as output: it continues as the uninterrupted one would have."""

from __future__ import annotations

from typing import Any, Protocol


class Penalized(Protocol):
    slot: int
    prompt: list[int]
    drawn: int  # of the prompt's last tokens, how many are output already published
    presence_penalty: float
    frequency_penalty: float


class SlotPenalties:
    def __init__(self, slots: int, device: Any) -> None:
        import torch

        self._torch = torch
        self._slots, self._device = slots, device
        self._counts: Any = None  # [slots, vocabulary]
        self._presence = torch.zeros(slots, device=device)
        self._frequency = torch.zeros(slots, device=device)
        self._rows = torch.arange(slots, device=device)
        self._penalized: set[int] = set()  # the slots whose sequence has a penalty

    def rows(self, count: int) -> Any:
        """The slots of a decode step's first ``count`` rows (a row is its slot)."""
        return self._rows[:count]

    def admitted(self, request: Penalized, vocabulary: int) -> None:
        """``request`` takes its slot: its penalties, and its published output counted."""
        torch, slot = self._torch, request.slot
        if not (request.presence_penalty or request.frequency_penalty):
            self.released(slot)
            return
        if self._counts is None:
            self._counts = torch.zeros(self._slots, vocabulary, device=self._device)
        self._counts[slot].zero_()
        if request.drawn:
            published = torch.tensor(request.prompt[-request.drawn:], device=self._device)
            self._counts[slot].index_add_(0, published, torch.ones(request.drawn, device=self._device))
        self._presence[slot] = request.presence_penalty
        self._frequency[slot] = request.frequency_penalty
        self._penalized.add(slot)

    def released(self, slot: int) -> None:
        if slot in self._penalized:
            self._penalized.discard(slot)
            self._presence[slot] = 0.0
            self._frequency[slot] = 0.0

    def apply(self, logits: Any, slots: Any) -> Any:
        """The logits of the rows whose slots are ``slots``, less each row's penalties."""
        if not self._penalized:
            return logits
        counts = self._counts[slots]
        return logits.float() - self._presence[slots, None] * (counts > 0) - self._frequency[slots, None] * counts

    def count(self, slots: Any, ids: Any) -> None:
        """Each row's picked token, counted for its slot (rows of slots with no penalty count too:
        a penalized request starts its slot's counts afresh)."""
        if self._penalized:
            self._counts.index_put_((slots, ids), self._torch.ones_like(ids, dtype=self._counts.dtype),
                                    accumulate=True)
