"""The text work a GPU consumer does on its event loop for a real engine (`hf`, `trtllm`): turning
each token's id into text, and each request's conversation into prompt token ids (the chat
template, the tokenizer, where each message ends for KV-cache-aware routing). At TensorRT-LLM-class
rates (50,000 tokens/s into one process) each microsecond a token is 5 % of a core, and a
millisecond a request at a few hundred requests a second is as much again. Measured with SmolLM2's
tokenizer (byte-level BPE, 49,152 tokens); rounds alternate and the best of each counts (these
machines are noisy).

Tokens: `IncrementalDetokenizer` over text with accented, CJK and emoji characters (split over
several tokens), with tokenizers' Rust `DecodeStream` (a fast tokenizer, as served) and with its
Python twin `WindowDecodeStream` (a tokenizer that only has `decode`), one token a push and four
(a reader that fell behind its engine).

Requests: the next turn of a conversation (a system message and six earlier messages, then the
new one; ~1,900 tokens) whose earlier messages' ends are remembered, as a worker serving that
conversation has them: what the event loop spends on the engine's prompt, the prefix cache's
layout of it, and the ends of the two messages new since the last turn. The way it was done before
(templated and tokenized by each asker, each new prefix tokenized again to find its end); once per
request (`PromptTokens`, the ends read off where the tokens lie in the text); the prompt made in a
thread first (`Engine.prepare`), its blocks named on the loop; and as served, its blocks named in
that thread too, so the loop only asks for them."""

from __future__ import annotations

import threading
import time
from typing import Any

from tokenbus.gpu_consumers.engines import GenerationInput, SamplingParams
from tokenbus.gpu_consumers.engines.blocks import block_hashes, chain_hash
from tokenbus.gpu_consumers.engines.chat_template import PromptTokens, SegmentEnds, prompt_ids
from tokenbus.gpu_consumers.engines.detokenize import IncrementalDetokenizer
from tokenbus.schemas import ChatMessage

TEXT = ("héllo wörld — streams survive a crashed worker ✓ 東京 🚀 done. The bus carries every token "
        "from the engine to the edge; Zürich, São Paulo and Kraków read it at once. ")
TOKENS = 4000
ROUNDS = 5
BLOCK_TOKENS = 32
WAYS = ("before", "once", "prepared", "served")
PARAGRAPH = "The bus carries every token from the engine to the edge, and the edge relays it to the client. " * 12


class DecodeOnly:
    """The tokenizer as one without a Rust backend would be: its ``decode`` only."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tokenbus.gpu_consumers.engines.hf_loading import smollm2_source

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


def turn(messages: int, request_id: str) -> GenerationInput:
    earlier = tuple(ChatMessage("user" if i % 2 == 0 else "assistant", f"{PARAGRAPH}{i}") for i in range(messages))
    return GenerationInput(request_id, (ChatMessage("system", "You are a helpful assistant. " * 20), *earlier),
                           SamplingParams())


def ms_per_turn(tokenizer: Any, way: str) -> tuple[float, int]:
    """One turn's prompt work on the event loop, the conversation's earlier turn already seen; and
    its prompt tokens. ``before``: each asker makes the prompt, each new end tokenizes again;
    ``once``: made once, ends read off the text; ``prepared``: made in a thread first
    (``Engine.prepare``), the blocks named on the loop; ``served``: named in that thread too, the
    event loop only asks."""
    before, now = turn(5, "turn-5"), turn(7, "turn-7")
    ends = SegmentEnds(tokenizer)
    tokens = PromptTokens(tokenizer)
    if way == "served":
        tokens.name_blocks(BLOCK_TOKENS, chain_hash)
    if way == "before":
        ends(before, prompt_ids(tokenizer, before))
    else:
        ends(before, tokens(before), tokens.rendered(before))
    if way in ("prepared", "served"):
        thread = threading.Thread(target=tokens.prepare, args=(now,))
        thread.start()
        thread.join()
    started = time.perf_counter()
    if way == "before":
        ids = prompt_ids(tokenizer, now)
        layout_ids = prompt_ids(tokenizer, now)
        block_hashes(layout_ids, BLOCK_TOKENS)
        ends(now, layout_ids)
    elif way == "served":
        ids = tokens(now)
        assert len(tokens.prompt(now).blocks) == len(ids) // BLOCK_TOKENS
        ends(now, tokens(now), tokens.rendered(now))
    else:
        ids = tokens(now)
        block_hashes(tokens(now), BLOCK_TOKENS)
        ends(now, tokens(now), tokens.rendered(now))
    return 1e3 * (time.perf_counter() - started), len(ids)


def run() -> dict[str, Any]:
    tokenizer = load_tokenizer()
    ids = (tokenizer.encode(TEXT, add_special_tokens=False) * TOKENS)[:TOKENS]
    paths = {"rust": tokenizer, "python": DecodeOnly(tokenizer)}
    best: dict[str, float] = {}
    prompt_tokens = 0
    for _ in range(ROUNDS):
        for name, path in paths.items():
            for per_push in (1, 4):
                key = f"{name}_{per_push}"
                best[key] = min(best.get(key, float("inf")), us_per_token(path, ids, per_push))
        for way in WAYS:
            ms, prompt_tokens = ms_per_turn(tokenizer, way)
            best[f"turn_{way}"] = min(best.get(f"turn_{way}", float("inf")), ms)
    rows = [{"stream": name, "tokens_per_push": per_push, "us_per_token": round(best[f"{name}_{per_push}"], 2)}
            for name in paths for per_push in (1, 4)]
    return {"scenario": "engine_text", "tokens": len(ids), "rounds": ROUNDS, "rows": rows,
            "python_over_rust": round(best["python_1"] / best["rust_1"], 1), "prompt_tokens": prompt_tokens,
            "turn_ms": {way: round(best[f"turn_{way}"], 2) for way in WAYS}}


def table(result: dict[str, Any]) -> str:
    lines = ["| decode stream | tokens a push | µs per token |", "|---|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['stream']} | {row['tokens_per_push']} | {row['us_per_token']} |")
    lines += ["", f"{result['tokens']} tokens of SmolLM2's tokenizer, best of {result['rounds']} rounds; Python twin "
              f"/ Rust, one token a push: **{result['python_over_rust']}x**", "",
              "| a turn's prompt work on the event loop (prompt, layout, two new messages' ends) | ms |", "|---|---:|",
              f"| each asker templating and tokenizing, each new prefix tokenized again | {result['turn_ms']['before']} |",
              f"| once per request, ends from the tokens' places in the text | {result['turn_ms']['once']} |",
              f"| made in a thread first (`Engine.prepare`), its blocks named on the loop | {result['turn_ms']['prepared']} |",
              f"| as served: made and its blocks named in that thread, the loop only asks | {result['turn_ms']['served']} |",
              "", f"{result['prompt_tokens']} prompt tokens, best of {result['rounds']} rounds"]
    return "\n".join(lines)
