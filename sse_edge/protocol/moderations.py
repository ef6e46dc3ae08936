"""The bodies of OpenAI's moderation endpoint (``/v1/moderations``): what may be asked (text:
a string, a list of them, or a list of ``{"type": "text", "text": ...}`` parts; no images) and
how each input's result is shown. The categories are the moderation policy's own."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenbus.moderation import ALLOW, Policy, Verdict

INPUTS_MAX = 32  # texts one request may ask about


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ModerationRequest(BaseModel):
    """``POST /v1/moderations``."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[TextPart] = Field(description="Text to classify (images are not classified here)")
    model: str | None = Field(None, max_length=256)

    @property
    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        return [part if isinstance(part, str) else part.text for part in self.input]


def result_body(policy: Policy, verdict: Verdict) -> dict[str, Any]:
    """One input's result: every category of the policy (and any its classifier found), found or
    not, with its score; ``flagged`` when the decision for the key's tier is not ``allow``, and
    ``action``: that decision (what the pipeline would do with the text as a prompt)."""
    scores = verdict.scores
    categories = sorted(set(policy.detectors) | set(scores))
    return {"flagged": verdict.action != ALLOW,
            "categories": {category: category in scores for category in categories},
            "category_scores": {category: scores.get(category, 0.0) for category in categories},
            "category_applied_input_types": {category: ["text"] if category in scores else [] for category in categories},
            "action": verdict.action}
