"""Publishing through input moderation: a prompt is reviewed before it goes on the bus, so a
blocked one never reaches a GPU consumer and an allowed one pays no extra hop.

The edge publishes this way by default (``TOKENBUS_EDGE_ROUTE=inline``); the ingress processor
does the same for what is published to ``requests.ingress``. Either way every request gets one
decision on the ``moderation`` topic, and a refused request is answered on its own reply stream
(``finish_reason: content_filter``) with a Completion, like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiokafka.structs import RecordMetadata

from tokenbus.moderation import FINISH_CONTENT_FILTER, InputReview, Policy, closing_records, review_input
from tokenbus.producers.publisher import RequestPublisher
from tokenbus.schemas import ChatRequest
from tokenbus.topics import tracing


class InputModerator:
    def __init__(self, publisher: RequestPublisher, policy: Policy,
                 on_review: Callable[[InputReview], None] | None = None) -> None:
        self.publisher = publisher
        self.policy = policy
        self._sender = publisher.sender
        self._on_review = on_review

    async def publish(self, request: ChatRequest, topic: str | None = None) -> RecordMetadata | None:
        """Review, then publish the request (redacted where its tier says so) or answer it with the
        refusal; None when refused. Returns once the decision and the rest are acknowledged."""
        with tracing.span("moderate-input") as span:
            review = review_input(self.policy, request)
            if span is not None:
                span.set_attribute("tokenbus.moderation.action", review.verdict.action)
        decision = self._sender.send_and_wait(self._sender.catalog.moderation, review.decision, request.request_id)
        if review.blocked:
            _, landed = await asyncio.gather(decision, self.answer(request, self.policy.refusal, FINISH_CONTENT_FILTER))
        else:
            _, landed = await asyncio.gather(decision, self.publisher.publish(review.forward, topic))
        if self._on_review is not None:
            self._on_review(review)
        return landed

    async def answer(self, request: ChatRequest, text: str, finish_reason: str, error: str | None = None) -> None:
        """Answer the request from here: one final token event and its Completion."""
        final, completion = closing_records(request, text, finish_reason, error)
        await self._sender.send_and_wait(request.reply_topic, final, request.request_id, partition=request.reply_partition)
        await self._sender.send_and_wait(self._sender.catalog.completions, completion, request.request_id)
