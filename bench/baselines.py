"""The engine called directly in-process, timed like a streamed HTTP request:
the baseline that pipeline overhead is measured against."""

from __future__ import annotations

import itertools
import time
from typing import Any

from tokenbus.gpu_consumers.engines import Engine, GenerationInput, SamplingParams
from tokenbus.infra.loadgen import RequestResult
from tokenbus.infra.loadgen.prompts import BenchPrompt
from tokenbus.schemas import ChatMessage

_ids = itertools.count()


def engine_sender(engine: Engine, **sampling: Any):
    """``sampling``: more of each request's SamplingParams (penalties, logprobs, logit bias)."""
    async def send(prompt: BenchPrompt) -> RequestResult:
        result = RequestResult()
        inp = GenerationInput(f"direct-{next(_ids)}", (ChatMessage("user", prompt.text),),
                              SamplingParams(max_tokens=prompt.output_len, **sampling))
        start = time.perf_counter()
        async for out in engine.generate(inp):
            if out.text_diff:
                result.chunk_arrived(time.perf_counter(), start)
            if out.finished:
                result.output_tokens = out.completion_tokens
                result.prompt_tokens = out.prompt_tokens
                result.success = out.finish_reason in {"stop", "length"}
        result.latency = time.perf_counter() - start
        return result

    return send
