"""Scenario: what OpenAI's sampling options cost the ``hf`` engine's slot batching, engine alone
in this process (`python -m bench sampling_cost`).

The same requests (a short question each, ``OUTPUT_TOKENS`` tokens generated past any end token)
``CONCURRENCY`` at once, plain and with each of ``ASKED`` on every request: OpenAI's presence and
frequency penalties (the slots' counts, taken off the logits), vLLM's repetition penalty (a mark of
the tokens the prompt and output hold, a select over the logits), log probabilities with five
likeliest tokens (a log-softmax and a top-k a step), a logit bias on OpenAI's most tokens (300:
a bias row a slot, added to the logits) and vLLM's bad words (16: the one-token ones in the bias
row, the longer ones each slot's last tokens compared on the device a step). Rounds alternate between them, so each option is
measured beside plain decoding on a machine whose speed drifts; output tokens/s and the ratio to
plain. Then what scoring a prompt costs (a text completion's ``echo`` with ``logprobs``, as
evaluation harnesses send it): ``SCORED_REQUESTS`` distinct text prompts of about
``SCORED_PROMPT_WORDS`` words, one token generated each, plain and with the prompt's log
probabilities (one likeliest, lm-evaluation-harness's ``logprobs: 1``, and five): the logits at
every prompt position, a log-softmax and a top-k over them, and no prefix cache; prompt tokens/s and
the ratio to plain.

Runs on the device ``TOKENBUS_HF_DEVICE`` picks (the CPU here) with SmolLM2-135M unless
``TOKENBUS_HF_MODEL_PATH`` names another model. `python -m bench gpu` asks the same of its 1B
model at 64 concurrent on a GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams
from tokenbus.schemas import ChatMessage

# vLLM's bad words: phrases of two and three words (each read with and without a space before it,
# about 32 token sequences on the device) and a few single words.
BAD_WORDS = ("red bus", "blue train", "green tram", "yellow ferry", "over the hill", "under the bridge",
             "far away", "long ago", "once more", "right now", "by the way", "in the end", "zebra", "quokka",
             "axolotl", "narwhal")
# What a request may ask beyond plain greedy decoding, as a request sets it, for the rows that
# measure what each costs the engine: OpenAI's penalties, vLLM's repetition penalty, log
# probabilities with five likeliest, and a logit bias on OpenAI's most tokens (300; small, so that
# outputs keep their lengths).
ASKED: dict[str, dict[str, Any]] = {"penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
                                    "repetition penalty": {"repetition_penalty": 1.2},
                                    "logprobs (top 5)": {"logprobs": 5},
                                    "logit bias (300 tokens)": {"logit_bias": tuple((1000 + i, -1.0) for i in range(300))},
                                    "bad words (16)": {"bad_words": BAD_WORDS}}
PLAIN = "plain"
# A prompt scored with this many likeliest tokens a place (lm-evaluation-harness asks for one).
SCORED: dict[str, int] = {"prompt logprobs (top 1)": 1, "prompt logprobs (top 5)": 5}
SCORED_REQUESTS = 16
SCORED_PROMPT_WORDS = 200
CONCURRENCY = 8
REQUESTS = 16  # a round's, each option's
OUTPUT_TOKENS = 32
ROUNDS = 2
_ids = itertools.count()


def inputs(asked: str) -> list[GenerationInput]:
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, **ASKED.get(asked, {}))
    return [GenerationInput(f"sampling-cost-{next(_ids)}", (ChatMessage("user", f"Tell me about number {n}."),),
                            sampling) for n in range(REQUESTS)]


def scoring_inputs(asked: str) -> list[GenerationInput]:
    """Text prompts that share no prefix (each begins with its own number), one token generated."""
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=SCORED.get(asked))
    filler = " ".join(f"the bus carries token {i} to the edge" for i in range(SCORED_PROMPT_WORDS // 7))
    return [GenerationInput(f"sampling-cost-{n}", (ChatMessage("user", f"{n}: {filler}"),), sampling, text_prompt=True)
            for n in (next(_ids) for _ in range(SCORED_REQUESTS))]


async def run_round(engine: Any, work: list[GenerationInput], prompts: bool = False) -> tuple[int, float]:
    """The inputs ``CONCURRENCY`` at a time: output tokens (``prompts``: prompt tokens), and the wall time."""
    work = list(work)
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while work:
            inp = work.pop()
            async for out in engine.generate(inp):
                if out.prompt_logprobs:
                    assert len(out.prompt_logprobs) == out.prompt_tokens
                if out.finished:
                    assert out.finish_reason == "length", out.error
                    tokens += out.prompt_tokens if prompts else out.completion_tokens

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return tokens, time.perf_counter() - started


async def measure() -> dict[str, Any]:
    from tokenbus.gpu_consumers.engines.hf import HfEngine
    from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings

    engine = HfEngine(HfEngineSettings(batching="slots", max_model_len=HfEngineSettings().max_model_len or 512),
                      max_num_seqs=CONCURRENCY)
    await engine.start()
    try:
        options = [PLAIN, *ASKED]
        for asked in options:  # warm-up: every path run once before anything is timed
            await run_round(engine, inputs(asked)[:CONCURRENCY])
        measured: dict[str, list[tuple[int, float]]] = {asked: [] for asked in options}
        for _ in range(ROUNDS):
            for asked in options:
                measured[asked].append(await run_round(engine, inputs(asked)))
        scoring = [PLAIN, *SCORED]
        for asked in scoring:
            await run_round(engine, scoring_inputs(asked)[:CONCURRENCY], prompts=True)
        scored: dict[str, list[tuple[int, float]]] = {asked: [] for asked in scoring}
        for _ in range(ROUNDS):
            for asked in scoring:
                scored[asked].append(await run_round(engine, scoring_inputs(asked), prompts=True))
        return {"device": engine.device, "model": engine.settings.model_path or "SmolLM2-135M-Instruct",
                "rows": rows_of(measured), "scoring_rows": rows_of(scored)}
    finally:
        await engine.close()


def rows_of(measured: dict[str, list[tuple[int, float]]]) -> list[dict[str, Any]]:
    rates = {asked: sum(t for t, _ in rounds) / sum(s for _, s in rounds) for asked, rounds in measured.items()}
    return [{"asked": asked, "tokens_per_s": round(rate, 1), "ratio": round(rate / rates[PLAIN], 3),
             "per_round": [round(t / s, 1) for t, s in measured[asked]]} for asked, rate in rates.items()]


def run() -> dict[str, Any]:
    return {"scenario": "sampling_cost", "concurrency": CONCURRENCY, "requests_per_round": REQUESTS,
            "output_tokens": OUTPUT_TOKENS, "rounds": ROUNDS, "scored_requests_per_round": SCORED_REQUESTS,
            "scored_prompt_words": SCORED_PROMPT_WORDS, **asyncio.run(measure())}


def table(result: dict[str, Any]) -> str:
    lines = [f"`hf` slot batching alone on {result['device']}, {result['concurrency']} at once, "
             f"{result['rounds']} alternating rounds of {result['requests_per_round']} requests x "
             f"{result['output_tokens']} tokens an option", "",
             "| every request asks | tokens/s | per round | vs plain |", "|---|---:|---|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['asked']} | {row['tokens_per_s']} | {', '.join(map(str, row['per_round']))} | "
                     f"{row['ratio']:.2f}x |")
    lines += ["", f"Text prompts of about {result['scored_prompt_words']} words, one token each, "
              f"{result['scored_requests_per_round']} a round", "",
              "| every request asks | prompt tokens/s | per round | vs plain |", "|---|---:|---|---:|"]
    for row in result["scoring_rows"]:
        lines.append(f"| {row['asked']} | {row['tokens_per_s']} | {', '.join(map(str, row['per_round']))} | "
                     f"{row['ratio']:.2f}x |")
    return "\n".join(lines)
