"""What the slot batching's tests share (test_hf_slots.py, test_hf_slot_prefixes.py): the tiny
random Llama with its queries and keys scaled up (with random weights its attention is near
uniform, and a mistake in positions or scaling would barely change a token), an engine with slot
batching over it on the CPU, and transformers' own greedy decoding to hold it to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams
from tokenbus.gpu_consumers.engines.hf import HfEngine
from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings
from tokenbus.schemas import ChatMessage


def build_sharp_model(tiny_model: Path, target: Path) -> Path:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    model.save_pretrained(target)
    for name in tiny_model.iterdir():
        if "token" in name.name or name.suffix == ".jinja":
            shutil.copy(name, target / name.name)
    return target


SHARPEN = 12.0


def request(i: int, content: str, max_tokens: int = 24, **sampling) -> GenerationInput:
    return GenerationInput(f"slots-{i}", (ChatMessage("user", content),), SamplingParams(max_tokens=max_tokens, **sampling))


async def started(model: Path, max_num_seqs: int = 8, **settings) -> HfEngine:
    engine = HfEngine(HfEngineSettings(model_path=str(model), device="cpu", batching="slots", **settings),
                      max_num_seqs=max_num_seqs)
    await engine.start()
    assert engine.batching == "slots"
    return engine


async def ids_and_finish(engine: HfEngine, inp: GenerationInput) -> tuple[list[int], str | None, str | None]:
    outs = [out async for out in engine.generate(inp)]
    return [t for o in outs for t in o.token_ids_diff], outs[-1].finish_reason, outs[-1].error


def plain_greedy(engine: HfEngine, inp: GenerationInput, tokens: int) -> list[int]:
    return transformers_own(engine, inp, tokens)[0]


def transformers_own(engine: HfEngine, inp: GenerationInput, tokens: int, **processors: Any) -> tuple[list[int], list]:
    """What transformers' own greedy ``generate`` gives ``inp``'s prompt alone, with ``processors``
    (more of its arguments: ``sequence_bias``, ``repetition_penalty``): the tokens, and each step's
    log-softmax of its logits past them."""
    import torch

    prompt = torch.tensor([engine.prompt_ids(inp)])
    out = engine.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True, **processors)
    return (out.sequences[0, prompt.shape[1]:].tolist(),
            [torch.log_softmax(scores[0].float(), -1) for scores in out.scores])
