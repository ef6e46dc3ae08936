"""Slot batching for the ``hf`` engine: which sequences run, in which rows (*slots*) of a static KV
cache, and what each step gives them. The cache and the forward passes, decode steps replayed as
CUDA graphs, are hf_slot_model.py's.

The batcher runs on its own thread, as transformers' manager does, one decode step queued ahead of
the host; what a step produced reaches the event loop in one ``call_soon_threadsafe`` per step.

Sampling (``do_sample``) is hf_slot_sampling.py's: each row with its request's own temperature,
min-p, top-k, top-p and ``seed`` (the same tokens in any batch, and after a takeover).

The prefix cache: a slot keeps the keys and values it holds when its sequence ends (the prompt
and the output), named by blocks of ``prefix_block_tokens`` tokens as blocks.py names them
(``SlotPrefixes.held``: each block's name, the rows that hold it). A new prompt takes the lowest free slot
(few rows for few sequences: a decode step's cost grows with its highest row) and starts past
the leading blocks some slot holds: kept where that slot is its own, copied where another holds
them (a copy of keys and values costs a small part of computing them), never its last token,
whose logits it needs. What the lowest free slot held, and no other slot does, is first copied
to the free slot that matters least (one that holds nothing, else the one used longest ago), so
the free slots together keep as many prefixes as there are free slots, whichever rows run, and
the rows past the slots that only keep prefixes (``keeping_rows``: none by default; each costs a
slot's memory) as many more, which a busy engine, with few slots free, keeps its prefixes in
(what each row holds: hf_slot_prefixes.py). A
system prompt shared by many requests is so computed once while some slot holds it, and once a
burst: a prompt admitted with others whose next block past the cache one of them is about to
compute waits for the next pass (one prefill), and then starts past it. The first delta of a
sequence says how many of its prompt's tokens it took from the cache (OpenAI's ``cached_tokens``).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenbus.gpu_consumers.engines.base import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from tokenbus.gpu_consumers.engines.blocks import block_hashes, leading_held
from tokenbus.gpu_consumers.engines.hf_slot_bad_words import SlotBadWords
from tokenbus.gpu_consumers.engines.hf_slot_bias import SlotBias
from tokenbus.gpu_consumers.engines.hf_slot_logprobs import ScoredToken, StepScores, prompt_scores, step_scores
from tokenbus.gpu_consumers.engines.hf_slot_model import SlotModel
from tokenbus.gpu_consumers.engines.hf_slot_penalties import SlotPenalties
from tokenbus.gpu_consumers.engines.hf_slot_prefixes import SlotPrefixes
from tokenbus.gpu_consumers.engines.hf_slot_sampling import SlotSampler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Delta:
    """What a sequence gained since its last delta: token ids, and its finish once it has one."""

    ids: list[int]
    finish: str | None = None
    error: str | None = None
    cached_tokens: int | None = None  # the first delta's: the prompt's tokens taken from the prefix cache
    logprobs: list[ScoredToken] = field(default_factory=list)  # each token's, where the request asks
    prompt_logprobs: list[ScoredToken] = field(default_factory=list)  # the first delta's: the prompt's after its first token

    def followed_by(self, later: Delta) -> Delta:
        cached = self.cached_tokens if later.cached_tokens is None else later.cached_tokens
        return Delta(self.ids + later.ids, later.finish, later.error, cached, self.logprobs + later.logprobs,
                     self.prompt_logprobs + later.prompt_logprobs)


Deliver = Callable[[Delta], None]


@dataclass(slots=True)
class SlotRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    deliver: Deliver  # called on the event loop
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # sampled reproducibly (see the module's docstring)
    drawn: int = 0  # the output's tokens before the next one sampled: a taken-over sequence starts past its published ones
    slot: int = -1
    named: tuple[int, ...] = ()  # names of the prompt's first blocks, made where it was tokenized
    ignore_eos: bool = False  # on past an end-of-sequence token, to max_new_tokens
    presence_penalty: float = 0.0  # OpenAI's penalties (hf_slot_penalties.py)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's, over the prompt and the output (hf_slot_penalties.py)
    logprobs: int | None = None  # each token's log probability and this many likeliest (hf_slot_logprobs.py)
    prompt_logprobs: int | None = None  # the prompt's tokens' too, with this many likeliest: prefilled whole
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit (hf_slot_bias.py)
    allowed_ids: tuple[int, ...] = ()  # vLLM's allowed_token_ids: the only tokens it may pick (hf_slot_bias.py)
    banned_ids: tuple[int, ...] = ()  # vLLM's bad words of one token: never picked (hf_slot_bias.py)
    bad_words: tuple[tuple[int, ...], ...] = ()  # and of more: not ended (hf_slot_bad_words.py)
    top_k: int = 0  # vLLM's: sampled from this many likeliest tokens (0: all)
    min_p: float = 0.0  # vLLM's: sampled from tokens at least this share of the likeliest's probability
    stop_ids: frozenset[int] = frozenset()  # vLLM's stop_token_ids: each ends it as an end token does
    min_new_tokens: int = 0  # tokens to make before an end token or a stop id may be picked (vLLM's min_tokens)
    wanted: tuple[int, ...] = ()  # the names of the prompt's blocks before its last token (the prefix cache)
    start: int = 0  # the prompt's positions its slot held before the prefill
    output: list[int] = field(default_factory=list)  # tokens handed out
    length: int = 0  # cache positions written or being written
    launched: int = 0  # tokens asked of the device: the prefill's, then one a decode step


class SlotBatcher:
    def __init__(self, model: Any, *, slots: int, max_model_len: int, eos_token_ids: set[int],
                 cuda_graphs: bool, do_sample: bool = False, seed: int | None = None,
                 max_prefill_tokens: int = 8192, prefix_block_tokens: int = 0, keeping_rows: int = 0) -> None:
        import torch

        self._torch = torch
        keeping_rows = keeping_rows if prefix_block_tokens else 0
        self._model = SlotModel(model, slots=slots, max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                                keeping_rows=keeping_rows)
        # The prefix cache (the module's docstring); 0 tokens a block: none.
        self.block_tokens = prefix_block_tokens
        self.prefixes = SlotPrefixes(self._model, prefix_block_tokens, slots, keeping_rows) if prefix_block_tokens else None
        self.device, self.slots, self.max_model_len = self._model.device, slots, max_model_len
        self._sampler = SlotSampler(self.device, seed) if do_sample else None
        self._eos = frozenset(eos_token_ids)
        self._penalties = SlotPenalties(slots, self.device)
        self._bias = SlotBias(slots, self.device)
        self._bad_words = SlotBadWords(slots, self.device)
        self._max_prefill_tokens = max_prefill_tokens
        # Shared with the event loop, under the lock.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: deque[SlotRequest] = deque()
        self._cancelled: set[str] = set()
        self._stopping = False
        # The batcher thread's own.
        self._running: dict[int, SlotRequest] = {}
        self._free = list(range(slots))
        self.positions_held = 0  # read by the event loop as a gauge
        # A step's token ids reach the host in one of two pinned buffers: the next step's copy goes
        # to the other while this one is read.
        pinned = self.device.type == "cuda"
        self._pinned_ids = [torch.empty(slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._next_ids = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="hf-slot-batcher", daemon=True)

    # -- the event loop's side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and let go of the cache and the graphs: their device memory is free
        once this returns, whoever still holds the batcher."""
        with self._lock:
            self._stopping = True
            self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self._model.release()

    def add(self, request: SlotRequest) -> None:
        with self._lock:
            self._waiting.append(request)
            self._wake.set()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._wake.set()

    def usage(self) -> float:
        return self.positions_held / (self.slots * self.max_model_len)

    def capture(self) -> None:
        """Every decode graph, before ``start`` (SlotModel.capture)."""
        self._model.capture()

    # -- the batcher thread

    def _run(self) -> None:
        """Each pass: admit and prefill, launch the next decode step, then hand out the step before
        it, which the device finished meanwhile. The next step's tokens never leave the device
        (each step writes them where the next one reads them), so a step is queued before the host
        has seen the last: the device is not kept waiting for the host's work on a step, nor for
        the interpreter lock the event loop holds while it takes the step before."""
        in_flight: _Launched | None = None
        with self._torch.inference_mode():
            while True:
                self._wake.wait()
                with self._lock:
                    if self._stopping:
                        break
                    admitted = self._admit()
                    if not admitted and not self._running and in_flight is None:
                        self._wake.clear()
                        continue
                try:
                    if admitted:
                        self._send(self._prefill(admitted))
                    launched = self._launch()
                    if in_flight is not None:
                        self._send(self._collect(in_flight))
                    in_flight = launched
                except Exception as exc:  # a step that fails fails its sequences, not the engine
                    log.exception("hf slot batcher step failed")
                    in_flight = None
                    failed = [r for r in admitted if r.slot >= 0 and r.slot not in self._running]
                    failed += self._running.values()
                    for request in failed:
                        self._release(request, keep=False)
                    self._send([(r.deliver, Delta([], FINISH_ERROR, f"engine step failed: {exc}")) for r in failed])

    def _admit(self) -> list[SlotRequest]:
        """Under the lock: drop cancelled sequences, then take waiting ones into free slots, as many
        prompt tokens as one prefill takes (at least one request)."""
        if self._cancelled:
            for request in [r for r in self._running.values() if r.request_id in self._cancelled]:
                self._release(request)
            self._waiting = deque(r for r in self._waiting if r.request_id not in self._cancelled)
            self._cancelled.clear()
        admitted: list[SlotRequest] = []
        budget = self._max_prefill_tokens
        while self._waiting and self._free:
            request = self._waiting[0]
            if admitted and len(request.prompt) > budget:
                break
            self._waiting.popleft()
            if len(request.prompt) >= self.max_model_len:
                self._send([(request.deliver, Delta([], FINISH_ERROR, f"a prompt of {len(request.prompt)} tokens "
                                                    f"does not fit max_model_len {self.max_model_len}"))])
                continue
            request.slot = heapq.heappop(self._free)  # the lowest free: few rows for few sequences
            budget -= len(request.prompt)
            admitted.append(request)
        return admitted

    def _release(self, request: SlotRequest, keep: bool = True) -> None:
        """The slot back to the free ones; a step still in flight for it is ignored when it lands.
        The slot keeps the blocks it holds (``keep``; a failed step's are forgotten): the prompt's and
        the output's full ones. Every token whose position is written is known by now: a step is
        launched with the token the step before gave, which the host takes right after."""
        if request.slot < 0:
            return
        self._running.pop(request.slot, None)
        self._penalties.released(request.slot)
        self._bias.released(request.slot)
        self._bad_words.released(request.slot)
        self.positions_held -= request.length
        if self.prefixes is not None:
            self.prefixes.released(request.slot, (request.prompt + request.output)[: request.length] if keep else None)
        heapq.heappush(self._free, request.slot)
        request.slot = -1

    def _defer_followers(self, requests: list[SlotRequest]) -> list[SlotRequest]:
        """Those of ``requests`` to prefill now. One whose prompt goes on past the cache into a block
        that one before it is about to compute goes back to the head of the queue, its slot to the
        free ones: at the next pass it starts past that block, whose prefill would otherwise be
        computed once for each of them (and make this pass's prefill the longer)."""
        assert self.prefixes is not None
        size, held = self.block_tokens, self.prefixes.held
        now: list[SlotRequest] = []
        later: list[SlotRequest] = []
        computing: set[int] = set()  # the blocks this pass's prefill computes
        for request in requests:
            count = (len(request.prompt) - 1) // size
            request.wanted = block_hashes(request.prompt, size, count, known=request.named[:count])
            found = leading_held(request.wanted, held)
            if found < len(request.wanted) and request.wanted[found] in computing:
                later.append(request)
                heapq.heappush(self._free, request.slot)
                request.slot = -1
            else:
                now.append(request)
                computing.update(request.wanted[found:])
        if later:
            with self._lock:
                self._waiting.extendleft(reversed(later))
        return now

    def _send(self, deltas: list[tuple[Deliver, Delta]]) -> None:
        if deltas and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver_all, deltas)

    def _advance(self, requests: list[SlotRequest], next_ids: list[int],
                 scores: StepScores | None = None) -> list[tuple[Deliver, Delta]]:
        """Each request's new token (scored, where it asks), its finish if it has one; finished ones
        give up their slots."""
        deltas = []
        scored = scores.on_host() if scores is not None else {}
        for request, token in zip(requests, next_ids, strict=True):
            request.output.append(token)
            generated = len(request.output)
            finish = None
            if token in request.stop_ids or (token in self._eos and not request.ignore_eos):
                finish = FINISH_STOP
            elif generated >= request.max_new_tokens or len(request.prompt) + generated > self.max_model_len:
                finish = FINISH_LENGTH  # the next token would have no cache position left
            score = scored.get(request.request_id)
            deltas.append((request.deliver, Delta([token], finish, logprobs=[score] if score is not None else [])))
            if finish is not None:
                self._release(request)
        return deltas

    def _prefill(self, requests: list[SlotRequest]) -> list[tuple[Deliver, Delta]]:
        """The admitted prompts in one padded batch, each past what the prefix cache holds of it;
        their first tokens go to the host (time to first token) and to the decode inputs of their rows."""
        if self.prefixes is not None:
            requests = self._defer_followers(requests)
            for request in requests:  # (a prompt to be scored reuses nothing: its every position's logits are needed)
                wanted = request.wanted if request.prompt_logprobs is None else ()
                request.start = self.prefixes.reuse(request.slot, wanted, self._free)
        slots = [r.slot for r in requests]
        scored = [i for i, r in enumerate(requests) if r.prompt_logprobs is not None]
        logits, every = self._model.prefill([r.prompt for r in requests], slots, [r.start for r in requests], scored)
        for request in requests:
            self._penalties.admitted(request, logits.shape[-1])
            self._bias.admitted(request, logits.shape[-1])
            self._bad_words.admitted(request.slot, request.bad_words, request.prompt[len(request.prompt) - request.drawn:])
        rows = self._torch.tensor(slots, device=self.device)
        held = [(row, r) for row, r in enumerate(requests) if r.min_new_tokens > 0]
        first, picked_from = self._pick(logits, list(requests), rows, held)
        scores = step_scores(picked_from, first, [(r, i) for i, r in enumerate(requests)])
        self._model.feed(first, rows)
        for request in requests:
            request.length, request.launched = len(request.prompt), 1
            self.positions_held += request.length
            self._running[request.slot] = request
            if self.prefixes is not None:  # both begin the prompt's chain
                self.prefixes.prefilled(request.slot, request.prompt, max(request.wanted, request.named, key=len))
        deltas = self._advance(requests, first.cpu().tolist(), scores)
        for request, (_, delta) in zip(requests, deltas, strict=True):
            delta.cached_tokens = request.start
        for place, normed in zip(scored, every, strict=True):
            request = requests[place]
            deltas[place][1].prompt_logprobs = prompt_scores(self._model.logits, normed, request.prompt,
                                                             request.prompt_logprobs or 0)
        return deltas

    def _launch(self) -> _Launched | None:
        """Queue the next decode step for every sequence that still needs a token, without waiting
        for it: its tokens are where the step before, or the prefill, left them on the device."""
        requests = [r for r in self._running.values() if r.launched < r.max_new_tokens and r.length < self.max_model_len]
        if not requests:
            return None
        requests.sort(key=lambda r: r.slot)
        rows, length = self._model.step_shape(requests[-1].slot, max(r.length for r in requests))
        positions = []
        for r in requests:
            positions.append((r.slot, r.length))
            r.length += 1
            r.launched += 1
        self.positions_held += len(requests)
        logits = self._model.decode(rows, length, positions)
        by_row: list[SlotRequest | None] = []
        if self._sampler is not None:
            by_row = [None] * rows
            for r in requests:
                by_row[r.slot] = r
        # launched counts this step's token: the ones before it are launched - 1
        held = [(r.slot, r) for r in requests if r.launched - 1 < r.min_new_tokens]
        next_ids, picked_from = self._pick(logits, by_row, self._penalties.rows(rows), held)
        scores = step_scores(picked_from, next_ids, [(r, r.slot) for r in requests])
        self._model.feed(next_ids)
        return _Launched(requests, self._to_host(next_ids), scores)

    def _collect(self, launched: _Launched) -> list[tuple[Deliver, Delta]]:
        """A launched step's tokens, once the device has them, for the sequences still running."""
        every_row = launched.tokens.result()
        live = [r for r in launched.requests if r.slot >= 0]  # not finished or cancelled meanwhile
        return self._advance(live, [every_row[r.slot] for r in live], launched.scores)

    def _to_host(self, ids: Any) -> _HostCopy:
        """A copy of ``ids`` on its way to the host: on CUDA into one of two pinned buffers (the
        next step's copy goes to the other while this one is read), marked by an event."""
        torch = self._torch
        if self.device.type != "cuda":
            return _HostCopy(ids, None)
        buffer = self._pinned_ids[self._next_ids][: ids.shape[0]]
        self._next_ids ^= 1
        buffer.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _HostCopy(buffer, done)

    def _pick(self, logits: Any, by_row: list[SlotRequest | None], slots: Any,
              held: list[tuple[int, SlotRequest]]) -> tuple[Any, Any]:
        """The next token of each row (of slot ``slots``), on the device, past its request's
        logit bias, penalties and bad words, and with no end token in the ``held`` rows (row, request: short
        of its ``min_new_tokens``): greedy, or with ``do_sample`` the temperature, top-p, top-k,
        min-p and seed of each row's request (``by_row``, read only then; None: a row no request
        holds). With the logits it was picked from (past all that), which log probabilities are of."""
        logits = self._bad_words.apply(self._penalties.apply(self._bias.apply(logits, slots), slots), slots)
        if held:
            logits = logits.clone()
            for row, request in held:
                ends = request.stop_ids if request.ignore_eos else request.stop_ids | self._eos
                if ends:
                    logits[row, self._torch.tensor(sorted(ends), device=self.device)] = float("-inf")
        picked = self._sampler.sample(logits, by_row) if self._sampler is not None else logits.argmax(-1)
        self._penalties.count(slots, picked)
        self._bad_words.picked(slots, picked)
        return picked, logits


@dataclass(slots=True)
class _HostCopy:
    ids: Any  # a host tensor (filled once ``done`` has happened), or the device's where that is the CPU
    done: Any  # a torch.cuda.Event, or None

    def result(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()  # releases the interpreter lock while it waits
        return list(self.ids.tolist())


@dataclass(slots=True)
class _Launched:
    requests: list[SlotRequest]
    tokens: _HostCopy
    scores: StepScores | None = None


def _deliver_all(deltas: list[tuple[Deliver, Delta]]) -> None:
    for deliver, delta in deltas:
        deliver(delta)
