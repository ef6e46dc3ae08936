"""Input moderation: ``requests.ingress`` → policy → ``requests.<model>.<tier>``, or a refusal.

A blocked request never reaches a GPU consumer: its client gets the refusal on its own
token stream (``finish_reason: content_filter``) and a Completion closes it, so billing
and transcripts see it like any other request. Redacted requests go on with their
matches masked. Every request gets one decision on the ``moderation`` topic.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tokenbus.producers import UnknownRoute
from tokenbus.schemas import ChatMessage, ChatRequest, Completion, ModerationDecision, TokenEvent, now_ms
from tokenbus.stream_processors.context import ProcessorContext, Rejected
from tokenbus.stream_processors.moderation.policy import BLOCK, INPUT, REDACT, Finding, Policy, Verdict

MODERATION_WORKER = "moderation"


class IngressModeration:
    name = "moderate-ingress"

    def __init__(self, ctx: ProcessorContext, policy: Policy) -> None:
        self.ctx = ctx
        self.policy = policy

    def review(self, request: ChatRequest) -> tuple[Verdict, ChatRequest]:
        """The verdict on a request, and the request to forward (redacted where the tier says so)."""
        per_message = [self.policy.scan(m.content, INPUT) if m.role != "assistant" else []
                       for m in request.messages]
        verdict = self.policy.decide([f for found in per_message for f in found], request.tier, INPUT)
        if verdict.action == REDACT:
            request = dataclasses.replace(request, messages=self._redact(request, per_message))
        return verdict, request

    def _redact(self, request: ChatRequest, per_message: list[list[Finding]]) -> list[ChatMessage]:
        return [ChatMessage(m.role, self.policy.redact(m.content, found, request.tier, INPUT)) if found else m
                for m, found in zip(request.messages, per_message)]

    async def handle(self, request: ChatRequest, message: Any) -> None:
        verdict, forward = self.review(request)
        decision = self.ctx.send(self.ctx.catalog.moderation, self.decision(request, verdict), request.request_id)
        if verdict.action == BLOCK:
            await asyncio.gather(self.refuse(request), decision)
        else:
            await asyncio.gather(self.route(forward), decision)  # both acked before the offset commits
        self.ctx.metrics.decisions.labels(INPUT, verdict.action).inc()

    async def route(self, request: ChatRequest) -> None:
        publisher = await self.ctx.request_publisher()
        try:
            await publisher.publish(request)
        except UnknownRoute as exc:
            # Only the SDK can get here (the edge checks models): tell its client, then dead-letter.
            await self.close_stream(request, "", "error", str(exc))
            raise Rejected("unknown_route", str(exc)) from None

    async def refuse(self, request: ChatRequest) -> None:
        await self.close_stream(request, self.policy.refusal, "content_filter")

    async def close_stream(self, request: ChatRequest, text: str, finish_reason: str, error: str | None = None) -> None:
        """Answer the request from here: one final token event and its Completion."""
        at = now_ms()
        final = TokenEvent(request.request_id, 0, text=text, finish_reason=finish_reason, error=error,
                           prompt_tokens=0, completion_tokens=0, worker_id=MODERATION_WORKER, created_at_ms=at)
        await self.ctx.send(request.reply_topic, final, request.request_id, partition=request.reply_partition)
        completion = Completion.for_request(
            request, text=text, finish_reason=finish_reason, prompt_tokens=0, completion_tokens=0,
            started_at_ms=at, finished_at_ms=at, error=error, worker_id=MODERATION_WORKER,
        )
        await self.ctx.send(self.ctx.catalog.completions, completion, request.request_id)

    def decision(self, request: ChatRequest, verdict: Verdict) -> ModerationDecision:
        return ModerationDecision(request.request_id, INPUT, verdict.action, tenant=request.tenant,
                                  model=request.model, tier=request.tier, categories=verdict.categories,
                                  scores=verdict.scores, policy=self.policy.name)
