"""A fake of TensorRT-LLM's LLM API, because TensorRT-LLM cannot be installed here (its
PyPI package only downloads NVIDIA's wheel at install time, and no GPU exists).

It reproduces the documented surface the `trtllm` engine uses: ``LLM(model=...)`` with
``.tokenizer`` (a Hugging Face tokenizer loaded from ``model``), ``SamplingParams``, and
``generate_async(inputs, sampling_params, streaming=True)`` returning a ``RequestOutput`` that is
async-iterable, whose ``outputs[0]`` (a ``CompletionOutput``) carries cumulative ``text`` /
``token_ids`` and per-step ``text_diff`` / ``token_ids_diff`` and ``finish_reason`` ("stop",
"length", "cancelled"), with ``finished`` and ``abort()``, with ``SamplingParams.logits_processor``
called on each step's logits, and with ``SamplingParams.logprobs`` a dict of ``Logprob`` for each
token in ``logprobs`` (with ``prompt_logprobs``, one for each prompt token after the first on the
first response; text only while ``SamplingParams.detokenize``; the engine runs ahead of its
reader, queuing a response every ``stream_interval`` steps of the LLM's in the result's ``aqueue``),
and ``get_stats(timeout)``, a list of iteration stats whose ``kvCacheStats`` holds ``maxNumBlocks``,
``usedNumBlocks``, ``freeNumBlocks`` and ``tokensPerBlock`` (blocks held by the unfinished
requests). Tokens are a deterministic function of every token before them, so a continuation after a
prefix equals the uninterrupted output, as greedy decoding does on the real engine.

Block reuse: with ``kv_cache_config=KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=N)``
a prompt's full blocks are kept (the least recently used evicted past ``MAX_BLOCKS``) and
``get_kv_cache_events(timeout)`` returns, as the real engine's serializer writes them, ``stored``
events (``parent_hash`` and ``blocks`` of ``block_hash`` and ``tokens`` of ``unique_token``) and
``removed`` events (``block_hashes``). Block hashes are the fake's own, as the engine's are.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer

STEP_SECONDS = 0.002


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool = False  # False: a stop string's tokens are trimmed off the output
    end_id: int | None = None
    ignore_eos: bool = False  # the fake never samples the end token (see _next_token)
    detokenize: bool = True  # False: outputs carry token ids only, no text
    presence_penalty: float = 0.0  # the fake: any penalty moves on past tokens the output holds
    frequency_penalty: float = 0.0
    prompt_ignore_length: int = 0  # tokens at the input's start the penalties do not count
    logprobs: int | None = None  # the sampled token's log probability and this many likeliest tokens'
    # Called with each step's logits ([1, 1, vocabulary] here) to change them in place: one or a list.
    logits_processor: Any = None
    top_k: int | None = None  # the fake decodes greedily: the likeliest token is in any top k
    min_p: float | None = None
    repetition_penalty: float | None = None  # the fake: above 1 moves on past tokens the input or output holds
    min_tokens: int | None = None  # stop_token_ids are passed over until the output holds this many
    stop_token_ids: list[int] | None = None  # end the output ("stop") as the end token would
    guided_decoding: Any = None  # llmapi.GuidedDecodingParams: the output is its answer's tokens, then "stop"
    prompt_logprobs: int | None = None  # each prompt token's after the first, with this many likeliest
    bad: str | list[str] | None = None  # words (each tokenized as it is) whose last token never ends them


@dataclass
class Logprob:
    """``tensorrt_llm.executor.result.Logprob``: a token's log probability and its rank (1: likeliest)."""

    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs, one dict a token as vLLM's (TokenLogprobs): the sampled token's
    # and the ``logprobs`` likeliest tokens' Logprob, by token id.
    logprobs: list[dict[int, Logprob]] | None = None
    # With SamplingParams.prompt_logprobs, on the first response: a dict for each prompt token after the
    # first, its own Logprob and its place's likeliest tokens'.
    prompt_logprobs: list[dict[int, Logprob]] | None = None


class ResponseQueue:
    """``tensorrt_llm.llmapi.utils.AsyncQueue``, the part a result uses: responses the engine
    produced and the reader has not handled yet; ``get`` returns at once while one waits."""

    def __init__(self) -> None:
        self._responses: deque[tuple[str | None, list[int]]] = deque()
        self._event = asyncio.Event()

    def empty(self) -> bool:
        return not self._responses

    def put(self, response: tuple[str | None, list[int]]) -> None:
        self._responses.append(response)
        self._event.set()

    async def get(self) -> tuple[str | None, list[int]]:
        while not self._responses:
            await self._event.wait()
        response = self._responses.popleft()
        if not self._responses:
            self._event.clear()
        return response


class RequestOutput:
    """The LLM API's ``GenerationResult``: the engine runs ahead of the reader (a task here, its
    own threads there), putting a response every ``stream_interval`` iterations (the LLM's
    setting) into ``aqueue``; each ``__anext__`` handles one response, updating ``outputs``."""

    def __init__(self, llm: LLM, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._llm = llm
        self.prompt_token_ids = prompt_token_ids
        self._params = params
        self.outputs = [CompletionOutput()]
        self.finished = False
        self.generated: list[int] = []  # the engine's side: what its KV cache holds
        self.aqueue = ResponseQueue()
        self._abort_requested = False
        self._guided = self._guided_tokens()
        self._stop_ids = {stop: ids for stop in params.stop or []
                          if (ids := llm.tokenizer.encode(stop, add_special_tokens=False))}
        bad = [params.bad] if isinstance(params.bad, str) else params.bad or []
        self._bad_ids = [ids for word in bad if (ids := llm.tokenizer.encode(word, add_special_tokens=False))]
        self._engine = asyncio.get_running_loop().create_task(self._iterate())

    def abort(self) -> None:
        self._abort_requested = True

    async def _iterate(self) -> None:
        interval = self._llm.kwargs.get("stream_interval", 1)
        tokenizer, pending, guided = self._llm.tokenizer, [], self._guided
        while True:
            await asyncio.sleep(STEP_SECONDS)
            if self._abort_requested:
                self.aqueue.put(("cancelled", []))
                return
            held = set(self._params.stop_token_ids or []) if len(self.generated) < (self._params.min_tokens or 0) else set()
            token = (guided[len(self.generated)] if guided is not None else
                     self._llm.token_for(self.prompt_token_ids + self.generated,
                                         self._penalized() | held | self._banned(), self._logits_processors()))
            self.generated.append(token)
            pending.append(token)
            # Stop strings end generation whether or not outputs carry text, matched as the real
            # engine matches them: as their token sequences, at the output's end (the same text
            # made of other tokens goes on; the adapter's own filter stops it then).
            reason = None
            reached = [stop for stop, ids in self._stop_ids.items() if self.generated[-len(ids):] == ids]
            if (reached or token == tokenizer.eos_token_id
                    or token in (self._params.stop_token_ids or []) or guided == self.generated):
                reason = "stop"
            if reached and not self._params.include_stop_str_in_output:
                # The real engine trims the stop word's tokens off the output (as many as it has).
                trimmed = len(tokenizer.encode(reached[0], add_special_tokens=False))
                pending = pending[:max(len(pending) - trimmed, 0)]
            elif len(self.generated) >= self._params.max_tokens:
                reason = "length"
            if reason is not None or len(pending) >= interval:
                self.aqueue.put((reason, pending))
                pending = []
            if reason is not None:
                return

    def _penalized(self) -> set[int]:
        """The tokens the penalties count: the input's after ``prompt_ignore_length`` and the output's
        (a repetition penalty: the whole input's, as TensorRT-LLM's ``prompt_ignore_length`` is for the
        presence and frequency penalties alone)."""
        params = self._params
        if (params.repetition_penalty or 1) > 1:
            return set(self.prompt_token_ids + self.generated)
        if not (params.presence_penalty or params.frequency_penalty):
            return set()
        return set(self.prompt_token_ids[params.prompt_ignore_length:] + self.generated)

    def _banned(self) -> set[int]:
        """The bad words' last tokens the next may not be: each where the output ends with the rest of it."""
        return {ids[-1] for ids in self._bad_ids
                if len(ids) == 1 or self.generated[len(self.generated) - len(ids) + 1:] == ids[:-1]}

    def _guided_tokens(self) -> list[int] | None:
        """A guided request's whole output (its answer's tokens); None for an unguided one. The real
        engine cannot guide without a backend: neither can the fake."""
        if self._params.guided_decoding is None:
            return None
        if not self._llm.kwargs.get("guided_decoding_backend"):
            raise ValueError("guided decoding needs the LLM's guided_decoding_backend")
        return self._llm.tokenizer.encode(self._params.guided_decoding.answer(), add_special_tokens=False)

    def _logits_processors(self) -> list[Any]:
        processors = self._params.logits_processor
        return [] if processors is None else list(processors) if isinstance(processors, list) else [processors]

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        reason, tokens = await self.aqueue.get()
        completion = self.outputs[0]
        completion.token_ids_diff = tokens
        completion.token_ids = completion.token_ids + tokens
        if self._params.logprobs is not None:
            completion.logprobs = (completion.logprobs or []) + [self._llm.logprobs_of(t, self._params.logprobs)
                                                                 for t in tokens]
        if self._params.prompt_logprobs and completion.prompt_logprobs is None:
            completion.prompt_logprobs = self._llm.prompt_logprobs_of(self.prompt_token_ids, self._params.prompt_logprobs)
        if self._params.detokenize:
            text = self._llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            stops = [i for stop in self._params.stop or [] if (i := text.find(stop)) != -1]
            text = text[: min(stops)] if stops else text
            completion.text_diff, completion.text = text[len(completion.text):], text
        completion.finish_reason = reason
        self.finished = reason is not None
        return self


MAX_BLOCKS = 256
TOKENS_PER_BLOCK = 32


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.kwargs = kwargs
        self._vocab = len(self.tokenizer)
        self._requests: list[RequestOutput] = []
        config = kwargs.get("kv_cache_config")
        self._reuse = bool(config and config.enable_block_reuse and config.event_buffer_max_size)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._events: list[dict[str, Any]] = []
        self._event_ids = 0

    def _event(self, data: dict[str, Any]) -> None:
        self._events.append({"event_id": self._event_ids, "data": data, "window_size": 4096})
        self._event_ids += 1

    def _keep_prompt_blocks(self, prompt: list[int]) -> None:
        parent, new_blocks, new_parent = None, [], None
        for start in range(0, len(prompt) - TOKENS_PER_BLOCK + 1, TOKENS_PER_BLOCK):
            tokens = prompt[start:start + TOKENS_PER_BLOCK]
            block_hash = zlib.adler32(bytes(str((parent, tokens)), "ascii"))
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
            else:
                if not new_blocks:
                    new_parent = parent
                new_blocks.append({"type": "stored_block", "block_hash": block_hash, "lora_id": None,
                                   "cache_level": 0, "priority": 35,
                                   "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                              for t in tokens]})
                self._blocks[block_hash] = None
            parent = block_hash
        if new_blocks:
            self._event({"type": "stored", "parent_hash": new_parent, "blocks": new_blocks})
        evicted = []
        while len(self._blocks) > MAX_BLOCKS:
            evicted.append(self._blocks.popitem(last=False)[0])
        if evicted:
            self._event({"type": "removed", "block_hashes": evicted})

    def get_kv_cache_events(self, timeout: float | None = None) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def get_stats(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        self._requests = [r for r in self._requests if not r._engine.done()]
        used = sum(-(-(len(r.prompt_token_ids) + len(r.generated)) // TOKENS_PER_BLOCK)
                   for r in self._requests)
        return [{"iter": 0, "kvCacheStats": {"maxNumBlocks": MAX_BLOCKS, "usedNumBlocks": used,
                                             "freeNumBlocks": MAX_BLOCKS - used, "tokensPerBlock": TOKENS_PER_BLOCK}}]

    def token_for(self, context: list[int], penalized: Collection[int] = (), processors: list[Any] = ()) -> int:
        # Never the EOS token, so outputs run to max_tokens or a stop string, like ignore_eos; a
        # penalty passes over the tokens it counts (as a large one does), while others are left.
        # Logits processors see logits where the fake's pick is 1 and every other token 0, and the
        # likeliest token after them is picked (the lowest id among equals).
        token = zlib.crc32(bytes(str(context[-8:]), "ascii")) % self._vocab
        if processors:
            logits = torch.zeros(1, 1, self._vocab)
            logits[..., token] = 1.0
            for processor in processors:
                processor(0, logits, [list(context)], None, None)
            logits[..., self.tokenizer.eos_token_id] = -math.inf
            token = int(logits.argmax())
        while token == self.tokenizer.eos_token_id or (token in penalized and len(penalized) < self._vocab - 1):
            token = (token + 1) % self._vocab
        return token

    def logprobs_of(self, token: int, top: int) -> dict[int, Logprob]:
        """The fake's distribution at a place: the token it picked is the likeliest, at -0.25, and
        the ids after it follow, one nat apart each (the picked one is rank 1, as greedy decoding's)."""
        likeliest = {(token + j) % self._vocab: Logprob(-0.25 - j, j + 1) for j in range(top)}
        return {token: Logprob(-0.25, 1), **likeliest}

    def prompt_logprobs_of(self, prompt: list[int], top: int) -> list[dict[int, Logprob]]:
        """Each prompt token after the first scored at its place: the fake's distribution after the
        tokens before it (``logprobs_of`` its pick), the prompt's own token at -10 where it is not
        among the likeliest."""
        entries = []
        for place in range(1, len(prompt)):
            entry = self.logprobs_of(self.token_for(prompt[:place]), top)
            entries.append({prompt[place]: entry.get(prompt[place], Logprob(-10.0)), **entry})
        return entries

    def generate_async(self, inputs: list[int], sampling_params: SamplingParams | None = None,
                       streaming: bool = False) -> RequestOutput:
        if not streaming:
            raise NotImplementedError("the fake only streams")
        if isinstance(inputs, str):
            inputs = self.tokenizer.encode(inputs)
        output = RequestOutput(self, list(inputs), sampling_params or SamplingParams())
        self._requests.append(output)
        if self._reuse:
            self._keep_prompt_blocks(list(inputs))
        return output

    def shutdown(self) -> None:
        # Called from a thread (the engine awaits it with asyncio.to_thread), as the real one may be.
        for request in self._requests:
            request._engine.get_loop().call_soon_threadsafe(request._engine.cancel)
