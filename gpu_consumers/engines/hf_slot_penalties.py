"""OpenAI's presence and frequency penalties, and vLLM's (and transformers') repetition penalty,
for the slot batching (hf_slots.py).

Each slot's count of every token its output holds is kept on the device beside the cache, taken
off the logits before a token is picked and added to right after, on the device: the steps run
ahead of the host, which learns a step's tokens only after the next step is queued. The
repetition penalty counts the prompt's tokens too: a slot whose request has one keeps which tokens
its prompt or output holds, and each of their logits is divided by the penalty where positive and
multiplied by it where not, before the presence and frequency penalties come off (vLLM's order).
The counts and the marks are made at the first request that needs them (slots x vocabulary each)
and cost nothing while no running sequence is penalized. A taken-over sequence's published
output, the end of its prompt here, is counted as output: it continues as the uninterrupted one
would have."""

from __future__ import annotations

from typing import Any, Protocol


class Penalized(Protocol):
    slot: int
    prompt: list[int]
    drawn: int  # of the prompt's last tokens, how many are output already published
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


class SlotPenalties:
    def __init__(self, slots: int, device: Any) -> None:
        import torch

        self._torch = torch
        self._slots, self._device = slots, device
        self._counts: Any = None  # [slots, vocabulary]: each output token's count
        self._held: Any = None  # [slots, vocabulary]: the tokens the prompt or output holds
        self._presence = torch.zeros(slots, device=device)
        self._frequency = torch.zeros(slots, device=device)
        self._repetition = torch.ones(slots, device=device)
        self._rows = torch.arange(slots, device=device)
        self._counted: set[int] = set()  # the slots whose sequence has a presence or frequency penalty
        self._repeated: set[int] = set()  # the slots whose sequence has a repetition penalty

    def rows(self, count: int) -> Any:
        """The slots of a decode step's first ``count`` rows (a row is its slot)."""
        return self._rows[:count]

    def admitted(self, request: Penalized, vocabulary: int) -> None:
        """``request`` takes its slot: its penalties, its published output counted, and for a
        repetition penalty its prompt's tokens and output's marked."""
        torch, slot = self._torch, request.slot
        self.released(slot)
        if request.presence_penalty or request.frequency_penalty:
            if self._counts is None:
                self._counts = torch.zeros(self._slots, vocabulary, device=self._device)
            self._counts[slot].zero_()
            if request.drawn:
                published = torch.tensor(request.prompt[-request.drawn:], device=self._device)
                self._counts[slot].index_add_(0, published, torch.ones(request.drawn, device=self._device))
            self._presence[slot] = request.presence_penalty
            self._frequency[slot] = request.frequency_penalty
            self._counted.add(slot)
        if request.repetition_penalty != 1:
            if self._held is None:
                self._held = torch.zeros(self._slots, vocabulary, dtype=torch.bool, device=self._device)
            self._held[slot].zero_()
            self._held[slot, torch.tensor(request.prompt, device=self._device)] = True
            self._repetition[slot] = request.repetition_penalty
            self._repeated.add(slot)

    def released(self, slot: int) -> None:
        if slot in self._counted:
            self._counted.discard(slot)
            self._presence[slot] = 0.0
            self._frequency[slot] = 0.0
        if slot in self._repeated:
            self._repeated.discard(slot)
            self._repetition[slot] = 1.0

    def apply(self, logits: Any, slots: Any) -> Any:
        """The logits of the rows whose slots are ``slots``, past each row's penalties."""
        if self._repeated:
            logits = logits.float()
            penalty = self._repetition[slots, None]
            repeated = self._torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = self._torch.where(self._held[slots], repeated, logits)
        if self._counted:
            counts = self._counts[slots]
            logits = logits.float() - self._presence[slots, None] * (counts > 0) - self._frequency[slots, None] * counts
        return logits

    def count(self, slots: Any, ids: Any) -> None:
        """Each row's picked token, counted and marked for its slot (rows of slots with no penalty
        count too: a penalized request starts its slot's counts afresh)."""
        if self._counted:
            self._counts.index_put_((slots, ids), self._torch.ones_like(ids, dtype=self._counts.dtype),
                                    accumulate=True)
        if self._repeated:
            self._held[slots, ids] = True
