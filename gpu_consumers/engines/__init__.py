"""Engines behind one interface: ``simulated``, and ``hf`` and ``trtllm``, imported only when chosen."""

from __future__ import annotations

from gpu_consumers.engines.base import (
    FINISH_CANCELLED,
    FINISH_CONTENT_FILTER,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    GenerationInput,
    GenerationStream,
    SamplingParams,
    StepOutput,
)
from gpu_consumers.engines.simulated import SimulatedEngine, SimulatedEngineSettings

ENGINE_NAMES = ("simulated", "hf", "trtllm")


def load_engine(name: str) -> Engine:
    """Build the engine called ``name`` from its own ``TOKENBUS_*`` settings; heavy imports stay lazy."""
    if name == "simulated":
        return SimulatedEngine(SimulatedEngineSettings())
    if name == "hf":
        from gpu_consumers.engines.hf import HfEngine, HfEngineSettings

        return HfEngine(HfEngineSettings())
    if name == "trtllm":
        from gpu_consumers.engines.trtllm import TrtLlmEngine, TrtLlmEngineSettings

        return TrtLlmEngine(TrtLlmEngineSettings())
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


__all__ = [
    "ENGINE_NAMES",
    "FINISH_CANCELLED",
    "FINISH_CONTENT_FILTER",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Engine",
    "GenerationInput",
    "GenerationStream",
    "SamplingParams",
    "SimulatedEngine",
    "SimulatedEngineSettings",
    "StepOutput",
    "load_engine",
]
