"""A seeded engine for testing and load-testing the pipeline itself.

It behaves like a batched GPU engine: one step loop advances every running sequence
by one token per step; a step takes ``1 / tokens_per_s`` seconds, longer as the batch
grows (``batch_slowdown``), and a sequence's first token comes ``ttft_ms`` after it is
admitted. Text is drawn from a small vocabulary by a generator seeded from the engine
seed and the request (its ``seed`` or its id), so a request's output is reproducible,
and a sequence resumed after a prefix continues exactly as the uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.gpu_consumers.engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    StepOutput,
)
from tokenbus.gpu_consumers.engines.detokenize import StopFilter
from tokenbus.topics import cancel_task

VOCABULARY = """
the bus carries every token from the engine to the edge and each event can be replayed so a
stream survives a crash without a gap or a duplicate while billing counts usage exactly once per
request for every tenant model and tier
""".split()


class SimulatedEngineSettings(BaseSettings):
    """``TOKENBUS_SIM_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_SIM_", extra="ignore")

    seed: int = 0
    ttft_ms: float = 20.0
    tokens_per_s: float = 100.0
    batch_slowdown: float = 0.0  # step time grows by this fraction per extra running sequence
    jitter: float = 0.0  # +/- fraction of random noise on each step
    min_tokens: int = 8
    max_tokens: int = 48
    failure_rate: float = 0.0  # chance that a sequence fails part-way


def count_prompt_tokens(inp: GenerationInput) -> int:
    """The simulated tokenizer: a token per word plus a few for each message's template."""
    return sum(len(m.content.split()) + 4 for m in inp.messages)


def decode(token_ids: tuple[int, ...] | list[int]) -> str:
    return " ".join(VOCABULARY[t] for t in token_ids)


@dataclass(eq=False)
class _Sequence:
    inp: GenerationInput
    rng: random.Random
    ready_at: float
    natural_length: int
    fails_at: int | None
    prompt_tokens: int
    outputs: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    generated: int = 0
    aborted: bool = False
    finished: bool = False
    stops: StopFilter = field(init=False)
    unsent: str = ""  # text of prefix tokens a previous worker held back and never published

    def __post_init__(self) -> None:
        self.stops = StopFilter(self.inp.sampling.stop)
        self.generated = len(self.inp.prefix_token_ids)
        self.unsent = decode(self.inp.prefix_token_ids)[len(self.inp.prefix_text):]

    def abort(self) -> None:
        self.aborted = True

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while True:
            out = await self.outputs.get()
            yield out
            if out.finished:
                return

    def _emit(self, text: str, ids: tuple[int, ...], reason: str | None = None, error: str | None = None) -> None:
        self.finished = reason is not None
        self.outputs.put_nowait(StepOutput(text, ids, self.prompt_tokens, self.generated, reason, error))

    def step(self) -> None:
        """Advance by one token, or finish."""
        if self.aborted:
            return self._emit("", (), FINISH_CANCELLED)
        if self.fails_at is not None and self.generated >= self.fails_at:
            return self._emit("", (), FINISH_ERROR, "injected engine failure")
        token_id = self.rng.randrange(len(VOCABULARY))
        piece = VOCABULARY[token_id] if self.generated == 0 else " " + VOCABULARY[token_id]
        self.generated += 1
        text, stopped = self.stops.feed(self.unsent + piece)
        self.unsent = ""
        if stopped:
            return self._emit(text, (token_id,), FINISH_STOP)
        limit = self.inp.sampling.max_tokens
        if limit is not None and self.generated >= limit:
            return self._emit(text + self.stops.flush(), (token_id,), FINISH_LENGTH)
        if self.generated >= self.natural_length:
            return self._emit(text + self.stops.flush(), (token_id,), FINISH_STOP)
        self._emit(text, (token_id,))


class SimulatedEngine:
    name = "simulated"

    def __init__(self, settings: SimulatedEngineSettings | None = None) -> None:
        self.settings = settings or SimulatedEngineSettings()
        self._running: list[_Sequence] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.steps = 0

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop(), name="simulated-engine")

    async def close(self) -> None:
        await cancel_task(self._loop_task)

    @property
    def running(self) -> int:
        return len(self._running)

    def generate(self, inp: GenerationInput) -> _Sequence:
        s = self.settings
        seed_material = f"{s.seed}:{inp.sampling.seed if inp.sampling.seed is not None else inp.request_id}"
        rng = random.Random(zlib.crc32(seed_material.encode()))
        natural_length = rng.randint(s.min_tokens, max(s.min_tokens, s.max_tokens))
        fails_at = rng.randrange(natural_length) if rng.random() < s.failure_rate else None
        for _ in inp.prefix_token_ids:  # replay the draws that produced the prefix
            rng.randrange(len(VOCABULARY))
        sequence = _Sequence(
            inp=inp,
            rng=rng,
            ready_at=asyncio.get_running_loop().time() + s.ttft_ms / 1000,
            natural_length=natural_length,
            fails_at=fails_at,
            prompt_tokens=count_prompt_tokens(inp),
        )
        self._running.append(sequence)
        self._wakeup.set()
        return sequence

    def _step_seconds(self, batch: int) -> float:
        s = self.settings
        base = (1.0 / s.tokens_per_s) * (1 + s.batch_slowdown * max(0, batch - 1))
        if s.jitter:
            base *= 1 + random.uniform(-s.jitter, s.jitter)
        return base

    async def _step_loop(self) -> None:
        """Steps run on their own clock, like a GPU: work done on the event loop between steps does
        not stretch them (a late step runs at once, with at most one step of catch-up)."""
        loop = asyncio.get_running_loop()
        next_step_at = loop.time()
        while True:
            if not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                next_step_at = loop.time()
            now = loop.time()
            ready = [seq for seq in self._running if seq.ready_at <= now or seq.aborted]
            if not ready:
                await asyncio.sleep(min(seq.ready_at for seq in self._running) - now)
                next_step_at = loop.time()
                continue
            next_step_at = max(next_step_at + self._step_seconds(len(ready)), now - self._step_seconds(len(ready)))
            await asyncio.sleep(max(0.0, next_step_at - loop.time()))
            for seq in ready:
                seq.step()
            self.steps += 1
            self._running = [seq for seq in self._running if not seq.finished]
