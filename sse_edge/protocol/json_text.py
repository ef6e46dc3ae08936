"""JSON written as text on the streaming hot path (a content chunk per token, its log
probabilities): the values, encoded as ``json.dumps`` writes them, without building an encoder
per call as ``json.dumps`` does with any option."""

from __future__ import annotations

import json
import math

json_string = json.JSONEncoder(ensure_ascii=False).encode


def json_float(value: float) -> str:
    """As json.dumps writes a float: its repr (a log probability of a token the logits rule out is
    -inf, which json writes -Infinity, as Python's readers take it)."""
    return float.__repr__(value) if math.isfinite(value) else json.dumps(value)
