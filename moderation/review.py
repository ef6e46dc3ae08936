"""A prompt's review: the verdict on a request, what goes on to a GPU consumer, and the records
that answer a request without one (a refusal, or an error).

Pure functions over records, with no bus: whoever moderates a prompt (the edge before it
publishes, the ingress processor for what SDK users publish to ``requests.ingress``) sends
what these return (producers/moderated.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenbus.moderation.policy import BLOCK, INPUT, REDACT, Finding, Policy, Verdict
from tokenbus.schemas import ChatMessage, ChatRequest, Completion, ModerationDecision, TokenEvent, now_ms

# The worker id on records written by moderation instead of a GPU consumer.
MODERATION_WORKER = "moderation"
FINISH_CONTENT_FILTER = "content_filter"


@dataclass(frozen=True, slots=True)
class InputReview:
    verdict: Verdict
    forward: ChatRequest  # the request to publish: redacted where the tier says so
    decision: ModerationDecision

    @property
    def blocked(self) -> bool:
        return self.verdict.action == BLOCK


def review_input(policy: Policy, request: ChatRequest) -> InputReview:
    """Scan every message but the assistant's (the model's own words were scanned on the way out)."""
    per_message = [policy.scan(m.content, INPUT) if m.role != "assistant" else [] for m in request.messages]
    verdict = policy.decide([f for found in per_message for f in found], request.tier, INPUT)
    forward = request
    if verdict.action == REDACT:
        forward = dataclasses.replace(request, messages=_redacted(policy, request, per_message))
    decision = ModerationDecision(request.request_id, INPUT, verdict.action, tenant=request.tenant,
                                  model=request.model, tier=request.tier, categories=verdict.categories,
                                  scores=verdict.scores, policy=policy.name)
    return InputReview(verdict, forward, decision)


def _redacted(policy: Policy, request: ChatRequest, per_message: list[list[Finding]]) -> list[ChatMessage]:
    return [dataclasses.replace(m, content=policy.redact(m.content, found, request.tier, INPUT)) if found else m
            for m, found in zip(request.messages, per_message)]


def closing_records(request: ChatRequest, text: str, finish_reason: str,
                    error: str | None = None) -> tuple[TokenEvent, Completion]:
    """One final token event (for the request's reply stream) and the Completion that closes it,
    so billing and transcripts see a request answered by moderation like any other."""
    at = now_ms()
    final = TokenEvent(request.request_id, 0, text=text, finish_reason=finish_reason, error=error,
                       prompt_tokens=0, completion_tokens=0, worker_id=MODERATION_WORKER, created_at_ms=at)
    completion = Completion.for_request(
        request, text=text, finish_reason=finish_reason, prompt_tokens=0, completion_tokens=0,
        started_at_ms=at, finished_at_ms=at, error=error, worker_id=MODERATION_WORKER,
    )
    return final, completion
