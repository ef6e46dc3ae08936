"""Publish a ChatRequest onto the request topic of its model and tier."""

from __future__ import annotations

from collections.abc import Callable

from aiokafka.structs import RecordMetadata

from tokenbus.producers.placement import PrefixRouter
from tokenbus.schemas import ChatRequest
from tokenbus.topics import RecordSender


class UnknownRoute(ValueError):
    """The request names a model or tier this bus does not serve."""


class RequestPublisher:
    def __init__(self, sender: RecordSender, placement: PrefixRouter | None = None,
                 hand_over_while: Callable[[], bool] = lambda: False) -> None:
        """``hand_over_while``: whether a request published now goes on the express lane too (a
        publisher that knows its load says; by default none does)."""
        self.sender = sender
        self.placement = placement
        self._hand_over_while = hand_over_while
        self._catalog = sender.catalog

    def topic_for(self, request: ChatRequest) -> str:
        settings = self._catalog.settings
        if request.model not in settings.models:
            raise UnknownRoute(f"model {request.model!r} is not served here")
        if request.tier not in settings.tiers:
            raise UnknownRoute(f"tier {request.tier!r} is not one of {settings.tiers}")
        return self._catalog.requests(request.model, request.tier)

    async def publish(self, request: ChatRequest, topic: str | None = None) -> RecordMetadata:
        """Publish and wait for the broker's ack; returns where the request landed. Requests are
        keyed by conversation (or request id), so a conversation's turns share a partition; with
        ``placement``, a request on a model's topic goes where its prompt's prefix is cached
        (producers/placement.py), and the decision is noted on it. A request on a model's topic is
        also handed to its GPU consumers on the express lane where there is one (topics/doorbell.py),
        while ``hand_over_while`` says so."""
        topic = topic or self.topic_for(request)
        hand_over = topic != self._catalog.ingress and self._hand_over_while()
        if self.placement is None or topic == self._catalog.ingress:
            return await self.sender.send_and_wait(topic, request, request.partition_key, hand_over=hand_over)
        placed = self.placement.place(request, topic)
        request.annotations = {**request.annotations, **placed.annotations()}
        landed = await self.sender.send_and_wait(topic, request, request.partition_key, partition=placed.partition,
                                                 hand_over=hand_over)
        self.placement.landed(placed, topic, landed.partition)
        return landed
