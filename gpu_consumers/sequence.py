"""One request in the engine: the slot it holds, how a cancel stops it within a step, and the
steps it yields (none from the engine for a request cancelled or out of time before it ran)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from tokenbus.gpu_consumers.engines import (
    FINISH_CANCELLED,
    FINISH_CONTENT_FILTER,
    FINISH_ERROR,
    Engine,
    GenerationInput,
    GenerationStream,
    InvalidInput,
    StepOutput,
)
from tokenbus.gpu_consumers.scheduler import Pending
from tokenbus.gpu_consumers.token_log import Published
from tokenbus.schemas import now_ms
from tokenbus.schemas.request_checks import DEADLINE_PASSED, INVALID_REQUEST


def stop_reason(cancel_reason: str) -> str:
    """A cancel from output moderation ends the stream as OpenAI's ``content_filter``."""
    return FINISH_CONTENT_FILTER if cancel_reason == FINISH_CONTENT_FILTER else FINISH_CANCELLED


@dataclass(eq=False)
class RunningSequence:
    pending: Pending
    cost: int  # tokens it may hold in flight (prompt and completion)
    task: asyncio.Task[None] | None = None
    stream: GenerationStream | None = None
    cancelled: bool = False
    stop_reason: str = FINISH_CANCELLED
    admitted_at_ms: int = field(default_factory=now_ms)
    refused: str | None = None  # why the engine would not run it (InvalidInput): answered with that
    _generation_input: GenerationInput | None = field(default=None, init=False, repr=False)

    def cancel(self, reason: str = "") -> None:
        self.cancelled = True
        self.stop_reason = stop_reason(reason)
        if self.stream is not None:
            self.stream.abort()

    def _expired(self, published: Published) -> bool:
        deadline = self.pending.request.deadline_ms
        return not published.events and deadline is not None and now_ms() > deadline

    def _input(self, published: Published) -> GenerationInput:
        """What the engine is given, made once for ``prepare`` and ``generate``."""
        if self._generation_input is None:
            # A continuation generates after its turn's delivered output (and a takeover after both).
            request = self.pending.request
            self._generation_input = GenerationInput.from_request(
                request, (*request.prefix_token_ids, *published.token_ids), request.prefix_text + published.text)
        return self._generation_input

    async def prepare(self, engine: Engine, published: Published) -> None:
        """Let the engine work out what it can before generating, off the event loop."""
        if not self.cancelled and not self._expired(published):
            try:
                await engine.prepare(self._input(published))
            except InvalidInput as exc:
                self.refused = str(exc)

    def outputs(self, engine: Engine, published: Published) -> AsyncIterable[StepOutput]:
        """The steps to publish after ``published`` (what another worker published already). The
        reader calls ``stop()`` when done with them, however it leaves."""
        request = self.pending.request
        if self.cancelled:
            return _one(StepOutput("", (), 0, len(request.prefix_token_ids) + len(published.token_ids), FINISH_CANCELLED))
        if self._expired(published):
            return _one(StepOutput("", (), 0, 0, FINISH_ERROR, DEADLINE_PASSED))
        if self.refused is None:
            try:
                self.stream = engine.generate(self._input(published))
                return self.stream
            except InvalidInput as exc:
                self.refused = str(exc)
        return _one(StepOutput("", (), 0, len(published.token_ids), FINISH_ERROR, f"{INVALID_REQUEST}: {self.refused}"))

    @property
    def engine_input(self) -> GenerationInput | None:
        """What the engine was given (None before ``prepare`` or ``outputs``)."""
        return self._generation_input

    def stop(self) -> None:
        """A no-op once the engine finished the sequence; stops it if its reader left early
        (its task cancelled)."""
        if self.stream is not None:
            self.stream.abort()


async def _one(out: StepOutput) -> AsyncIterator[StepOutput]:
    yield out
