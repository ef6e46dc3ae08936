"""Output moderation: reads every token stream, scans it through a window that spans
token events, and on a violation its tier blocks, truncates the stream and stops the
generation.

It runs beside the edge, not in front of it, so streams pay no extra hop: a truncation
reaches the client one moderation hop after the violating event (BENCHMARKS.md gives
that hop), and the text relayed in between stays delivered. The truncation is a token
event with ``truncate`` set on the stream's own reply partition, which every reader of
the stream (the live relay, a resume, a replay) honours at the same place in the log.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from tokenbus.moderation import BLOCK, FINISH_CONTENT_FILTER, MODERATION_WORKER, OUTPUT, Policy
from tokenbus.schemas import Control, ControlAction, ModerationDecision, TokenEvent
from tokenbus.stream_processors.context import ProcessorContext
from tokenbus.stream_processors.moderation.window import StreamWindows

REMEMBERED_REQUESTS = 100_000


class OutputModeration:
    name = "moderate-output"

    def __init__(self, ctx: ProcessorContext, policy: Policy) -> None:
        self.ctx = ctx
        self.policy = policy
        self.windows = StreamWindows(policy)
        # Tenant and tier come on a stream's first event; later events are matched to them here.
        self._who: OrderedDict[str, tuple[str, str]] = OrderedDict()

    async def handle(self, event: TokenEvent, message: Any) -> None:
        if event.tier is not None:
            self._remember(event.request_id, event.tenant or "", event.tier)
        findings = self.windows.feed(event)
        tenant, tier = self._who.get(event.request_id, ("", "default"))
        if event.is_final:
            self._who.pop(event.request_id, None)
        if not findings:
            return
        verdict = self.policy.decide(findings, tier, OUTPUT)
        if verdict.action == BLOCK and not event.is_final:
            await self.truncate(event, message)
        decision = ModerationDecision(event.request_id, OUTPUT, verdict.action, tenant=tenant, tier=tier,
                                      categories=verdict.categories, scores=verdict.scores, seq=event.seq,
                                      policy=self.policy.name)
        await self.ctx.send(self.ctx.catalog.moderation, decision, event.request_id)
        self.ctx.metrics.decisions.labels(OUTPUT, verdict.action).inc()

    async def truncate(self, event: TokenEvent, message: Any) -> None:
        """End the client's stream where it is, and stop the generation."""
        self.windows.stop(event.request_id)
        stop = TokenEvent(event.request_id, event.seq + 1, finish_reason=FINISH_CONTENT_FILTER, truncate=True,
                          worker_id=MODERATION_WORKER)
        # Handed to the edge too, as the GPU consumer's events are while it is light: the edge's
        # fetches may then be backing the lane up at a longer wait.
        await self.ctx.send(message.topic, stop, event.request_id, partition=message.partition, hand_over=True)
        cancel = Control(event.request_id, ControlAction.CANCEL, reason=FINISH_CONTENT_FILTER)
        await self.ctx.send(self.ctx.catalog.control, cancel, event.request_id)

    def _remember(self, request_id: str, tenant: str, tier: str) -> None:
        self._who[request_id] = (tenant, tier)
        if len(self._who) > REMEMBERED_REQUESTS:
            self._who.popitem(last=False)
