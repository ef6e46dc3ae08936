"""Log probabilities for the slot batching (hf_slots.py): where a running request asks for them
(``SamplingParams.logprobs``), its token's log probability under the logits it was picked from
(past the penalties, before temperature and top-p) and its ``logprobs`` likeliest tokens'; and
where one asks for its prompt's (``SamplingParams.prompt_logprobs``), each prompt token's under
the model's logits after the tokens before it, from its prefill (``prompt_scores``).

They are computed on the device with the step, for the rows that ask alone (a log-softmax and a
top-k of those rows: nothing for a step where no request asks), and read on the host with the
step's tokens: the host learns a step's tokens only after the next step is queued, and so its
scores."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# A token's id, its log probability, and (id, log probability) of the likeliest tokens in its place.
ScoredToken = tuple[int, float, list[tuple[int, float]]]


class Scoring(Protocol):
    request_id: str
    logprobs: int | None


@dataclass(slots=True)
class StepScores:
    """One step's scores, on the device: a row for each request that asks."""

    requests: list[Scoring]
    picked: Any  # [rows]
    chosen: Any  # [rows]: the picked token's log probability
    top_values: Any  # [rows, k], k the most any of them asks (None: none asks for any)
    top_ids: Any

    def on_host(self) -> dict[str, ScoredToken]:
        """By request id: its token, scored."""
        picked, chosen = self.picked.tolist(), self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else [[] for _ in picked]
        ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in picked]
        return {r.request_id: (picked[i], chosen[i], list(zip(ids[i][: r.logprobs], values[i][: r.logprobs], strict=True)))
                for i, r in enumerate(self.requests)}


def step_scores(logits: Any, picked: Any, rows: list[tuple[Scoring, int]]) -> StepScores | None:
    """The scores of the tokens ``picked`` off ``logits`` (one row each) for the requests of
    ``rows`` (request, row) that ask; None where none does."""
    asking = [(r, row) for r, row in rows if r.logprobs is not None]
    if not asking:
        return None
    import torch

    index = torch.tensor([row for _, row in asking], device=logits.device)
    scores = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    picked = picked.index_select(0, index)
    chosen = scores.gather(1, picked[:, None])[:, 0]
    k = max(r.logprobs or 0 for r, _ in asking)
    top_values, top_ids = scores.topk(k, dim=-1) if k else (None, None)
    return StepScores([r for r, _ in asking], picked, chosen, top_values, top_ids)


def prompt_scores(logits_of: Callable[[Any], Any], normed: Any, prompt: list[int], top: int) -> list[ScoredToken]:
    """Each of ``prompt``'s tokens after the first scored under the logits after the one before it
    (``logits_of`` the prefill's last-layer output at each prompt position, ``normed``), with its
    ``top`` likeliest; read to the host here. The logits are made ``PROMPT_CHUNK`` positions at a
    time: a long prompt's all at once would be length x vocabulary floats (8,192 x 128,256, 4 GiB)."""
    import torch

    scored: list[ScoredToken] = []
    for start in range(0, len(prompt) - 1, PROMPT_CHUNK):
        end = min(start + PROMPT_CHUNK, len(prompt) - 1)
        scores = torch.log_softmax(logits_of(normed[start:end]).float(), dim=-1)
        following = prompt[start + 1:end + 1]
        chosen = scores.gather(1, torch.tensor(following, device=scores.device)[:, None])[:, 0].tolist()
        if not top:
            scored += [(token, logprob, []) for token, logprob in zip(following, chosen, strict=True)]
            continue
        values, ids = (t.tolist() for t in scores.topk(top, dim=-1))
        scored += [(token, logprob, list(zip(row_ids, row_values, strict=True)))
                   for token, logprob, row_ids, row_values in zip(following, chosen, ids, values, strict=True)]
    return scored


PROMPT_CHUNK = 512
