"""What the stack's simulated engine must produce for a request, computed in-process."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.conftest import SIM_SETTINGS
from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams, SimulatedEngine, SimulatedEngineSettings
from tokenbus.gpu_consumers.engines.tool_calls import HermesToolParser
from tokenbus.schemas import ChatMessage, TokenLogprob, ToolSpec, whole_tool_calls


@dataclass(frozen=True)
class Expected:
    pieces: list[str]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # where SamplingParams.logprobs asked for them

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def expected_output(messages: list[dict[str, str]], seed: int, max_tokens: int | None = None,
                          settings: SimulatedEngineSettings = SIM_SETTINGS, text_prompt: bool = False,
                          **sampling: float | int) -> Expected:
    """What the stack's engine answers; with ``text_prompt``, to the one message as a text
    completion's prompt; ``sampling``: more of its SamplingParams (the penalties, logprobs)."""
    engine = SimulatedEngine(settings.model_copy(update={"ttft_ms": 0, "tokens_per_s": 100_000}))
    inp = GenerationInput(
        "expected",
        tuple(ChatMessage(m["role"], m["content"]) for m in messages),
        SamplingParams(seed=seed, max_tokens=max_tokens, **sampling),
        text_prompt=text_prompt,
    )
    await engine.start()
    try:
        outs = [out async for out in engine.generate(inp)]
    finally:
        await engine.close()
    return Expected([o.text_diff for o in outs if o.text_diff], outs[-1].finish_reason or "", outs[-1].prompt_tokens,
                    outs[-1].completion_tokens, tuple(t for o in outs for t in o.logprobs))


async def expected_calls(messages: list[dict[str, str]], tools: list[ToolSpec], seed: int, tool_choice: str = "auto",
                         tool_choice_name: str | None = None, parallel: bool = True,
                         settings: SimulatedEngineSettings = SIM_SETTINGS) -> list[tuple[str, dict]]:
    """(name, arguments) of each call the stack's engine makes for this request, read back as the
    worker reads them."""
    engine = SimulatedEngine(settings.model_copy(update={"ttft_ms": 0, "tokens_per_s": 100_000}))
    inp = GenerationInput("expected", tuple(ChatMessage(m["role"], m.get("content") or "") for m in messages),
                          SamplingParams(seed=seed), tools=tuple(tools), tool_choice=tool_choice,
                          tool_choice_name=tool_choice_name, parallel_tool_calls=parallel)
    offered = {t.name for t in tools} & ({tool_choice_name} if tool_choice_name else {t.name for t in tools})
    parser = HermesToolParser("expected", offered, parallel=parallel)
    await engine.start()
    try:
        deltas = [d async for out in engine.generate(inp) for d in parser.feed(out.text_diff).calls]
    finally:
        await engine.close()
    return [(c.name, json.loads(c.arguments)) for c in whole_tool_calls(deltas)]
