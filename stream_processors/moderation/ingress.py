"""Input moderation on the bus: ``requests.ingress`` → policy → ``requests.<model>.<tier>``, or a
refusal. The review and what is sent are the edge's too (producers/moderated.py); this agent
serves what SDK users publish to ``requests.ingress`` (and edges set to ``route=ingress``).

A blocked request never reaches a GPU consumer: its client gets the refusal on its own token
stream (``finish_reason: content_filter``) and a Completion closes it, so billing and
transcripts see it like any other request. Redacted requests go on with their matches masked.
Every request gets one decision on the ``moderation`` topic.
"""

from __future__ import annotations

from typing import Any

from tokenbus.moderation import INPUT, InputReview, Policy
from tokenbus.producers import InputModerator, UnknownRoute
from tokenbus.schemas import ChatRequest
from tokenbus.stream_processors.context import ProcessorContext, Rejected


class IngressModeration:
    name = "moderate-ingress"

    def __init__(self, ctx: ProcessorContext, policy: Policy) -> None:
        self.ctx = ctx
        self.policy = policy
        self._moderator: InputModerator | None = None

    async def moderator(self) -> InputModerator:
        if self._moderator is None:
            self._moderator = InputModerator(await self.ctx.request_publisher(), self.policy, self._count)
        return self._moderator

    def _count(self, review: InputReview) -> None:
        self.ctx.metrics.decisions.labels(INPUT, review.verdict.action).inc()

    async def handle(self, request: ChatRequest, message: Any) -> None:
        moderator = await self.moderator()
        try:
            await moderator.publish(request)  # the decision and the rest acked before the offset commits
        except UnknownRoute as exc:
            # Only the SDK can get here (the edge checks models): tell its client, then dead-letter.
            await moderator.answer(request, "", "error", str(exc))
            raise Rejected("unknown_route", str(exc)) from None
