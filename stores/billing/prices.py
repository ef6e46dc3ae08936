"""The price table: USD per million input and output tokens, by model and tier."""

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

    @property
    def input_nanousd_per_token(self) -> int:
        return round(self.input_usd_per_mtok * NANO_USD_PER_USD / 1_000_000)

    @property
    def output_nanousd_per_token(self) -> int:
        return round(self.output_usd_per_mtok * NANO_USD_PER_USD / 1_000_000)


class PriceTable:
    def __init__(self, prices: list[Price]) -> None:
        self.prices = prices

    @classmethod
    def load(cls, path: Path | None = None) -> PriceTable:
        text = path.read_text() if path else resources.files("tokenbus.stores.billing").joinpath("prices.toml").read_text()
        return cls([Price(p["model"], p["tier"], float(p["input_usd_per_mtok"]), float(p["output_usd_per_mtok"]))
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

    def cost_nanousd(self, model: str, tier: str, prompt_tokens: int, completion_tokens: int) -> tuple[int, int]:
        p = self.price(model, tier)
        return prompt_tokens * p.input_nanousd_per_token, completion_tokens * p.output_nanousd_per_token
