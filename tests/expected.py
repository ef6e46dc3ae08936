"""What the stack's simulated engine must produce for a request, computed in-process."""

from __future__ import annotations

from dataclasses import dataclass

from tests.conftest import SIM_SETTINGS
from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams, SimulatedEngine, SimulatedEngineSettings
from tokenbus.schemas import ChatMessage


@dataclass(frozen=True)
class Expected:
    pieces: list[str]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def expected_output(messages: list[dict[str, str]], seed: int, max_tokens: int | None = None,
                          settings: SimulatedEngineSettings = SIM_SETTINGS) -> Expected:
    engine = SimulatedEngine(settings.model_copy(update={"ttft_ms": 0, "tokens_per_s": 100_000}))
    inp = GenerationInput(
        "expected",
        tuple(ChatMessage(m["role"], m["content"]) for m in messages),
        SamplingParams(seed=seed, max_tokens=max_tokens),
    )
    await engine.start()
    try:
        outs = [out async for out in engine.generate(inp)]
    finally:
        await engine.close()
    return Expected([o.text_diff for o in outs if o.text_diff], outs[-1].finish_reason or "", outs[-1].prompt_tokens,
                    outs[-1].completion_tokens)
