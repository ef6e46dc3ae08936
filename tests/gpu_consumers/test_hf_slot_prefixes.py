"""The slot batching's prefix cache (engines/hf_slots.py, hf_slot_prefixes.py), on the CPU with
the sharpened tiny Llama (slot_engines.py): a slot keeps the keys and values of its prompt and
output when its sequence ends, a new prompt starts past the leading blocks any slot holds (kept
in its own slot or copied from another), and every sequence still decodes what plain ``generate``
and an engine without the cache decode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.gpu_consumers.slot_engines import ids_and_finish, plain_greedy, request, started
from tests.waiting import wait_for
from tokenbus.gpu_consumers.engines import FINISH_CANCELLED, GenerationInput, SamplingParams
from tokenbus.gpu_consumers.engines.hf import HfEngine
from tokenbus.schemas import ChatMessage

SYSTEM = ChatMessage("system", "Answer as the shared assistant of the slot tests would answer. " * 3)


def asking(i: int, question: str, max_tokens: int = 16) -> GenerationInput:
    return GenerationInput(f"prefix-{i}", (SYSTEM, ChatMessage("user", question)), SamplingParams(max_tokens=max_tokens))


async def collect_final(engine: HfEngine, inp: GenerationInput):
    return [out async for out in engine.generate(inp)][-1]


async def test_a_shared_prefix_is_kept_in_its_slot_or_copied_from_another_and_decodes_the_same(sharp_model):
    """The prefix cache. The first prompt runs in slot 0 beside a long sequence in slot 1 that goes
    on decoding after it ends (slot 0's row idles in those steps and must not touch what the slot
    keeps). The second takes slot 0 back and starts past the system message's blocks kept there;
    the third, while the second runs, takes slot 2, which never held anything, and copies them from
    slot 0. Each decodes what plain ``generate`` decodes and what an engine without the cache
    decodes, and counts the tokens it took from the cache."""
    engine = await started(sharp_model, max_num_seqs=4, page_size=16)
    plain = await started(sharp_model, max_num_seqs=4, page_size=16, prefix_caching=False)
    try:
        first = engine.generate(asking(1, "who are you?"))
        runner = engine.generate(request(9, "tell me a long story", max_tokens=800))
        first_outs = [out async for out in first]
        second = engine.generate(asking(2, "what is a bus?", max_tokens=24))
        second_outs = [await anext(aiter(second))]
        third_outs = [out async for out in engine.generate(asking(3, "and a token?"))]
        second_outs += [out async for out in second]
        runner_outs = []
        async for out in runner:
            runner_outs.append(out)
            runner.abort()
        assert runner_outs[-1].finish_reason == FINISH_CANCELLED  # it ran all along

        layout = engine.prefix_cache.layout(asking(2, "what is a bus?"))
        system_tokens = layout.segment_ends[0] // 16 * 16
        assert system_tokens >= 32
        for i, outs in ((1, first_outs), (2, second_outs), (3, third_outs)):
            inp = asking(i, ["who are you?", "what is a bus?", "and a token?"][i - 1], max_tokens=24 if i == 2 else 16)
            ids = [t for o in outs for t in o.token_ids_diff]
            assert ids == plain_greedy(engine, inp, len(ids))
            assert (ids, outs[-1].finish_reason) == (await ids_and_finish(plain, inp))[:2]
            cached = outs[-1].cached_tokens
            assert cached == 0 if i == 1 else system_tokens <= cached < outs[-1].prompt_tokens and cached % 16 == 0
        assert plain.prefix_cache is None
        assert (await collect_final(plain, asking(4, "who are you?"))).cached_tokens == 0
    finally:
        await engine.close()
        await plain.close()


async def test_a_prompts_blocks_are_named_once_where_it_is_tokenized(sharp_model, monkeypatch):
    """A worker prepares a request's prompt in a thread, then asks the engine to generate it and its
    prefix cache for the layout it reports (KV-cache-aware routing). Every block of the sequence is
    named once: the prompt's where it is tokenized, for the engine and the layout alike, and the
    output's when the slot keeps them."""
    from tokenbus.gpu_consumers.engines import blocks

    named: list[bytes] = []
    real = blocks.hashlib.blake2b

    class Counting:
        @staticmethod
        def blake2b(data: bytes, **kwargs):
            named.append(data)
            return real(data, **kwargs)

    engine = await started(sharp_model, max_num_seqs=2, page_size=8, prefix_rows=1)
    try:
        assert engine._slots is not None and engine._slots.prefixes.keeping_rows == range(2, 3)  # TOKENBUS_HF_PREFIX_ROWS
        monkeypatch.setattr(blocks, "hashlib", Counting)
        inp = asking(5, "what is a bus?", max_tokens=12)
        await engine.prepare(inp)
        prompt = engine.prompt_ids(inp)
        assert len(named) == len(prompt) // 8 >= 4  # in the thread
        layout = engine.prefix_cache.layout(inp)
        ids = [t for out in [out async for out in engine.generate(inp)] for t in out.token_ids_diff]
        assert layout.block_hashes == blocks.block_hashes(prompt, 8)
        # All it wrote but the last token, whose keys no step computes: each block once.
        expected = (len(prompt) + len(ids) - 1) // 8 + len(prompt) // 8  # (the check above named the prompt's again)
        await wait_for(lambda: len(named) >= expected, 10, "the slot to keep the output's blocks")
        assert len(named) == expected
    finally:
        await engine.close()


class Slots:
    """A slot batcher of its own over the sharp model, fed token ids: what a slot keeps, seen through
    what a prompt gets from it."""

    def __init__(self, model_dir: Path, slots: int, block_tokens: int, keeping_rows: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        from tokenbus.gpu_consumers.engines.hf_slots import SlotBatcher

        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.batcher = SlotBatcher(self.model, slots=slots, max_model_len=256, eos_token_ids=set(), cuda_graphs=False,
                                   prefix_block_tokens=block_tokens, keeping_rows=keeping_rows)

    async def __aenter__(self) -> Slots:
        self.batcher.start(asyncio.get_running_loop())
        return self

    async def __aexit__(self, *_: object) -> None:
        self.batcher.stop()

    def submit(self, prompt: list[int], tokens: int) -> asyncio.Future[tuple[list[int], int | None]]:
        """The tokens decoded and the prompt's tokens taken from the cache, once it finishes."""
        from tokenbus.gpu_consumers.engines.hf_slots import Delta, SlotRequest

        done: asyncio.Future[tuple[list[int], int | None]] = asyncio.get_running_loop().create_future()
        ids: list[int] = []
        cached: list[int | None] = []

        def deliver(delta: Delta) -> None:
            ids.extend(delta.ids)
            cached.append(delta.cached_tokens)
            if delta.finish is not None:
                done.set_result((ids, cached[0]))

        self.batcher.add(SlotRequest(f"prompt-{len(prompt)}-{id(done)}", prompt, tokens, deliver))
        return done

    async def run(self, prompt: list[int], tokens: int) -> tuple[list[int], int | None]:
        return await asyncio.wait_for(self.submit(prompt, tokens), 60)

    def plain(self, prompt: list[int], tokens: int) -> list[int]:
        import torch

        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()


async def test_a_slot_keeps_its_output_too_so_the_next_turn_starts_past_it(sharp_model, tiny_tokenizer):
    """A slot keeps the keys and values of its prompt and of its output but the last token (whose
    keys no step computes): a prompt that continues both, as a conversation's next turn does, is
    prefilled from the last full block they fill, and decodes what plain ``generate`` decodes."""
    async with Slots(sharp_model, slots=2, block_tokens=8) as slots:
        prompt = tiny_tokenizer("the bus carries every token to the edge, " * 3)["input_ids"]
        answer, cached = await slots.run(prompt, 20)
        assert (answer, cached) == (slots.plain(prompt, 20), 0)
        turn = prompt + answer + tiny_tokenizer(" and then?")["input_ids"]
        reply, cached = await slots.run(turn, 10)
        assert cached == (len(prompt) + len(answer) - 1) // 8 * 8 > len(prompt)
        assert reply == slots.plain(turn, 10)


async def test_a_prefix_in_the_lowest_free_slot_moves_aside_for_a_new_prompt(sharp_model, tiny_tokenizer):
    """Prompts take the lowest free slot; what it held, and no other slot does, is copied to another
    free slot first: a later prompt sharing it still starts past it."""
    async with Slots(sharp_model, slots=2, block_tokens=8) as slots:
        shared = tiny_tokenizer("the bus carries every token to the edge, " * 3)["input_ids"]
        await slots.run(shared + tiny_tokenizer(" first")["input_ids"], 4)  # slot 0
        _, cached = await slots.run(tiny_tokenizer("a different prompt altogether " * 3)["input_ids"], 4)
        assert cached == 0  # slot 0 again; what it held now in slot 1
        again = shared + tiny_tokenizer(" second")["input_ids"]
        reply, cached = await slots.run(again, 8)
        assert cached == len(shared) // 8 * 8 > 0
        assert reply == slots.plain(again, 8)


@pytest.mark.parametrize("keeping_rows", [0, 2])
async def test_rows_that_only_keep_prefixes_keep_them_while_the_slots_run_others(sharp_model, tiny_tokenizer,
                                                                                  keeping_rows):
    """One slot, busy with one conversation after another: what it held is lost to the next prompt,
    unless rows past the slots keep it (``keeping_rows``, the least recently used given up first,
    never the one a prompt is about to copy from). The first conversation's next turn then starts
    past its prefix, copied from where it was kept, and decodes what plain ``generate`` decodes."""
    async with Slots(sharp_model, slots=1, block_tokens=8, keeping_rows=keeping_rows) as slots:
        first = tiny_tokenizer("the bus carries every token to the edge, " * 3)["input_ids"]
        answer, _ = await slots.run(first, 6)
        for other in ("a different prompt altogether ", "and yet another one here "):
            await slots.run(tiny_tokenizer(other * 3)["input_ids"], 6)
        turn = first + answer + tiny_tokenizer(" and then?")["input_ids"]
        reply, cached = await slots.run(turn, 8)
    assert cached == (0 if keeping_rows == 0 else (len(first) + len(answer) - 1) // 8 * 8)
    assert cached < len(turn) and reply == slots.plain(turn, 8)


async def test_prompts_admitted_together_compute_their_shared_prefix_once(sharp_model, tiny_tokenizer):
    """Three prompts that share a prefix nobody holds, admitted in one pass: the first computes it;
    the others wait for the next pass and start past it (the one with nothing more in common, the
    last, is prefilled beside the first). Each decodes what plain ``generate`` decodes."""
    slots = Slots(sharp_model, slots=4, block_tokens=8)
    shared = tiny_tokenizer("the bus carries every token to the edge, " * 3)["input_ids"]
    prompts = [shared + tiny_tokenizer(f" question {n}")["input_ids"] for n in (1, 2, 3)]
    prompts.append(tiny_tokenizer("a different prompt altogether " * 3)["input_ids"])
    served = [slots.submit(prompt, 6) for prompt in prompts]  # all waiting when the batcher starts
    async with slots:
        done = await asyncio.wait_for(asyncio.gather(*served), 60)
    common = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)  # " question" too
    assert [cached for _, cached in done] == [0, common // 8 * 8, common // 8 * 8, 0] and common >= len(shared)
    assert [ids for ids, _ in done] == [slots.plain(prompt, 6) for prompt in prompts]
