"""What the engine contract's tests share (test_engine_contract.py, test_engine_sampling.py): each
engine the contract runs, made here (`simulated`, `hf` and `hf-slots` on the tiny random Llama on
the CPU, `trtllm-fake` against tests/fakes/tensorrt_llm, `trtllm-real` where TOKENBUS_TRTLLM_MODEL
names a model on a GPU host with tensorrt_llm), and the inputs and readings the tests make. The
``engine`` fixture, one of each, is in conftest.py."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams, SimulatedEngine, SimulatedEngineSettings
from tokenbus.schemas import ChatMessage

ENGINES = ["simulated", "hf", "hf-slots", "trtllm-fake", "trtllm-real"]


async def make_engine(name: str, tiny_model: Path):
    if name == "simulated":
        return SimulatedEngine(SimulatedEngineSettings(ttft_ms=1, tokens_per_s=500, min_tokens=40, max_tokens=40))
    if name in ("hf", "hf-slots"):
        from tokenbus.gpu_consumers.engines.hf import HfEngine
        from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

        batching = "slots" if name == "hf-slots" else "auto"
        return HfEngine(HfEngineSettings(model_path=str(tiny_model), default_max_tokens=40, device="cpu",
                                         batching=batching))
    from tokenbus.gpu_consumers.engines.trtllm import TrtLlmEngine, TrtLlmEngineSettings

    if name == "trtllm-fake":
        return TrtLlmEngine(TrtLlmEngineSettings(model=str(tiny_model), default_max_tokens=40,
                                                 guided_decoding_backend="xgrammar"))
    model = os.environ.get("TOKENBUS_TRTLLM_MODEL")
    if not model:
        pytest.skip("trtllm-real runs where TOKENBUS_TRTLLM_MODEL names a model on a GPU host with tensorrt_llm")
    return TrtLlmEngine(TrtLlmEngineSettings(model=model, default_max_tokens=40, guided_decoding_backend="xgrammar"))


def request(i: int = 0, content: str = "hello there", **sampling) -> GenerationInput:
    return GenerationInput(f"contract-{i}", (ChatMessage("user", content),), SamplingParams(**sampling))


async def collect(engine, inp: GenerationInput):
    return [out async for out in engine.generate(inp)]


def text_of(outs) -> str:
    return "".join(o.text_diff for o in outs)


def ids_of(outs) -> list[int]:
    """The token ids the outputs carry, however the steps were grouped (a reader that fell behind
    takes two as one)."""
    return [t for o in outs for t in o.token_ids_diff]


def published(outs, count: int) -> tuple[tuple[int, ...], str]:
    """The token ids and text a worker had published once its outputs carried ``count`` tokens:
    whole outputs, so more than ``count`` ids where an output carried several."""
    ids: list[int] = []
    text = ""
    for out in outs:
        if len(ids) >= count:
            break
        ids += out.token_ids_diff
        text += out.text_diff
    return tuple(ids), text


async def continues_after_takeover(engine, inp: GenerationInput, outs, count: int) -> None:
    """A sequence taken over once its outputs (``outs``) carried ``count`` tokens, the published
    ones its prefix, gives the rest of ``outs``: the text and the tokens the uninterrupted one gave."""
    prefix_ids, prefix_text = published(outs, count)
    rest = await collect(engine, dataclasses.replace(inp, prefix_token_ids=prefix_ids, prefix_text=prefix_text))
    assert prefix_text + text_of(rest) == text_of(outs)
    assert ids_of(rest) == ids_of(outs)[len(prefix_ids):]
