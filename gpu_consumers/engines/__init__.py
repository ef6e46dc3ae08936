"""Engines behind one interface: ``simulated`` here; ``hf`` and ``trtllm`` load lazily."""

from __future__ import annotations

from gpu_consumers.engines.base import (
    FINISH_CANCELLED,
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

ENGINE_NAMES = ("simulated",)


def load_engine(name: str) -> Engine:
    """Build the engine called ``name`` from its own ``TOKENBUS_*`` settings."""
    if name == "simulated":
        return SimulatedEngine(SimulatedEngineSettings())
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


__all__ = [
    "ENGINE_NAMES",
    "FINISH_CANCELLED",
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
