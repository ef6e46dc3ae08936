"""Benchmark prompts: synthetic with length distributions, or a ShareGPT-format file.

Lengths are in words, which the simulated engine counts as tokens; against a real
tokenizer they are an approximation, as the reported usage shows.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = """
stream token partition offset broker consumer producer schema event replay edge tenant batch
tier model engine latency throughput cache prefix queue commit record topic log
""".split()


CHAT_BACKEND = "openai-chat"
COMPLETIONS_BACKENDS = ("openai", "vllm")  # vLLM's names for the text completions API


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    text: str
    prompt_len: int
    output_len: int

    def payload(self, model: str, stream: bool = True, backend: str = CHAT_BACKEND,
                ignore_eos: bool = False, logprobs: int | None = None,
                sampling: dict[str, float] | None = None) -> dict[str, Any]:
        """The request body: ``/v1/chat/completions`` for ``openai-chat``, ``/v1/completions``
        for vLLM's ``openai`` and ``vllm`` backends; ``logprobs``, each token's log probability and
        this many likeliest tokens' (vLLM's ``--logprobs``), in each API's form; ``sampling``, more
        fields as they are (vLLM's ``--top-k`` and the like)."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.output_len, "stream": stream}
        if backend == CHAT_BACKEND:
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension (tokenbus serves it); servers without it ignore the field
        if logprobs is not None and backend == CHAT_BACKEND:
            body.update(logprobs=True, top_logprobs=logprobs)
        elif logprobs is not None:
            body["logprobs"] = logprobs
        body.update(sampling or {})
        return body


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, max(low, high)))


def synthetic_prompts(count: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                      prefix_len: int = 0) -> list[BenchPrompt]:
    """Input and output lengths uniform in ``[len * (1 - ratio), len * (1 + ratio)]``, after a
    prefix of ``prefix_len`` words every prompt shares (vLLM's random dataset)."""
    if not 0 <= range_ratio < 1:
        raise ValueError("range ratio must be in [0, 1)")
    rng = random.Random(seed)
    prefix = [rng.choice(WORDS) for _ in range(prefix_len)]
    prompts = []
    for _ in range(count):
        n_in = _length(rng, input_len, range_ratio)
        text = " ".join(prefix + [rng.choice(WORDS) for _ in range(n_in)])
        prompts.append(BenchPrompt(text, prefix_len + n_in, _length(rng, output_len, range_ratio)))
    return prompts


def _conversation_turns(item: Any) -> list[dict[str, str]]:
    turns = item.get("conversations") or item.get("conversation") or [] if isinstance(item, dict) else []
    return [t for t in turns if isinstance(t, dict) and isinstance(t.get("value"), str)]


def sharegpt_prompts(path: Path, count: int, seed: int = 0, fixed_output_len: int | None = None) -> list[BenchPrompt]:
    """First human turn as the prompt, the reply's length as the output length; JSON list or JSONL."""
    raw = path.read_text()
    items = json.loads(raw) if raw.lstrip().startswith("[") else [json.loads(line) for line in raw.splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(items)
    prompts = []
    for item in items:
        turns = _conversation_turns(item)
        if len(turns) < 2 or turns[0].get("from") not in {"human", "user"}:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        output_len = fixed_output_len or len(reply.split())
        if not prompt.strip() or output_len < 1:
            continue
        prompts.append(BenchPrompt(prompt, len(prompt.split()), output_len))
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError(f"no usable conversations in {path}")
    return prompts
