"""Engines behind one interface: ``simulated``, and ``hf`` and ``trtllm``, imported only when chosen."""

from __future__ import annotations

from tokenbus.gpu_consumers.engines.base import (
    FINISH_CANCELLED,
    FINISH_CONTENT_FILTER,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    Engine,
    GenerationInput,
    GenerationStream,
    InvalidInput,
    PrefixCache,
    PromptLayout,
    SamplingParams,
    StepOutput,
    StepSink,
    check_token_ids,
    each_step,
)
from tokenbus.gpu_consumers.engines.simulated import SimulatedEngine, SimulatedEngineSettings

ENGINE_NAMES = ("simulated", "hf", "trtllm")


def load_engine(name: str, max_num_seqs: int = 64) -> Engine:
    """Build the engine called ``name`` from its own ``TOKENBUS_*`` settings; heavy imports stay lazy.
    ``max_num_seqs``: how many sequences the worker runs at once (an engine step's batch on CUDA)."""
    if name == "simulated":
        return SimulatedEngine(SimulatedEngineSettings())
    if name == "hf":
        from tokenbus.gpu_consumers.engines.hf import HfEngine
        from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

        return HfEngine(HfEngineSettings(), max_num_seqs=max_num_seqs)
    if name == "trtllm":
        from tokenbus.gpu_consumers.engines.trtllm import TrtLlmEngine, TrtLlmEngineSettings

        return TrtLlmEngine(TrtLlmEngineSettings())
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


__all__ = [
    "ENGINE_NAMES",
    "FINISH_CANCELLED",
    "FINISH_CONTENT_FILTER",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "FINISH_TOOL_CALLS",
    "Engine",
    "GenerationInput",
    "GenerationStream",
    "InvalidInput",
    "PrefixCache",
    "PromptLayout",
    "SamplingParams",
    "SimulatedEngine",
    "SimulatedEngineSettings",
    "StepOutput",
    "StepSink",
    "check_token_ids",
    "each_step",
    "load_engine",
]
