"""The price table: USD per million input, cached input and output tokens, by model and tier.

Cached input tokens are prompt tokens an engine served from its prefix cache (OpenAI's
``cached_tokens``): they cost the engine almost nothing to prefill, so they are priced on their
own, at the input price where an entry names no cached price."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

NANO_USD_PER_USD = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Price:
    model: str
    tier: str
    input_usd_per_mtok: float
    output_usd_per_mtok: float
    cached_input_usd_per_mtok: float | None = None  # None: the input price

    @property
    def input_nanousd_per_token(self) -> int:
        return round(self.input_usd_per_mtok * NANO_USD_PER_USD / 1_000_000)

    @property
    def cached_input_usd(self) -> float:
        return self.input_usd_per_mtok if self.cached_input_usd_per_mtok is None else self.cached_input_usd_per_mtok

    @property
    def cached_input_nanousd_per_token(self) -> int:
        return round(self.cached_input_usd * NANO_USD_PER_USD / 1_000_000)

    @property
    def output_nanousd_per_token(self) -> int:
        return round(self.output_usd_per_mtok * NANO_USD_PER_USD / 1_000_000)


class PriceTable:
    def __init__(self, prices: list[Price]) -> None:
        self.prices = prices

    @classmethod
    def load(cls, path: Path | None = None) -> PriceTable:
        text = path.read_text() if path else resources.files("tokenbus.stores.billing").joinpath("prices.toml").read_text()
        return cls([Price(p["model"], p["tier"], float(p["input_usd_per_mtok"]), float(p["output_usd_per_mtok"]),
                          float(p["cached_input_usd_per_mtok"]) if "cached_input_usd_per_mtok" in p else None)
                    for p in tomllib.loads(text).get("price", [])])

    def price(self, model: str, tier: str) -> Price:
        """The most specific entry: exact model and tier, then either one, then ``*``/``*``."""
        best: tuple[int, Price] | None = None
        for p in self.prices:
            if p.model not in (model, "*") or p.tier not in (tier, "*"):
                continue
            rank = (p.model == model) * 2 + (p.tier == tier)
            if best is None or rank > best[0]:
                best = (rank, p)
        return best[1] if best else Price(model, tier, 0.0, 0.0)

    def cost_nanousd(self, model: str, tier: str, prompt_tokens: int, completion_tokens: int,
                     cached_prompt_tokens: int = 0) -> tuple[int, int]:
        """(input, output) cost; ``cached_prompt_tokens`` of the prompt at the cached-input price."""
        p = self.price(model, tier)
        cached = min(cached_prompt_tokens, prompt_tokens)
        input_cost = (prompt_tokens - cached) * p.input_nanousd_per_token + cached * p.cached_input_nanousd_per_token
        return input_cost, completion_tokens * p.output_nanousd_per_token
