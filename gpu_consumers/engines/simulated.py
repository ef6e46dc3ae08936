"""A seeded engine for testing and load-testing the pipeline itself.

It behaves like a batched GPU engine: one step loop advances every running sequence by one token per
step; a step takes ``1 / tokens_per_s`` seconds, longer as the batch grows (``batch_slowdown``), and
a sequence's first token comes ``ttft_ms`` after it is admitted. Text is drawn from a small
vocabulary by a generator seeded from the engine seed and the request (its ``seed`` or its id), so a
request's output is reproducible, and a sequence resumed after a prefix continues exactly as the
uninterrupted one would. A presence or frequency penalty makes the words the output holds already
less likely, as off their logits, and a ``logit_bias`` (by word: a word's id is its place in the
vocabulary) adds to a word's logit; vLLM's repetition penalty shrinks the logit of a word the prompt
or output holds (which leaves an unbiased word's 0 as it is, as it would a model's), its ``top_k``
and ``min_p`` keep the heaviest words alone, its ``stop_token_ids`` end the output as the natural
end does, and ``min_tokens`` holds both ends off. Asked for log probabilities, it gives each word's
under the weights it was drawn from, and the likeliest words in its place (both:
engines/simulated_words.py).

Offered tools, it calls them as a function-calling model would, in the ``hermes`` markup the
worker parses (engines/tool_calls.py), a few characters a token: the named function when
``tool_choice`` names one; otherwise, unless the last message is a tool's result (then it
answers in words) or ``tool_choice`` is ``none``, every offered function (at most
``MAX_CALLS``), or only the first without ``parallel_tool_calls``. Arguments are drawn from each
function's JSON Schema by a generator seeded like the text. Asked for a JSON answer
(``response_format``), it answers with a value of the request's JSON Schema drawn the same way (a
small object for ``json_object``), and asked for a text a regular expression matches (vLLM's
``guided_regex``, ``guided_choice``), with one drawn from its parse (engines/simulated_answers.py),
a few characters a token, as a decoder constrained to it would.

Its prefix cache is modelled like a paged engine's (engines/simulated_prompts.py): a prompt is
tokenized (a token per word, a few per message and function), cut into blocks of ``kv_block_tokens`` named by chain hashes, and
the leading blocks already held are not prefilled again. Time to first token is ``ttft_ms`` plus
the uncached prompt tokens at ``prefill_tokens_per_s`` (0: prefill costs nothing, as before), so
routing by cache contents shows in the timings without a GPU. The cache keeps the most recently
used ``prefix_cache_tokens`` and reports what it holds for KV-cache-aware routing.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
    StepSink,
    check_prompt_scores,
    check_token_ids,
)
from tokenbus.gpu_consumers.engines.detokenize import StopFilter
from tokenbus.gpu_consumers.engines.mailbox import Mailbox
from tokenbus.gpu_consumers.engines.simulated_answers import guided_answer, sample_value
from tokenbus.gpu_consumers.engines.simulated_prompts import LastPrompt, PrefixCacheModel
from tokenbus.gpu_consumers.engines.simulated_words import (
    VOCABULARY,
    Said,
    decode,
    draw_word,
    next_weights,
    prompt_logprobs,
    reweighted,
    word_logprob,
    word_weights,
)
from tokenbus.gpu_consumers.engines.tool_calls import render_call
from tokenbus.schemas import (
    TOOL_CHOICE_FUNCTION,
    TOOL_CHOICE_REQUIRED,
    TokenLogprob,
    ToolSpec,
    TopLogprob,
)
from tokenbus.topics import cancel_task

log = logging.getLogger(__name__)

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
    # A model of a paged KV cache, for the usage gauge: each running sequence holds its prompt and
    # output tokens in blocks of kv_block_tokens.
    kv_cache_tokens: int = 262_144
    kv_block_tokens: int = 16
    # The prefix cache: prompt tokens kept for reuse (0: none), and the prefill rate of uncached
    # prompt tokens (0: prefill takes no time).
    prefix_cache_tokens: int = 65_536
    prefill_tokens_per_s: float = 0.0
    # A step loop that runs late (the event loop was busy) makes up at most one step, and the time
    # beyond is lost, as if the engine waited for the loop. With catch_up_all it makes up every step
    # it missed at once, as an engine that generates apart from the consumer's event loop does
    # (TensorRT-LLM's executor, the hf engine's thread): the tokens wait for their reader, which
    # takes them as one step.
    catch_up_all: bool = False
    # Steps handed to a reader that takes them as they are made (``each_step``), as the hf engine
    # does; false: each request's steps read by its own task, as the trtllm adapter reads the LLM
    # API's per-request iterator.
    push_steps: bool = True


MAX_CALLS = 3
MARKUP_TOKEN_CHARS = 4  # a tool call's markup is generated this many characters a token
MARKUP_TOKEN_BASE = 1_000  # token ids of markup: this plus the piece's place in the call text


def planned_calls(inp: GenerationInput) -> list[ToolSpec]:
    """The functions this turn calls (see the module's docstring)."""
    if not inp.offers_tools:
        return []
    if inp.tool_choice == TOOL_CHOICE_FUNCTION:
        return [t for t in inp.tools if t.name == inp.tool_choice_name][:1]
    if inp.tool_choice != TOOL_CHOICE_REQUIRED and inp.messages and inp.messages[-1].role == "tool":
        return []
    return list(inp.tools[:MAX_CALLS] if inp.parallel_tool_calls else inp.tools[:1])


def tool_markup(inp: GenerationInput, seed_material: str) -> str:
    """The text of this turn's calls, "" when it answers in words."""
    calls = planned_calls(inp)
    if not calls:
        return ""
    rng = random.Random(zlib.crc32(f"{seed_material}:tools".encode()))
    return "\n".join(render_call(t.name, sample_value(json.loads(t.parameters), rng) or {}) for t in calls)


@dataclass(eq=False)
class _Sequence:
    inp: GenerationInput
    rng: random.Random
    ready_at: float
    natural_length: int
    fails_at: int | None
    prompt_tokens: int
    cached_tokens: int = 0
    markup: str = ""  # a tool-calling turn's text, or a JSON answer's: generated MARKUP_TOKEN_CHARS a token
    pushes: bool = True  # offers push_to to each_step
    outputs: Mailbox[StepOutput] = field(default_factory=Mailbox)
    generated: int = 0
    aborted: bool = False
    finished: bool = False
    prefilled: bool = False  # its first token is out: it advances with the decode steps from now on
    stops: StopFilter = field(init=False)
    unsent: str = ""  # text of prefix tokens a previous worker held back and never published
    said: Said | None = None  # what its words are weighed against, where they are reweighted
    prompt_scores: tuple[TokenLogprob, ...] = ()  # its prompt's, where asked: they go with its first step

    def __post_init__(self) -> None:
        sampling = self.inp.sampling
        self.stops = StopFilter(sampling.stop, sampling.min_tokens, sampling.include_stop_str_in_output)
        self.generated = len(self.inp.prefix_token_ids)
        prefix = self._markup_piece_text(self.generated) if self.markup else decode(self.inp.prefix_token_ids)
        if self.inp.continue_final_message and self.inp.prefix_token_ids and not self.markup:
            prefix = " " + prefix  # its first word went on after the final message, as step() says it
        self.unsent = prefix[len(self.inp.prefix_text):]

    def _markup_piece_text(self, pieces: int) -> str:
        return self.markup[:pieces * MARKUP_TOKEN_CHARS]

    def abort(self) -> None:
        self.aborted = True

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        given_out = len(self.inp.prefix_token_ids)
        while True:
            out = await self.outputs.get()
            if self.aborted and not out.finished:  # the step loop ran ahead of this reader: end here
                out = StepOutput("", (), self.prompt_tokens, given_out, FINISH_CANCELLED, None, self.cached_tokens)
            while self.outputs and not out.finished:  # the reader fell behind: one output for what waited
                out = out.followed_by(self.outputs.take())
            given_out += len(out.token_ids_diff)
            yield out
            if out.finished:
                return

    def push_to(self, sink: StepSink) -> asyncio.Future[None]:
        """Each step to ``sink`` as the step loop makes it (``each_step``); an abort ends it at the next step."""
        def take(out: StepOutput) -> bool:
            sink(out)
            return out.finished
        return self.outputs.forward(take)

    def _emit(self, text: str, ids: tuple[int, ...], reason: str | None = None, error: str | None = None,
              logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        self.finished = reason is not None
        prompt_scores, self.prompt_scores = self.prompt_scores, ()
        self.outputs.put(StepOutput(text, ids, self.prompt_tokens, self.generated, reason, error, self.cached_tokens,
                                    logprobs, prompt_scores))

    def advance(self) -> None:
        """One step; a step that raises ends this sequence with an error, not the step loop (which
        serves every other sequence on the worker)."""
        try:
            self.step()
        except Exception as exc:  # noqa: BLE001 - one request's failure is reported on its stream
            log.exception("simulated sequence %s failed", self.inp.request_id)
            self._emit("", (), FINISH_ERROR, f"engine step failed: {exc}")

    def step(self) -> None:
        """Advance by one token, or finish."""
        if self.aborted:
            return self._emit("", (), FINISH_CANCELLED)
        if self.fails_at is not None and self.generated >= self.fails_at:
            return self._emit("", (), FINISH_ERROR, "injected engine failure")
        limit = self.inp.sampling.max_tokens
        if limit is not None and self.generated >= limit:  # taken over at its limit: only what was held back
            text = self.unsent if self.markup else self.stops.feed(self.unsent)[0] + self.stops.flush()
            return self._emit(text, (), FINISH_LENGTH)
        if self.markup:
            return self._step_markup()
        said = self.said
        space = "" if self.generated == 0 and not self.inp.continue_final_message else " "  # (on after the message)
        weights = None if said is None else word_weights(self.inp.sampling, said)
        token_id = draw_word(self.rng, self.inp.sampling, weights, self.generated)
        logprobs = (() if self.inp.sampling.logprobs is None
                    else (word_logprob(self.inp.sampling, weights, token_id, space),))
        if said is not None:
            said.add(token_id)
        piece = space + VOCABULARY[token_id]
        self.generated += 1
        text, stopped = self.stops.feed(self.unsent + piece, self.generated)
        self.unsent = ""
        if stopped:
            return self._emit(text, (token_id,), FINISH_STOP, logprobs=logprobs)
        if token_id in self.inp.sampling.stop_token_ids:  # as its end-of-sequence token would
            return self._emit(text + self.stops.flush(), (token_id,), FINISH_STOP, logprobs=logprobs)
        if limit is not None and self.generated >= limit:
            return self._emit(text + self.stops.flush(), (token_id,), FINISH_LENGTH, logprobs=logprobs)
        if self.generated >= self.natural_length:
            return self._emit(text + self.stops.flush(), (token_id,), FINISH_STOP, logprobs=logprobs)
        self._emit(text, (token_id,), logprobs=logprobs)

    def _step_markup(self) -> None:
        """One token of a turn's fixed text (a tool call's markup, a JSON answer); it ends with the text
        (stop sequences do not apply)."""
        start = self.generated * MARKUP_TOKEN_CHARS
        token = self.markup[start:start + MARKUP_TOKEN_CHARS]
        piece = self.unsent + token
        self.unsent = ""
        ids = (MARKUP_TOKEN_BASE + self.generated,)
        self.generated += 1
        limit = self.inp.sampling.max_tokens
        top = self.inp.sampling.logprobs
        logprobs = () if top is None else (TokenLogprob(token, 0.0, [TopLogprob(token, 0.0)][:top]),)  # no other choice
        if start + MARKUP_TOKEN_CHARS >= len(self.markup):
            return self._emit(piece, ids, FINISH_STOP, logprobs=logprobs)
        if limit is not None and self.generated >= limit:
            return self._emit(piece, ids, FINISH_LENGTH, logprobs=logprobs)
        self._emit(piece, ids, logprobs=logprobs)


class SimulatedEngine:
    name = "simulated"

    def __init__(self, settings: SimulatedEngineSettings | None = None) -> None:
        self.settings = settings or SimulatedEngineSettings()
        self._running: list[_Sequence] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.steps = 0
        s = self.settings
        self._prompt = LastPrompt()
        self.prefix_cache = (PrefixCacheModel(s.prefix_cache_tokens, s.kv_block_tokens, self._prompt)
                             if s.prefix_cache_tokens else None)

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._step_loop(), name="simulated-engine")

    async def close(self) -> None:
        await cancel_task(self._loop_task)

    @property
    def running(self) -> int:
        return len(self._running)

    def kv_cache_usage(self) -> float:
        block = self.settings.kv_block_tokens
        held = sum(-(-(seq.prompt_tokens + seq.generated) // block) * block for seq in self._running)
        return min(1.0, held / self.settings.kv_cache_tokens)

    async def prepare(self, inp: GenerationInput) -> None:
        """Nothing: the simulated tokenizer costs next to nothing."""

    def generate(self, inp: GenerationInput) -> _Sequence:
        s = self.settings
        seed_material = f"{s.seed}:{inp.sampling.seed if inp.sampling.seed is not None else inp.request_id}"
        rng = random.Random(zlib.crc32(seed_material.encode()))
        natural_length = rng.randint(s.min_tokens, max(s.min_tokens, s.max_tokens))
        fails_at = rng.randrange(natural_length) if rng.random() < s.failure_rate else None
        if inp.sampling.ignore_eos:  # its natural end is its end-of-sequence token: on to the limit, or the longest
            natural_length = inp.sampling.max_tokens or s.max_tokens  # (after the draws: the same tokens)
        natural_length = max(natural_length, inp.sampling.min_tokens)  # that end token waits for min_tokens
        markup = tool_markup(inp, seed_material) or guided_answer(inp, seed_material)
        if not markup:  # a tool-calling turn's ids are its markup's pieces
            check_token_ids(inp.prefix_token_ids, len(VOCABULARY))
        check_token_ids(inp.sampling.named_token_ids, len(VOCABULARY))
        said = Said.of(inp)
        for generated, token_id in enumerate(inp.prefix_token_ids):  # replay the draws that produced the prefix
            draw_word(rng, inp.sampling, next_weights(inp.sampling, said), generated)
            said.add(token_id)
        prompt_ids, _ = self._prompt(inp)
        if not inp.prefix_token_ids:  # (a taken-over sequence's prompt is not scored again)
            check_prompt_scores(len(prompt_ids), inp.sampling)
        cached = 0
        if self.prefix_cache is not None:
            cached = self.prefix_cache.admit(self.prefix_cache.layout(inp).block_hashes, len(prompt_ids))
        prefill_s = (len(prompt_ids) - cached) / s.prefill_tokens_per_s if s.prefill_tokens_per_s else 0.0
        sequence = _Sequence(
            inp=inp,
            rng=rng,
            ready_at=asyncio.get_running_loop().time() + s.ttft_ms / 1000 + prefill_s,
            natural_length=natural_length,
            fails_at=fails_at,
            prompt_tokens=len(prompt_ids),
            cached_tokens=cached,
            markup=markup,
            pushes=s.push_steps,
            said=said if reweighted(inp.sampling) else None,
            prompt_scores=self._prompt_scores(inp),
        )
        self._running.append(sequence)
        self._wakeup.set()
        return sequence

    @staticmethod
    def _prompt_scores(inp: GenerationInput) -> tuple[TokenLogprob, ...]:
        """The prompt's log probabilities where asked (a text prompt's: a chat's has no
        tokens of its own to show), none for a sequence taken over (its first step is out already)."""
        top = inp.sampling.prompt_logprobs
        if top is None or inp.prefix_token_ids or not inp.text_prompt:
            return ()
        scored = prompt_logprobs(inp.messages[0].content, top, inp.prompt_token_ids)
        if inp.truncate_prompt_tokens is not None and len(scored) > inp.truncate_prompt_tokens:
            kept = scored[-inp.truncate_prompt_tokens:]  # its first now has nothing before it to score it
            scored = (TokenLogprob(kept[0].token, 0.0), *kept[1:])
        return scored

    def _step_seconds(self, batch: int) -> float:
        s = self.settings
        base = (1.0 / s.tokens_per_s) * (1 + s.batch_slowdown * max(0, batch - 1))
        if s.jitter:
            base *= 1 + random.uniform(-s.jitter, s.jitter)
        return base

    async def _step_loop(self) -> None:
        """Steps run on their own clock, like a GPU: work done on the event loop between steps does
        not stretch them (a late step runs at once, with at most one step of catch-up, or with every
        step missed under ``catch_up_all``). As in a real
        engine, prefill ends with a sequence's first token: a sequence emits it when it is ready
        (``ttft_ms`` after admission, plus its prefill), or at the end of the decode step under way
        then, and advances with the decode steps after that."""
        loop = asyncio.get_running_loop()
        next_step_at = loop.time()
        while True:
            if not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                next_step_at = loop.time()
            now = loop.time()
            decoding = [seq for seq in self._running if seq.prefilled]
            waiting = []
            for seq in self._running:
                if seq.prefilled:
                    continue
                if seq.ready_at <= now or seq.aborted:
                    seq.prefilled = True
                    seq.advance()
                else:
                    waiting.append(seq.ready_at)
            self._running = [seq for seq in self._running if not seq.finished]
            if not decoding:
                if waiting and len(waiting) == len(self._running):  # nothing emitted: sleep until one is ready
                    await asyncio.sleep(min(waiting) - now)
                next_step_at = loop.time()
                continue
            step_s = self._step_seconds(len(decoding))
            next_step_at = next_step_at + step_s if self.settings.catch_up_all else max(next_step_at + step_s, now - step_s)
            await asyncio.sleep(max(0.0, next_step_at - loop.time()))
            missed = int((loop.time() - next_step_at) / step_s) if self.settings.catch_up_all else 0
            for _ in range(1 + missed):  # back to back: their readers find them waiting
                for seq in decoding:
                    seq.advance()
                self.steps += 1
                decoding = [seq for seq in decoding if not seq.finished]
                if not decoding:
                    break
            next_step_at += missed * step_s
            self._running = [seq for seq in self._running if not seq.finished]
