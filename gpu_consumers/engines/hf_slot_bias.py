"""OpenAI's logit bias, and vLLM's ``allowed_token_ids`` and one-token bad words, for the slot
batching (hf_slots.py).

Each slot's bias over the vocabulary is a row kept on the device, added to the logits before the
penalties and the pick, as vLLM adds it: a dense row, so a step adds every biased row's in one
operation, with no host work while the set of biased slots stays the same. The rows are made at
the first biased request (slots x vocabulary floats) and cost nothing while no running sequence
is biased. A request that allows some tokens alone has -inf in its row for every other one (the
same row, so it costs nothing more)."""

from __future__ import annotations

from typing import Any, Protocol

from tokenbus.gpu_consumers.engines.bias_rows import write_bias_row


class Biased(Protocol):
    slot: int
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias), ids in the vocabulary
    allowed_ids: tuple[int, ...]  # the only tokens it may pick (empty: any)
    banned_ids: tuple[int, ...]  # tokens it may never pick (vLLM's bad words of one token)


class SlotBias:
    def __init__(self, slots: int, device: Any) -> None:
        import torch

        self._torch = torch
        self._slots, self._device = slots, device
        self._bias: Any = None  # [slots, vocabulary]
        self._biased: set[int] = set()  # the slots whose sequence has a bias

    def admitted(self, request: Biased, vocabulary: int) -> None:
        """``request`` takes its slot: its bias row written (-inf for the tokens it does not allow)."""
        torch, slot = self._torch, request.slot
        if not request.logit_bias and not request.allowed_ids and not request.banned_ids:
            self.released(slot)
            return
        if self._bias is None:
            self._bias = torch.zeros(self._slots, vocabulary, device=self._device)
        write_bias_row(self._bias[slot], request.logit_bias, request.allowed_ids, request.banned_ids)
        self._biased.add(slot)

    def released(self, slot: int) -> None:
        if slot in self._biased:
            self._biased.discard(slot)
            self._bias[slot].zero_()

    def apply(self, logits: Any, slots: Any) -> Any:
        """The logits of the rows whose slots are ``slots``, each plus its slot's bias."""
        if not self._biased:
            return logits
        return logits.float() + self._bias[slots]
