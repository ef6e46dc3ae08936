"""Sampling for the slot batching (hf_slots.py), on the device: each row's token drawn with its
request's own temperature, vLLM's min-p and top-k, then top-p, by the inverse of its distribution at
a uniform number. The engine's generator gives that number, or, for a request with a ``seed``, a
hash of the seed and the token's place in the output: a seeded request so samples the same tokens
whichever sequences share its steps, and a taken-over one (its output's first tokens already
published) continues as the uninterrupted one would have: OpenAI's ``seed``, kept across a crashed
worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Sampled(Protocol):
    temperature: float
    top_p: float
    top_k: int  # 0: all
    min_p: float  # 0: all
    seed: int | None
    drawn: int  # the output's tokens before the next one sampled


class SlotSampler:
    def __init__(self, device: Any, seed: int | None = None) -> None:
        import torch

        self._torch = torch
        self.device = device
        self._generator = torch.Generator(device=device)
        if seed is not None:
            self._generator.manual_seed(seed)

    def sample(self, logits: Any, by_row: Sequence[Sampled | None]) -> Any:
        """Each row's token, on the device: sampled with its request's settings (``by_row``; None: a
        row no request holds, sampled plainly), each request's ``drawn`` counted on."""
        torch = self._torch
        temperature = [max(r.temperature, 1e-5) if r else 1.0 for r in by_row]
        top_p = [r.top_p if r else 1.0 for r in by_row]
        probs = torch.softmax(logits.float() / torch.tensor(temperature, device=self.device)[:, None], dim=-1)
        probs = self._keep_likeliest(probs, by_row)
        if min(top_p) < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > torch.tensor(top_p, device=self.device)[:, None]
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        uniform = torch.rand(len(by_row), generator=self._generator, device=self.device)
        seeded = []
        for row, r in enumerate(by_row):
            if r is not None:
                if r.seed is not None:
                    seeded.append((row, seeded_uniform(r.seed, r.drawn)))
                r.drawn += 1
        if seeded:
            rows, draws = zip(*seeded, strict=True)
            uniform[torch.tensor(rows, device=self.device)] = torch.tensor(draws, device=self.device)
        # The first token whose cumulative probability reaches the uniform's share of the total (the
        # total, not 1: rounding leaves it a little off); above zero, so never one of probability zero.
        cumulative = probs.cumsum(-1)
        share = (uniform * cumulative[:, -1]).clamp_(min=torch.finfo(torch.float32).tiny)
        return torch.searchsorted(cumulative, share[:, None])[:, 0]

    def _keep_likeliest(self, probs: Any, by_row: Sequence[Sampled | None]) -> Any:
        """vLLM's ``min_p`` and ``top_k`` of each row's request: the tokens under ``min_p`` of the
        row's likeliest token's probability, and those past its ``top_k`` likeliest (ties at the
        k-th kept), left out, the rest renormalized (as vLLM's, before top-p)."""
        torch = self._torch
        min_p = [r.min_p if r else 0.0 for r in by_row]
        top_k = [r.top_k if r and r.top_k else 0 for r in by_row]
        if not any(min_p) and not any(top_k):
            return probs
        if any(min_p):
            floor = probs.max(-1, keepdim=True).values * torch.tensor(min_p, device=self.device)[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        if any(top_k):
            vocabulary = probs.shape[-1]
            k = torch.tensor([min(k, vocabulary) if k else vocabulary for k in top_k], device=self.device)
            kth = probs.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
            probs = probs.masked_fill(probs < kth, 0.0)
        return probs / probs.sum(-1, keepdim=True)


_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, place: int) -> float:
    """A uniform number in [0, 1) that depends only on ``seed`` and ``place`` (SplitMix64's mix of
    the two, as a 24-bit fraction: a float32 holds it exactly, so below 1): the same on every host,
    in every batch."""
    z = (seed + (place + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 40) * 2.0**-24
