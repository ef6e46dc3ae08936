"""When requests are sent: all at once, or at a rate with a burstiness factor (vLLM's model).

Gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``:
burstiness 1 is a Poisson process, below 1 burstier, above 1 more even.
"""

from __future__ import annotations

import math
import random


def arrival_gaps(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    if math.isinf(rate) or rate <= 0:
        return [0.0] * count
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(count)]
