"""TensorRT-LLM, the production GPU engine, through its LLM API:
``LLM(model=...).generate_async(prompt_token_ids, sampling_params, streaming=True)``.

``tensorrt_llm`` is imported only when this engine starts: it exists only on GPU hosts
with NVIDIA's wheels (see README, "Deploying on a GPU host"). TensorRT-LLM runs its own
in-flight batching and paged KV cache; the worker's ``max_num_seqs`` should not exceed
the engine's ``max_batch_size``. Its KV-cache block reuse gives prefix caching; the KV-cache
events it publishes (``KvCacheConfig(event_buffer_max_size=...)``, read with
``LLM.get_kv_cache_events``) tell ``TrtPrefixCache`` which blocks it holds, for KV-cache-aware
routing and the ``cached_tokens`` of each request. A request's presence and frequency penalties
count its output alone (``prompt_ignore_length``: TensorRT-LLM counts the prompt's tokens too
unless told; its SamplingParams has taken it since 1.1). A request's logit bias and allowed tokens
are a logits processor of its own (``TokenBias``), its row as long as the logits it is given (the
model's padded vocabulary, which ``embedding_bias`` would need known beforehand). A JSON or
regular expression ``response_format`` is its guided decoding (``GuidedDecodingParams``), where
the LLM was given a ``guided_decoding_backend`` (``TOKENBUS_TRTLLM_GUIDED_DECODING_BACKEND``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.gpu_consumers.engines import chat_template
from tokenbus.gpu_consumers.engines.bad_words import bad_word_variants
from tokenbus.gpu_consumers.engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    InvalidInput,
    PromptLayout,
    SamplingParams,
    StepOutput,
    check_prompt_scores,
    check_token_ids,
)
from tokenbus.gpu_consumers.engines.bias_rows import write_bias_row
from tokenbus.gpu_consumers.engines.blocks import chain_hash
from tokenbus.gpu_consumers.engines.detokenize import IncrementalDetokenizer, StopFilter, TokenTexts, held_back_text
from tokenbus.schemas import RESPONSE_JSON_SCHEMA, RESPONSE_REGEX, RESPONSE_TEXT, TokenLogprob, TopLogprob
from tokenbus.topics import cancel_task

log = logging.getLogger(__name__)

KNOWN_FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "cancelled": FINISH_CANCELLED}
STATS_EVERY_S = 1.0
STATS_TIMEOUT_S = 0.5
KV_EVENTS_EVERY_S = 0.2


def kv_cache_usage_of(entry: Any) -> float | None:
    """Used over maximum blocks from one iteration's stats (a dict, or its JSON text)."""
    if isinstance(entry, str):
        entry = json.loads(entry)
    kv = entry.get("kvCacheStats") if isinstance(entry, dict) else None
    if not kv or not kv.get("maxNumBlocks"):
        return None
    return min(1.0, kv["usedNumBlocks"] / kv["maxNumBlocks"])


class TrtLlmEngineSettings(BaseSettings):
    """``TOKENBUS_TRTLLM_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_TRTLLM_", extra="ignore")

    model: str = ""  # a Hugging Face model directory or name, or a built engine directory
    tokenizer: str = ""
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    kv_cache_free_gpu_memory_fraction: float = 0.85
    enable_block_reuse: bool = True
    tokens_per_block: int = 32  # the engine's KV-cache block size (TensorRT-LLM's default)
    kv_event_buffer: int = 4096  # KV-cache events the engine buffers between reads (0: none, no reports)
    # A response every this many engine iterations, with their tokens: fewer, larger steps for the
    # consumer's event loop to handle (the LLM API's ``stream_interval``, of its PyTorch backend).
    # 1: every iteration, and the setting is not passed (other backends do not take it).
    stream_interval: int = Field(default=1, ge=1)
    default_max_tokens: int = 256
    # The LLM API's ``guided_decoding_backend`` (``xgrammar`` or ``llguidance``), which a JSON or
    # regular expression ``response_format`` needs; "" (the default): none, and such requests are refused.
    guided_decoding_backend: str = ""


def _token_id(token: Any) -> int:
    return int(token["token_id"]) if isinstance(token, dict) else int(token)


class TokenBias:
    """A request's logit bias and vLLM's ``allowed_token_ids`` as a TensorRT-LLM logits processor
    (the LLM API's ``LogitsProcessor`` signature): a row over the vocabulary (each bias where named,
    -inf for every token not allowed), made at the first call from the logits' own size, device and
    dtype, and added to them in place each step before sampling, on the CUDA stream the engine
    names where it names one."""

    def __init__(self, biases: tuple[tuple[int, float], ...], allowed: tuple[int, ...] = ()) -> None:
        self._biases, self._allowed = biases, allowed
        self._row: Any = None

    def __call__(self, req_id: int, logits: Any, token_ids: list[list[int]], stream_ptr: int | None,
                 client_id: int | None) -> None:
        import torch

        on_stream = torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr)) if stream_ptr else contextlib.nullcontext()
        with on_stream:
            row = self._row
            if row is None or row.shape[-1] != logits.shape[-1] or row.device != logits.device or row.dtype != logits.dtype:
                self._row = row = self._made_row(torch, logits)
            logits += row

    def _made_row(self, torch: Any, logits: Any) -> Any:
        row = torch.empty(logits.shape[-1], device=logits.device)  # (float32: a bias adds in it exactly)
        write_bias_row(row, self._biases, self._allowed)
        return row.to(logits.dtype)


class TrtPrefixCache:
    """The blocks TensorRT-LLM holds, from its KV-cache events: ``stored`` (blocks with their tokens,
    chained to a parent) and ``removed``. Its own block hashes cannot be computed outside the engine,
    so each stored block is renamed by our chain hash over its tokens (engines/blocks.py), which a
    prompt's blocks can be named by too."""

    def __init__(self, tokenizer: Any, block_tokens: int, prompt_tokens: chat_template.PromptTokens) -> None:
        self.block_tokens = block_tokens
        self._segment_ends = chat_template.SegmentEnds(tokenizer)
        self._prompt_tokens = prompt_tokens  # the engine's: a request's prompt is tokenized and named once
        prompt_tokens.name_blocks(block_tokens, chain_hash)
        self._ours: dict[int, int] = {}  # the engine's block hash -> ours
        self.held: set[int] = set()

    def apply(self, events: Iterable[Any]) -> None:
        for event in events:
            data = (json.loads(event) if isinstance(event, str) else event).get("data") or {}
            if data.get("type") == "stored":
                parent = data.get("parent_hash")
                ours = None if parent is None else self._ours.get(parent)
                if parent is not None and ours is None:
                    continue  # its parent's tokens were never seen (events dropped): cannot be named
                for block in data.get("blocks") or []:
                    ours = chain_hash(ours, [_token_id(t) for t in block.get("tokens") or []])
                    self._ours[block["block_hash"]] = ours
                    self.held.add(ours)
            elif data.get("type") == "removed":
                for engine_hash in data.get("block_hashes") or []:
                    self.held.discard(self._ours.pop(engine_hash, 0))

    def cached_tokens(self, prompt: chat_template.Prompt) -> int:
        return prompt.reusable_tokens(self.block_tokens, self.held)

    def layout(self, inp: GenerationInput) -> PromptLayout:
        prompt = self._prompt_tokens.prompt(inp)
        return PromptLayout(self.block_tokens, prompt.blocks, self._segment_ends(inp, prompt.ids, prompt.rendered))

    def resident(self, hashes: Iterable[int]) -> set[int]:
        return {h for h in hashes if h in self.held}


class _TrtStream:
    """Adapts a streaming ``RequestOutput``. Text comes from our own detokenizer over prefix and
    new tokens, not TensorRT-LLM's ``text_diff``: after a takeover the engine sees the prefix as
    prompt and would decode the new tokens on their own, which can differ at the boundary. So the
    LLM API is asked for token ids only (``detokenize=False``): by default it decodes every
    response's tokens itself, in the process that reads them, which would double that cost.
    ``output`` is None for a sequence taken over at its token limit: it only ends."""

    def __init__(self, output: Any | None, inp: GenerationInput, tokenizer: Any, token_texts: TokenTexts,
                 prompt_tokens: int, cached_tokens: int = 0, scored_prompt: list[int] | None = None) -> None:
        self._output = output
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens
        self._detokenizer = IncrementalDetokenizer(tokenizer, inp.prefix_token_ids, inp.prefix_text)
        self._stops = StopFilter(inp.sampling.stop, inp.sampling.min_tokens, inp.sampling.include_stop_str_in_output)
        self._aborted = False
        self._top_logprobs = inp.sampling.logprobs
        self._token_texts = token_texts
        self._scored_prompt = scored_prompt  # its ids, where its log probabilities are asked, till they come
        self._top_prompt_logprobs = inp.sampling.prompt_logprobs or 0

    def abort(self) -> None:
        if not self._aborted and self._output is not None and not self._output.finished:
            self._aborted = True
            self._output.abort()

    def _step(self, text: str, ids: tuple[int, ...], reason: str | None = None, error: str | None = None,
              logprobs: tuple[TokenLogprob, ...] = (), prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> StepOutput:
        return StepOutput(text, ids, self._prompt_tokens, len(self._detokenizer.token_ids), reason, error,
                          self._cached_tokens, logprobs, prompt_logprobs)

    def _logprobs(self, completion: Any, start: int, ids: tuple[int, ...]) -> tuple[TokenLogprob, ...]:
        """The LLM API's ``logprobs`` of the tokens from ``start``: a dict of ``Logprob`` a token,
        the sampled one's and the likeliest ones' (vLLM's form), or a build's plain float a token,
        the sampled one's alone (no likeliest then). A build that leaves the sampled token out
        where it is not among the likeliest gives it the least shown, an upper bound."""
        if self._top_logprobs is None:
            return ()
        entries = (getattr(completion, "logprobs", None) or [])[start:start + len(ids)]
        if len(entries) != len(ids):
            raise RuntimeError("TensorRT-LLM returned no log probabilities (a TensorRT engine needs "
                               "gather_generation_logits; the PyTorch backend computes them)")
        return tuple(self._scored(token_id, entry, self._top_logprobs) for token_id, entry in zip(ids, entries, strict=True))

    def _prompt_logprobs(self, completion: Any) -> tuple[TokenLogprob, ...]:
        """The prompt's, from the first response: its first token unscored, then the LLM API's
        ``prompt_logprobs`` (an entry a later token; a build that gives the first an entry too, as
        vLLM's None, has it passed over)."""
        prompt, self._scored_prompt = self._scored_prompt, None
        assert prompt
        entries = list(getattr(completion, "prompt_logprobs", None) or [])
        if len(entries) == len(prompt):
            entries = entries[1:]
        if len(entries) != len(prompt) - 1:
            raise RuntimeError("TensorRT-LLM returned no log probabilities of the prompt (a TensorRT engine needs "
                               "gather_context_logits; the PyTorch backend computes them)")
        return (TokenLogprob(self._token_texts(prompt[0]), 0.0),
                *(self._scored(token_id, entry, self._top_prompt_logprobs)
                  for token_id, entry in zip(prompt[1:], entries, strict=True)))

    def _scored(self, token_id: int, entry: Any, top: int) -> TokenLogprob:
        """A token's entry: a dict of ``Logprob``, the token's own and the likeliest tokens' (a build
        that leaves the token out where it is not among them gives it the least shown, an upper
        bound), or a build's plain float (no likeliest then)."""
        if isinstance(entry, float | int):
            return TokenLogprob(self._token_texts(token_id), float(entry))
        ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)
        own = entry.get(token_id)
        logprob = own.logprob if own is not None else ranked[-1][1].logprob
        return TokenLogprob(self._token_texts(token_id), logprob,
                            [TopLogprob(self._token_texts(t), lp.logprob) for t, lp in ranked[:top]])

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        if self._output is None:  # taken over at its limit: nothing to generate
            yield self._step(held_back_text(self._detokenizer, self._stops), (), FINISH_LENGTH)
            return
        output = self._output
        waiting = getattr(output, "aqueue", None)  # the LLM API's responses not handled yet
        read = 0  # of the output's token ids
        try:
            async for out in output:
                if self._aborted:
                    yield self._step("", (), FINISH_CANCELLED)
                    return
                # A reader that fell behind handles the responses that waited now and gives them
                # out as one step (vLLM's output collector merges a slow reader's deltas the same
                # way): one token event for them, not one each, just when the worker must catch up.
                while waiting is not None and not out.finished and not waiting.empty():
                    await output.__anext__()  # returns at once: a response is waiting
                completion = out.outputs[0]
                start = read
                ids, read = tuple(completion.token_ids[read:]), len(completion.token_ids)
                logprobs = self._logprobs(completion, start, ids)
                scored_prompt = self._prompt_logprobs(completion) if self._scored_prompt is not None else ()
                text, stopped = self._stops.feed(self._detokenizer.push(ids), len(self._detokenizer.token_ids))
                if stopped:
                    self.abort()
                    yield self._step(text, ids, FINISH_STOP, logprobs=logprobs, prompt_logprobs=scored_prompt)
                    return
                if out.finished:
                    reason = KNOWN_FINISH_REASONS.get(completion.finish_reason or "stop", FINISH_STOP)
                    yield self._step(text + self._stops.flush(), ids, reason, logprobs=logprobs,
                                     prompt_logprobs=scored_prompt)
                    return
                yield self._step(text, ids, logprobs=logprobs, prompt_logprobs=scored_prompt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine failed this request
            yield self._step("", (), FINISH_ERROR, str(exc))
            return
        if self._aborted:
            yield self._step("", (), FINISH_CANCELLED)


class TrtLlmEngine:
    name = "trtllm"

    def __init__(self, settings: TrtLlmEngineSettings | None = None) -> None:
        self.settings = settings or TrtLlmEngineSettings()
        self._llm: Any = None
        self._sampling_params: Any = None
        self._guided_decoding: Any = None
        self._kv_cache_usage: float | None = None
        self._stats: asyncio.Task[None] | None = None
        self._kv_events: asyncio.Task[None] | None = None
        self._prompt_tokens: chat_template.PromptTokens | None = None
        self._token_texts: TokenTexts | None = None
        self.prefix_cache: TrtPrefixCache | None = None

    async def start(self) -> None:
        try:
            from tensorrt_llm import LLM, SamplingParams
            from tensorrt_llm.llmapi import GuidedDecodingParams, KvCacheConfig
        except ImportError as exc:
            raise RuntimeError("the trtllm engine needs NVIDIA's tensorrt_llm on a GPU host; see the README") from exc
        s = self.settings
        if not s.model:
            raise RuntimeError("set TOKENBUS_TRTLLM_MODEL to a model directory or name")
        self._sampling_params = SamplingParams
        self._guided_decoding = GuidedDecodingParams
        kv_cache = KvCacheConfig(enable_block_reuse=s.enable_block_reuse,
                                 free_gpu_memory_fraction=s.kv_cache_free_gpu_memory_fraction,
                                 event_buffer_max_size=s.kv_event_buffer if s.enable_block_reuse else 0)
        extra: dict[str, Any] = {"stream_interval": s.stream_interval} if s.stream_interval > 1 else {}
        if s.guided_decoding_backend:
            extra["guided_decoding_backend"] = s.guided_decoding_backend
        self._llm = await asyncio.to_thread(
            LLM, model=s.model, tokenizer=s.tokenizer or None, max_batch_size=s.max_batch_size,
            max_num_tokens=s.max_num_tokens, kv_cache_config=kv_cache, **extra,
        )
        self._prompt_tokens = chat_template.PromptTokens(self._llm.tokenizer)
        self._token_texts = TokenTexts(self._llm.tokenizer)
        self._stats = asyncio.create_task(self._watch_stats(), name="trtllm-stats")
        if s.enable_block_reuse and s.kv_event_buffer and hasattr(self._llm, "get_kv_cache_events"):
            self.prefix_cache = TrtPrefixCache(self._llm.tokenizer, s.tokens_per_block, self._prompt_tokens)
            self._kv_events = asyncio.create_task(self._watch_kv_events(self.prefix_cache), name="trtllm-kv-events")

    def kv_cache_usage(self) -> float | None:
        return self._kv_cache_usage

    async def _watch_stats(self) -> None:
        """TensorRT-LLM reports per-iteration stats (``LLM.get_stats``), with the KV cache's
        ``kvCacheStats``; the latest one that has them sets the usage."""
        while True:
            try:
                stats = await asyncio.to_thread(self._llm.get_stats, STATS_TIMEOUT_S)
            except Exception:  # a build without iteration stats: the gauge stays unset
                return
            for entry in reversed(stats or []):
                usage = kv_cache_usage_of(entry)
                if usage is not None:
                    self._kv_cache_usage = usage
                    break
            await asyncio.sleep(STATS_EVERY_S)

    async def _watch_kv_events(self, cache: TrtPrefixCache) -> None:
        while True:
            try:
                events = await asyncio.to_thread(self._llm.get_kv_cache_events, STATS_TIMEOUT_S)
            except Exception as exc:  # a build without KV-cache events: nothing is reported
                log.warning("no KV-cache events from TensorRT-LLM (%s): its cache is not reported", exc)
                self.prefix_cache = None
                return
            cache.apply(events or [])
            await asyncio.sleep(KV_EVENTS_EVERY_S)

    async def close(self) -> None:
        await cancel_task(self._kv_events)
        await cancel_task(self._stats)
        if self._llm is not None and hasattr(self._llm, "shutdown"):
            await asyncio.to_thread(self._llm.shutdown)

    async def prepare(self, inp: GenerationInput) -> None:
        """The prompt templated and tokenized in a thread (chat_template.PromptTokens)."""
        if self._prompt_tokens is not None:
            await asyncio.to_thread(self._prompt_tokens.prepare, inp)

    def _guide(self, sampling: SamplingParams) -> Any:
        """The LLM API's ``GuidedDecodingParams`` for a structured ``response_format`` (JSON, or a
        regular expression; None for text); ``InvalidInput`` where no guided decoding backend is
        configured."""
        if sampling.response_format == RESPONSE_TEXT:
            return None
        if not self.settings.guided_decoding_backend:
            raise InvalidInput(f"response_format {sampling.response_format} needs a guided decoding backend "
                               "(TOKENBUS_TRTLLM_GUIDED_DECODING_BACKEND=xgrammar)")
        if sampling.response_format == RESPONSE_JSON_SCHEMA:
            return self._guided_decoding(json=sampling.json_schema)
        if sampling.response_format == RESPONSE_REGEX:
            return self._guided_decoding(regex=sampling.guided_regex)
        return self._guided_decoding(json_object=True)

    def _encode_word(self, text: str) -> list[int]:
        return list(self._llm.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, inp: GenerationInput) -> _TrtStream:
        assert self._prompt_tokens is not None and self._token_texts is not None, "the engine is not started"
        tokenizer = self._llm.tokenizer  # the LLM API's wraps a Hugging Face one as .tokenizer
        vocabulary = len(getattr(tokenizer, "tokenizer", tokenizer))
        check_token_ids(inp.prompt_token_ids + inp.prefix_token_ids, vocabulary)
        check_token_ids(inp.sampling.named_token_ids, vocabulary)
        made = self._prompt_tokens.prompt(inp)
        prompt = made.ids
        if not inp.prefix_token_ids:  # (a taken-over sequence's prompt is not scored again)
            check_prompt_scores(len(prompt), inp.sampling)
        s = inp.sampling
        remaining = (s.max_tokens or self.settings.default_max_tokens) - len(inp.prefix_token_ids)
        cached = self.prefix_cache.cached_tokens(made) if self.prefix_cache is not None else 0
        if remaining <= 0:
            return _TrtStream(None, inp, self._llm.tokenizer, self._token_texts, len(prompt), cached)
        scored = s.prompt_logprobs is not None and not inp.prefix_token_ids  # (a takeover's were published)
        penalties = {}
        if s.penalized:  # on the output alone, as OpenAI's: a takeover's prefix is output, the prompt is not
            penalties = dict(presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                             prompt_ignore_length=len(prompt))
        params = self._sampling_params(
            max_tokens=remaining,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            # (its own stop words are no min_tokens' concern: with one, the adapter's StopFilter alone stops it)
            stop=(list(s.stop) or None) if not s.min_tokens else None,
            include_stop_str_in_output=s.include_stop_str_in_output,  # (else it trims the stop's tokens off)
            ignore_eos=s.ignore_eos,
            detokenize=False,  # _TrtStream detokenizes; the LLM API would do it again on this event loop
            logprobs=s.logprobs,
            logits_processor=TokenBias(s.logit_bias, s.allowed_token_ids) if s.logit_bias or s.allowed_token_ids else None,
            top_k=s.top_k or None,  # vLLM's extensions, TensorRT-LLM's own parameters (None: its defaults)
            min_p=s.min_p or None,
            repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1 else None,
            min_tokens=s.min_tokens - len(inp.prefix_token_ids) if s.min_tokens > len(inp.prefix_token_ids) else None,
            stop_token_ids=list(s.stop_token_ids) or None,
            # vLLM's bad words as TensorRT-LLM's own, in each reading vLLM makes of one (engines/bad_words.py)
            bad=[text for text, _ in bad_word_variants(s.bad_words, self._encode_word)] or None,
            guided_decoding=self._guide(s),
            # (at least one: a build may take 0 for none, as its ``logprobs`` does; the likeliest are cut to those asked)
            prompt_logprobs=max(s.prompt_logprobs or 0, 1) if scored else None,
            **penalties,
        )
        # A taken-over sequence continues after the tokens already published.
        output = self._llm.generate_async(prompt + list(inp.prefix_token_ids), params, streaming=True)
        return _TrtStream(output, inp, self._llm.tokenizer, self._token_texts, len(prompt), cached,
                          scored_prompt=prompt if scored else None)
