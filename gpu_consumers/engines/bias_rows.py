"""A request's logit bias and vLLM's ``allowed_token_ids`` as one row over the vocabulary, added to
its logits before the pick: the one way both torch engines make it (the hf slots' rows,
hf_slot_bias.py; TensorRT-LLM's logits processor, trtllm.TokenBias)."""

from __future__ import annotations

from typing import Any


def write_bias_row(row: Any, biases: tuple[tuple[int, float], ...], allowed: tuple[int, ...],
                   banned: tuple[int, ...] = ()) -> None:
    """Write into ``row`` (a float tensor, one value a token): 0, or -inf for every token not in
    ``allowed`` where it names any, plus each (token id, bias); -inf for each ``banned`` token (a
    one-token bad word's, engines/bad_words.py)."""
    import torch

    if allowed:
        row.fill_(float("-inf"))
        row[torch.tensor(allowed, device=row.device)] = 0.0
    else:
        row.zero_()
    if biases:
        ids, values = zip(*biases, strict=True)
        row[torch.tensor(ids, device=row.device)] += torch.tensor(values, device=row.device, dtype=row.dtype)
    if banned:
        row[torch.tensor(banned, device=row.device)] = float("-inf")
