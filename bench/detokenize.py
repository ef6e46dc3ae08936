"""What turning token ids into text costs the GPU consumer per token: the `hf` and `trtllm` engines
detokenize every sequence's tokens on the consumer's event loop, so at TensorRT-LLM-class rates
(50,000 tokens/s into one process) each microsecond here is 5 % of a core. Measured with SmolLM2's
tokenizer (byte-level BPE, 49,152 tokens) over text with accented, CJK and emoji characters (split
over several tokens), through `IncrementalDetokenizer` with tokenizers' Rust `DecodeStream` (a fast
tokenizer, as served) and with its Python twin `WindowDecodeStream` (a tokenizer that only has
`decode`), pushing one token a step and four (a reader that fell behind its engine). Rounds
alternate; the best round of each counts (these machines are noisy)."""

from __future__ import annotations

import time
from typing import Any

from tokenbus.gpu_consumers.engines.detokenize import IncrementalDetokenizer

TEXT = ("héllo wörld — streams survive a crashed worker ✓ 東京 🚀 done. The bus carries every token "
        "from the engine to the edge; Zürich, São Paulo and Kraków read it at once. ")
TOKENS = 4000
ROUNDS = 5


class DecodeOnly:
    """The tokenizer as one without a Rust backend would be: its ``decode`` only."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tokenbus.gpu_consumers.engines.hf import smollm2_source

    source, gguf = smollm2_source()
    return AutoTokenizer.from_pretrained(source, **({"gguf_file": gguf} if gguf else {}))


def us_per_token(tokenizer: Any, ids: list[int], per_push: int) -> float:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pushes = [ids[i:i + per_push] for i in range(0, len(ids), per_push)]
    started = time.perf_counter()
    text = [detokenizer.push(push) for push in pushes]
    elapsed = time.perf_counter() - started
    assert "".join(text) == tokenizer.decode(ids, skip_special_tokens=True)
    return 1e6 * elapsed / len(ids)


def run() -> dict[str, Any]:
    tokenizer = load_tokenizer()
    ids = (tokenizer.encode(TEXT, add_special_tokens=False) * TOKENS)[:TOKENS]
    paths = {"rust": tokenizer, "python": DecodeOnly(tokenizer)}
    best: dict[str, float] = {}
    for _ in range(ROUNDS):
        for name, path in paths.items():
            for per_push in (1, 4):
                key = f"{name}_{per_push}"
                best[key] = min(best.get(key, float("inf")), us_per_token(path, ids, per_push))
    rows = [{"stream": name, "tokens_per_push": per_push, "us_per_token": round(best[f"{name}_{per_push}"], 2)}
            for name in paths for per_push in (1, 4)]
    return {"scenario": "detokenize", "tokens": len(ids), "rounds": ROUNDS, "rows": rows,
            "python_over_rust": round(best["python_1"] / best["rust_1"], 1)}


def table(result: dict[str, Any]) -> str:
    lines = ["| decode stream | tokens a push | µs per token |", "|---|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['stream']} | {row['tokens_per_push']} | {row['us_per_token']} |")
    return "\n".join(lines) + (f"\n\n{result['tokens']} tokens of SmolLM2's tokenizer, best of {result['rounds']} "
                               f"rounds; Python twin / Rust, one token a push: **{result['python_over_rust']}x**")
