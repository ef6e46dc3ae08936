"""Hugging Face transformers: CPU here, CUDA where present, batched one of two ways.

**Slots** (engines/hf_slots.py; the default on CUDA for Llama-shaped models): each running sequence
owns a row of a static KV cache and every decode step is replayed as a CUDA graph
(engines/hf_slot_model.py), one step queued ahead of the host. **The manager** (the default
elsewhere): transformers' continuous-batching manager runs generation steps on its own thread over
a paged KV cache sized explicitly (``num_blocks``, ``max_batch_tokens``). Either hands each step's
tokens back to the event loop as deltas. Decoding is greedy, so a taken-over sequence continues
exactly as the uninterrupted one would, unless ``TOKENBUS_HF_DO_SAMPLE`` is set. Sampling then
honours each request's temperature and top-p; the slots also its ``seed`` (the same tokens in any
batch, and across a takeover), while the manager samples every request from one generator.
OpenAI's presence and frequency penalties are the slots' alone (engines/hf_slot_penalties.py,
greedy or sampled): the manager's logits processors take no per-request penalty, so it generates
a penalized request as an unpenalized one and says so in the log, once. The slots score the
tokens of the requests that ask for log probabilities, with their likeliest tokens
(hf_slot_logprobs.py); the manager computes the sampled token's alone, for every request
(``TOKENBUS_HF_MANAGER_LOGPROBS``, on by default), so it answers ``logprobs`` but refuses
``top_logprobs`` with an error that says so. A ``logit_bias`` is the slots' too (hf_slot_bias.py),
as are vLLM's ``allowed_token_ids`` (the bias row), ``bad_words`` (hf_slot_bad_words.py),
``min_tokens`` and repetition penalty (hf_slot_penalties.py), its ``top_k`` and ``min_p`` where
requests are sampled, and the prompt's log probabilities (a text completion's ``echo``: the
prompt prefilled whole, its every position scored): the manager refuses them (a bias is often a
ban, which must not be dropped quietly). Both end a request at its ``stop_token_ids`` (the
manager takes them as the request's own end tokens). Neither constrains its output to JSON: a
JSON ``response_format`` is refused (TensorRT-LLM's guided decoding serves it).

Prefix caching (``TOKENBUS_HF_PREFIX_CACHING``, on by default): a prompt's leading blocks of
``page_size`` tokens already computed are reused. The manager shares KV blocks between requests
(``allow_block_sharing``); the slots keep what a slot held after its sequence ended and copy a
prefix between slots (hf_slots.py). What either holds is what ``HfPrefixCache`` reports for
KV-cache-aware routing, and what ``cached_tokens`` counts.

Which model runs, on which device and batched which way: engines/hf_loading.py; each request's
stream, its deltas made into steps: engines/hf_sequence.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Callable, Container, Iterable
from typing import Any

from tokenbus.gpu_consumers.engines import chat_template
from tokenbus.gpu_consumers.engines.bad_words import token_bad_words
from tokenbus.gpu_consumers.engines.base import (
    FINISH_LENGTH,
    GenerationInput,
    InvalidInput,
    PromptLayout,
    SamplingParams,
    check_prompt_scores,
    check_token_ids,
)
from tokenbus.gpu_consumers.engines.blocks import ChainHash, chain_hash
from tokenbus.gpu_consumers.engines.detokenize import TokenTexts
from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings, batching_config, load_model, uses_slots
from tokenbus.gpu_consumers.engines.hf_sequence import HfSequence
from tokenbus.gpu_consumers.engines.hf_slots import SlotBatcher, SlotRequest
from tokenbus.schemas import RESPONSE_TEXT

log = logging.getLogger(__name__)

class HfPrefixCache:
    """The blocks of prompt tokens the engine holds, named as the batching names them: the manager's
    shared blocks by transformers' ``compute_block_hash`` (looked up in its ledger without touching
    the cache), the slots' by blocks.chain_hash (``SlotPrefixes.held``)."""

    def __init__(self, engine: HfEngine, block_tokens: int, chain: ChainHash,
                 held: Callable[[], Container[int]]) -> None:
        self._engine = engine
        self.chain = chain
        self._held = held
        self.block_tokens = block_tokens
        self._segment_ends = chat_template.SegmentEnds(engine.tokenizer)

    @classmethod
    def of_manager(cls, engine: HfEngine, block_tokens: int) -> HfPrefixCache:
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

        def ledger() -> dict[int, int]:
            """The first allocator's hashed blocks ({} until the manager's thread has built its cache)."""
            cache = getattr(getattr(engine._manager, "batch_processor", None), "cache", None)
            if cache is None or not cache.use_prefix_sharing:
                return {}
            return next(iter(cache.cache_allocators.values())).ledger.hash_to_block

        return cls(engine, block_tokens, compute_block_hash, ledger)

    @classmethod
    def of_slots(cls, engine: HfEngine, slots: SlotBatcher) -> HfPrefixCache:
        prefixes = slots.prefixes
        assert prefixes is not None, "slots without a prefix cache"
        return cls(engine, slots.block_tokens, chain_hash, lambda: prefixes.held)

    def cached_tokens(self, prompt: chat_template.Prompt) -> int:
        """What the engine would reuse of ``prompt`` now: its leading blocks held, never its last token."""
        return prompt.reusable_tokens(self.block_tokens, self._held())

    def layout(self, inp: GenerationInput) -> PromptLayout:
        prompt = self._engine.prompt(inp)  # its blocks named with this cache's chain, in a thread mostly
        return PromptLayout(self.block_tokens, prompt.blocks, self._segment_ends(inp, prompt.ids, prompt.rendered))

    def resident(self, hashes: Iterable[int]) -> set[int]:
        held = self._held()
        return {h for h in hashes if h in held}


class HfEngine:
    name = "hf"

    def __init__(self, settings: HfEngineSettings | None = None, max_num_seqs: int = 64) -> None:
        self.settings = settings or HfEngineSettings()
        self.max_num_seqs = max_num_seqs  # the worker's: what one step should take on CUDA
        self.tokenizer: Any = None
        self.token_texts: TokenTexts | None = None  # each token's text alone, once started (log probabilities)
        self.device = ""
        self.eos_token_ids: set[int] = set()
        self._model: Any = None
        self._manager: Any = None
        self._slots: SlotBatcher | None = None
        self._ids = itertools.count()
        self._prompt_tokens: chat_template.PromptTokens | None = None
        self._warned_penalties = False
        self._vocabulary_size = 0  # the ids the model takes (its embedding's rows)
        self.prefix_cache: HfPrefixCache | None = None

    async def start(self) -> None:
        self.tokenizer, self._model, self.device = await asyncio.to_thread(load_model, self.settings)
        self._prompt_tokens = chat_template.PromptTokens(self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)
        self._vocabulary_size = getattr(self._model.config, "vocab_size", None) or len(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        if uses_slots(self.settings, self.device, self._model):
            if self.settings.switch_interval_ms:
                sys.setswitchinterval(self.settings.switch_interval_ms / 1000)
            self._slots = await asyncio.to_thread(self._slot_batcher)
            self._slots.start(asyncio.get_running_loop())
            if self._slots.block_tokens:
                self.prefix_cache = HfPrefixCache.of_slots(self, self._slots)
        else:
            self._manager = await asyncio.to_thread(self._start_manager)
            if self.settings.prefix_caching:
                self.prefix_cache = HfPrefixCache.of_manager(self, self.settings.page_size)
        if self.prefix_cache is not None:  # each prompt's blocks named once, where it is tokenized
            self._prompt_tokens.name_blocks(self.prefix_cache.block_tokens, self.prefix_cache.chain)
        log.info("hf engine ready on %s, %s batching", self.device, self.batching)

    @property
    def batching(self) -> str:
        return "slots" if self._slots is not None else "manager"

    @property
    def model(self) -> Any:
        """The loaded transformers model (None before ``start``)."""
        return self._model

    def _slot_batcher(self) -> SlotBatcher:
        s = self.settings
        length = s.max_model_len or min(getattr(self._model.config, "max_position_embeddings", 4096), 4096)
        batcher = SlotBatcher(self._model, slots=self.max_num_seqs, max_model_len=length,
                              eos_token_ids=self.eos_token_ids, cuda_graphs=s.cuda_graphs is not False,
                              do_sample=s.do_sample, seed=s.seed, max_prefill_tokens=s.max_batch_tokens or 8192,
                              prefix_block_tokens=s.page_size if s.prefix_caching else 0, keeping_rows=s.prefix_rows)
        batcher.capture()
        return batcher

    def _manager_scores(self, top: int) -> None:
        """``InvalidInput`` unless the manager scores as asked: the sampled token alone, and only
        with ``manager_logprobs`` on."""
        if not self.settings.manager_logprobs:
            raise InvalidInput("log probabilities are off in the hf engine's manager batching "
                               "(TOKENBUS_HF_MANAGER_LOGPROBS=true, or its slot batching: TOKENBUS_HF_BATCHING=slots)")
        if top:
            raise InvalidInput("the hf engine's manager batching scores the sampled token alone: top_logprobs "
                               "is served by its slot batching (TOKENBUS_HF_BATCHING=slots)")

    def _manager_takes(self, sampling: SamplingParams) -> None:
        """``InvalidInput`` for what the manager cannot apply to one request alone: a logit bias (often a
        ban, which must not be dropped quietly), vLLM's ``min_tokens``, ``allowed_token_ids``, ``bad_words`` and
        repetition penalty, the prompt's log probabilities (an echo's), and its ``top_k`` and ``min_p`` where it
        samples (greedy decoding is the same with them)."""
        asked = [name for name, value in (("logit_bias", sampling.logit_bias), ("min_tokens", sampling.min_tokens),
                                          ("repetition_penalty", sampling.repetition_penalty != 1),
                                          ("allowed_token_ids", sampling.allowed_token_ids),
                                          ("bad_words", sampling.bad_words),
                                          ("prompt_logprobs", sampling.prompt_logprobs is not None)) if value]
        if self.settings.do_sample:
            asked += [name for name, value in (("top_k", sampling.top_k), ("min_p", sampling.min_p)) if value]
        if asked:
            raise InvalidInput(f"the hf engine's manager batching takes no {' or '.join(asked)}: its slot batching "
                               "does (TOKENBUS_HF_BATCHING=slots)")

    def _start_manager(self) -> Any:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        s = self.settings
        eos = self.tokenizer.eos_token_id
        generation = GenerationConfig(max_new_tokens=s.default_max_tokens, do_sample=s.do_sample,
                                      eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos)
        batching = ContinuousBatchingConfig(
            **batching_config(s, self.device, self.max_num_seqs), seed=s.seed,
            per_request_processors=s.do_sample, auto_switch_to_flash=False, allow_block_sharing=s.prefix_caching,
        )
        manager = self._model.init_continuous_batching(generation_config=generation,
                                                       continuous_batching_config=batching)
        manager.start()
        return manager

    async def close(self) -> None:
        """Stop generating and let go of the model and its cache: a process that starts another
        engine (a benchmark, a test) gets their device memory back."""
        if self._slots is not None:
            await asyncio.to_thread(self._slots.stop)
        if self._manager is not None:
            await asyncio.to_thread(self._manager.stop, True)
        self._model = None

    def cancel(self, internal_id: str) -> None:
        if self._slots is not None:
            self._slots.cancel(internal_id)
        else:
            self._manager.cancel_request(internal_id)

    def kv_cache_usage(self) -> float | None:
        """The slots' positions held, or the manager's paged cache (read while its thread runs: a gauge)."""
        if self._slots is not None:
            return self._slots.usage()
        cache = getattr(getattr(self._manager, "batch_processor", None), "cache", None)
        if cache is None:
            return None
        try:
            return min(1.0, max(0.0, 1.0 - float(cache.compute_free_capacity(relative=True))))
        except Exception:  # a transformers without this API, or the cache being rebuilt
            return None

    def prompt(self, inp: GenerationInput) -> chat_template.Prompt:
        assert self._prompt_tokens is not None, "the engine is not started"
        return self._prompt_tokens.prompt(inp)

    def prompt_ids(self, inp: GenerationInput) -> list[int]:
        return self.prompt(inp).ids

    async def prepare(self, inp: GenerationInput) -> None:
        """The prompt templated and tokenized in a thread (chat_template.PromptTokens)."""
        if self._prompt_tokens is not None:
            await asyncio.to_thread(self._prompt_tokens.prepare, inp)

    def generate(self, inp: GenerationInput) -> HfSequence:
        check_token_ids(inp.prompt_token_ids + inp.prefix_token_ids, self._vocabulary_size)
        check_token_ids(inp.sampling.named_token_ids, self._vocabulary_size)
        if inp.sampling.response_format != RESPONSE_TEXT:
            raise InvalidInput(f"the hf engine cannot constrain its output (response_format "
                               f"{inp.sampling.response_format}): TensorRT-LLM with a guided decoding backend can")
        if self._slots is None and inp.sampling.logprobs is not None:
            self._manager_scores(inp.sampling.logprobs)
        if self._slots is None:
            self._manager_takes(inp.sampling)
        made = self.prompt(inp)
        prompt = made.ids
        if not inp.prefix_token_ids:  # (a taken-over sequence's prompt is not scored again)
            check_prompt_scores(len(prompt), inp.sampling)
        internal_id = f"{inp.request_id}#{next(self._ids)}"  # one request may run twice here (reassignment)
        # The manager reuses what it holds when the request reaches it; the slots tell at admission.
        expected = self.prefix_cache.cached_tokens(made) if self._manager is not None and self.prefix_cache else 0
        sequence = HfSequence(self, inp, internal_id, prompt, expected)
        if sequence.max_new_tokens == 0:  # taken over at its limit
            sequence.end(FINISH_LENGTH, sequence.held_back_text())
            return sequence
        sampling = {}
        if self.settings.do_sample:
            if inp.sampling.temperature is not None:
                sampling["temperature"] = max(inp.sampling.temperature, 1e-5)
            if inp.sampling.top_p is not None:
                sampling["top_p"] = inp.sampling.top_p
        if self._slots is not None:
            banned, bad_words = token_bad_words(inp.sampling.bad_words, self.tokenizer, self._vocabulary_size)
            self._slots.add(SlotRequest(internal_id, prompt + list(inp.prefix_token_ids), sequence.max_new_tokens,
                                        sequence.on_delta, sampling.get("temperature", 1.0), sampling.get("top_p", 1.0),
                                        seed=inp.sampling.seed, drawn=len(inp.prefix_token_ids), named=made.blocks,
                                        ignore_eos=inp.sampling.ignore_eos,
                                        presence_penalty=inp.sampling.presence_penalty,
                                        frequency_penalty=inp.sampling.frequency_penalty,
                                        repetition_penalty=inp.sampling.repetition_penalty,
                                        logprobs=inp.sampling.logprobs, logit_bias=inp.sampling.logit_bias,
                                        prompt_logprobs=None if inp.prefix_token_ids else inp.sampling.prompt_logprobs,
                                        top_k=inp.sampling.top_k, min_p=inp.sampling.min_p,
                                        allowed_ids=inp.sampling.allowed_token_ids, banned_ids=banned,
                                        bad_words=bad_words,
                                        stop_ids=frozenset(inp.sampling.stop_token_ids),
                                        min_new_tokens=max(inp.sampling.min_tokens - len(inp.prefix_token_ids), 0)))
            return sequence
        if inp.sampling.penalized and not self._warned_penalties:
            self._warned_penalties = True
            log.warning("the hf engine's manager batching does not apply presence or frequency penalties; "
                        "the slot batching does (TOKENBUS_HF_BATCHING=slots)")
        self._manager.register_result_handler(internal_id, sequence.on_result)
        # The manager's end tokens are the generation config's unless a request names its own (none: on past
        # them; vLLM's stop_token_ids: those too).
        ends: dict[str, Any] = {}
        if inp.sampling.ignore_eos or inp.sampling.stop_token_ids:
            kept = set() if inp.sampling.ignore_eos else self.eos_token_ids
            ends["eos_token_id"] = sorted(kept | set(inp.sampling.stop_token_ids))
        self._manager.add_request(prompt + list(inp.prefix_token_ids), request_id=internal_id,
                                  max_new_tokens=sequence.max_new_tokens, streaming=True, **ends, **sampling)
        return sequence
