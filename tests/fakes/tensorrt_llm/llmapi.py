"""``tensorrt_llm.llmapi.KvCacheConfig``, the part of it the fake honours: block reuse and the
KV-cache event buffer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = None
    event_buffer_max_size: int = 0
