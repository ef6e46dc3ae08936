"""One request's stream out of the ``hf`` engine (hf.py): what its generating thread hands back
(the slots' deltas, or the manager's cumulative outputs) made into the engine contract's steps:
detokenized, cut at stop sequences, scored where asked, ended by an abort at the next read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tokenbus.gpu_consumers.engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    StepOutput,
    StepSink,
)
from tokenbus.gpu_consumers.engines.detokenize import IncrementalDetokenizer, StopFilter, held_back_text
from tokenbus.gpu_consumers.engines.hf_slot_logprobs import ScoredToken
from tokenbus.gpu_consumers.engines.hf_slots import Delta
from tokenbus.gpu_consumers.engines.mailbox import Mailbox
from tokenbus.schemas import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from tokenbus.gpu_consumers.engines.hf import HfEngine


class HfSequence:
    """One request's stream. The generating thread's outputs reach the event loop as deltas
    (``on_delta``, or ``on_result`` for the manager's cumulative outputs); they become steps only as
    the stream is read (or pushed on, ``push_to``), so an abort ends the stream at its next read
    however far generation has run ahead, and a final's count of completion tokens is always what
    the stream gave out."""

    pushes = True  # offers push_to to each_step

    def __init__(self, engine: HfEngine, inp: GenerationInput, internal_id: str, prompt_ids: list[int],
                 cached_tokens: int) -> None:
        self._engine = engine
        self._internal_id = internal_id
        self._deltas: Mailbox[Delta | None] = Mailbox()  # None wakes a reader
        self._ending: str | None = None  # a finish decided here, not by generation: cancelled, or length
        self._ending_text = ""
        self._generation_done = False
        self._detokenizer = IncrementalDetokenizer(engine.tokenizer, inp.prefix_token_ids, inp.prefix_text)
        self._stops = StopFilter(inp.sampling.stop, inp.sampling.min_tokens, inp.sampling.include_stop_str_in_output)
        self._ends_at_eos = not inp.sampling.ignore_eos
        self._stop_ids = frozenset(inp.sampling.stop_token_ids)  # vLLM's: they end it as an end token does
        self._taken = 0  # tokens of the manager's cumulative output made into deltas so far
        self._scored = inp.sampling.logprobs is not None  # the manager's log probabilities passed on
        # Where the prompt's log probabilities are asked (and not published already, by a worker this
        # one took over from): its ids, till the first delta brings their scores.
        self._scored_prompt = prompt_ids if inp.sampling.prompt_logprobs is not None and not inp.prefix_token_ids else None
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = cached_tokens  # the slots' first delta says what they took
        self.finished = False
        limit = inp.sampling.max_tokens or engine.settings.default_max_tokens
        self.max_new_tokens = max(limit - len(inp.prefix_token_ids), 0)

    @property
    def completion_tokens(self) -> int:
        return len(self._detokenizer.token_ids)

    def on_delta(self, delta: Delta) -> None:
        """Called on the event loop with what generation added."""
        self._generation_done = self._generation_done or delta.finish is not None
        if delta.cached_tokens is not None:  # of the prompt, not of a taken-over output's prefix after it
            self.cached_tokens = min(delta.cached_tokens, self.prompt_tokens)
        self._deltas.put(delta)

    def on_result(self, result: Any) -> None:
        """Called on the event loop with the manager's cumulative output for this request."""
        if result.error is not None or result.status.name == "FAILED":
            self.on_delta(Delta([], FINISH_ERROR, str(result.error)))
            return
        new_ids = list(result.generated_tokens[self._taken:])
        scored: list[ScoredToken] = []
        if self._scored:  # the manager's log probabilities, one a generated token
            scored = [(t, lp, []) for t, lp in zip(new_ids, result.logprobs[self._taken:], strict=False)]
        self._taken = len(result.generated_tokens)
        finish = None
        if result.is_finished():
            ends = self._stop_ids | (self._engine.eos_token_ids if self._ends_at_eos else set())
            finish = FINISH_STOP if new_ids and new_ids[-1] in ends else (
                FINISH_LENGTH if self._taken >= self.max_new_tokens else FINISH_STOP)
        self.on_delta(Delta(new_ids, finish, logprobs=scored))

    def end(self, reason: str, text: str = "") -> None:
        """Finish at the next read, whatever generation has queued."""
        if self._ending is None and not self.finished:
            self._ending, self._ending_text = reason, text
            self._deltas.put(None)

    def held_back_text(self) -> str:
        return held_back_text(self._detokenizer, self._stops)

    def abort(self) -> None:
        if self._ending is None and not self.finished:
            if not self._generation_done:
                self._engine.cancel(self._internal_id)
            self.end(FINISH_CANCELLED)

    def _final(self, reason: str, text: str = "", ids: tuple[int, ...] = (), error: str | None = None,
               logprobs: tuple[TokenLogprob, ...] = (), prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> StepOutput:
        self.finished = True
        return StepOutput(text, ids, self.prompt_tokens, self.completion_tokens, reason, error, self.cached_tokens,
                          logprobs, prompt_logprobs)

    def _step(self, delta: Delta) -> StepOutput:
        if delta.finish == FINISH_ERROR:
            return self._final(FINISH_ERROR, error=delta.error)
        new_ids = tuple(delta.ids)
        text, stopped = self._stops.feed(self._detokenizer.push(delta.ids), len(self._detokenizer.token_ids))
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else ()
        prompt_logprobs = self._prompt_logprobs(delta) if self._scored_prompt is not None else ()
        if stopped:
            if not self._generation_done:
                self._engine.cancel(self._internal_id)
            return self._final(FINISH_STOP, text, new_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if delta.finish is not None:
            return self._final(delta.finish, text + self._stops.flush(), new_ids, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)
        return StepOutput(text, new_ids, self.prompt_tokens, self.completion_tokens, cached_tokens=self.cached_tokens,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _logprobs(self, scored: list[ScoredToken]) -> tuple[TokenLogprob, ...]:
        text = self._engine.token_texts
        assert text is not None  # a sequence is of a started engine
        return tuple(TokenLogprob(text(token_id), logprob, [TopLogprob(text(t), lp) for t, lp in top])
                     for token_id, logprob, top in scored)

    def _prompt_logprobs(self, delta: Delta) -> tuple[TokenLogprob, ...]:
        """The prompt's, from the first delta: its first token unscored, then the slots' scores."""
        prompt, self._scored_prompt = self._scored_prompt, None
        assert prompt and self._engine.token_texts is not None
        return (TokenLogprob(self._engine.token_texts(prompt[0]), 0.0), *self._logprobs(delta.prompt_logprobs))

    def push_to(self, sink: StepSink) -> asyncio.Future[None]:
        """Each delta to ``sink`` as a step where it reaches the event loop (``each_step``); an
        ending decided here (an abort) is the final step at once."""
        def take(delta: Delta | None) -> bool:
            if self._ending:
                out = self._final(self._ending, self._ending_text)
            else:
                assert delta is not None  # only end() puts None, and it sets _ending first
                out = self._step(delta)
            sink(out)
            return out.finished
        return self._deltas.forward(take)

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            delta = await self._deltas.get()
            # A reader that fell behind takes every delta waiting, and publishes one step for them.
            while delta is not None and self._deltas and self._deltas.first() is not None:
                delta = delta.followed_by(self._deltas.take())  # type: ignore[arg-type]  # first() is not None
            if self._ending:
                yield self._final(self._ending, self._ending_text)
            else:
                assert delta is not None  # only end() puts None, and it sets _ending first
                yield self._step(delta)
