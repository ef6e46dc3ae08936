"""Slot batching in the ``hf`` engine (engines/hf_slots.py, hf_slot_model.py), run eagerly on the CPU with the tiny
random Llama: the same attention, cache and scheduling code the CUDA graphs capture (graphs
themselves need a GPU: `python -m bench gpu` checks them against plain ``generate`` there).
Float32 on the CPU, so its tokens must equal transformers' own greedy decoding exactly. The tiny
model's queries and keys are scaled up first: with random weights its attention is near uniform,
and a mistake in positions or scaling would barely change a token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.waiting import wait_for
from tokenbus.gpu_consumers.engines import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, GenerationInput, SamplingParams
from tokenbus.gpu_consumers.engines.hf import HfEngine
from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings, uses_slots
from tokenbus.gpu_consumers.engines.hf_slot_model import LENGTH_BUCKET, bucket, graph_buckets, unsupported
from tokenbus.gpu_consumers.engines.hf_slots import seeded_uniform
from tokenbus.schemas import ChatMessage


@pytest.fixture(scope="module")
def sharp_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    target = tmp_path_factory.mktemp("sharp-llama")
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
    import torch

    prompt = torch.tensor([engine.prompt_ids(inp)])
    out = engine.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


PROMPTS = ["hi", "the bus carries every token", "hello world, how are you today? " * 5, "Paris is the capital of " * 9]


async def test_sequences_batched_in_slots_decode_what_plain_generate_decodes(sharp_model):
    """Prompts of different lengths, prefilled together in one padded batch and decoded together,
    each give the tokens transformers' ``generate`` gives that prompt alone."""
    engine = await started(sharp_model)
    try:
        inputs = [request(i, text) for i, text in enumerate(PROMPTS)]
        served = await asyncio.gather(*(ids_and_finish(engine, inp) for inp in inputs))
        for inp, (ids, finish, _) in zip(inputs, served, strict=True):
            expected = plain_greedy(engine, inp, 24)
            assert ids == expected[: len(ids)]
            assert len(ids) == 24 and finish == FINISH_LENGTH or ids[-1] in engine.eos_token_ids
    finally:
        await engine.close()


async def test_log_probabilities_are_those_of_the_model_s_own_logits(sharp_model):
    """Batched with requests that do not ask (and one that asks for fewer), each token's log
    probability and its likeliest tokens are the log-softmax of the logits transformers' own
    ``generate`` scores that prompt with alone, step for step (the prefill's token and the decode steps')."""
    import torch

    engine = await started(sharp_model)
    try:
        inputs = [request(i, text, 6, logprobs=3 if i % 2 == 0 else None) for i, text in enumerate(PROMPTS)]
        inputs.append(request(9, PROMPTS[1], 6, logprobs=0))
        served = await asyncio.gather(*(collect_outs(engine, inp) for inp in inputs))
        for inp, outs in zip(inputs, served, strict=True):
            scored = [t for o in outs for t in o.logprobs]
            if inp.sampling.logprobs is None:
                assert scored == []
                continue
            prompt = torch.tensor([engine.prompt_ids(inp)])
            out = engine.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                        eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            ids = [t for o in outs for t in o.token_ids_diff]
            assert len(scored) == len(ids) == 6
            for step, (token_id, token) in enumerate(zip(ids, scored, strict=True)):
                expected = torch.log_softmax(out.scores[step][0].float(), -1)
                assert token.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
                top = expected.topk(inp.sampling.logprobs)
                assert [a.logprob for a in token.top] == pytest.approx(top.values.tolist(), abs=1e-4)
                assert [a.token for a in token.top] == [engine.tokenizer.decode([i]) for i in top.indices.tolist()]
                assert token.token == engine.tokenizer.decode([token_id])
    finally:
        await engine.close()


async def collect_outs(engine: HfEngine, inp: GenerationInput) -> list:
    return [out async for out in engine.generate(inp)]


async def test_requests_beyond_the_slots_wait_for_one_and_give_the_same_tokens(sharp_model):
    engine = await started(sharp_model, max_num_seqs=2)
    try:
        inputs = [request(i, text, max_tokens=12) for i, text in enumerate(PROMPTS * 2)]
        crowded = await asyncio.gather(*(ids_and_finish(engine, inp) for inp in inputs))
        alone = [await ids_and_finish(engine, inp) for inp in inputs]
        assert crowded == alone
        assert all(finish is not None and finish != FINISH_ERROR for _, finish, _ in crowded)
        assert engine.kv_cache_usage() == 0.0  # every slot given back
    finally:
        await engine.close()


async def test_the_cache_length_bounds_a_sequence_and_a_prompt_that_cannot_fit_fails_alone(sharp_model):
    engine = await started(sharp_model, max_model_len=24)
    try:
        short = request(1, "hi", max_tokens=100)
        prompt_tokens = len(engine.prompt_ids(short))
        too_long = request(2, "hello world " * 20)
        (ids, finish, _), (_, long_finish, error) = await asyncio.gather(
            ids_and_finish(engine, short), ids_and_finish(engine, too_long))
        # Every position of the cache used: the prompt's, then one for each token but the last.
        assert (len(ids), finish) == (24 - prompt_tokens + 1, FINISH_LENGTH)
        assert long_finish == FINISH_ERROR and "max_model_len 24" in error
    finally:
        await engine.close()


async def test_an_aborted_sequence_gives_its_slot_to_the_next(sharp_model):
    engine = await started(sharp_model, max_num_seqs=1)
    try:
        stream = engine.generate(request(1, "tell me a long story", max_tokens=5000))
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 3:
                stream.abort()
        assert outs[-1].finish_reason == FINISH_CANCELLED
        ids, finish, _ = await asyncio.wait_for(ids_and_finish(engine, request(2, "hi", max_tokens=6)), 30)
        assert len(ids) == 6 and finish == FINISH_LENGTH
    finally:
        await engine.close()


async def test_sampling_at_a_vanishing_temperature_or_top_p_is_greedy(sharp_model):
    """With ``do_sample`` the slot batcher samples each row with its request's own temperature and
    top-p; near zero either leaves only the most likely token."""
    greedy = await started(sharp_model)
    sampled = await started(sharp_model, do_sample=True, seed=3)
    try:
        for i, text in enumerate(PROMPTS):
            expected, _, _ = await ids_and_finish(greedy, request(i, text, max_tokens=16))
            cold = await ids_and_finish(sampled, request(i, text, max_tokens=16, temperature=0.0))
            narrow = await ids_and_finish(sampled, request(i, text, max_tokens=16, temperature=1.0, top_p=1e-6))
            assert cold[0] == expected and narrow[0] == expected
        hot = [await ids_and_finish(sampled, request(9, "hi", max_tokens=16, temperature=5.0)) for _ in range(3)]
        assert len({tuple(ids) for ids, _, _ in hot}) > 1  # it does sample
    finally:
        await greedy.close()
        await sampled.close()


async def test_a_seeded_request_samples_the_same_tokens_in_any_batch_and_after_a_takeover(sharp_model):
    """OpenAI's ``seed``: sampling, a request that names one gets the same tokens alone, in a batch
    with others (which draw from the engine's generator), and continued by a worker that took it
    over part-way (its first tokens already published); another seed gives other tokens."""
    engine = await started(sharp_model, do_sample=True, seed=3)

    def seeded(i: int, seed: int, prefix: tuple[int, ...] = ()) -> GenerationInput:
        inp = request(i, "the bus carries every token", max_tokens=16, temperature=3.0, seed=seed)
        return GenerationInput(inp.request_id, inp.messages, inp.sampling, prefix_token_ids=prefix)

    try:
        alone, finish, _ = await ids_and_finish(engine, seeded(1, 42))
        assert len(alone) == 16 and finish == FINISH_LENGTH
        crowd = [request(10 + i, text, max_tokens=16, temperature=3.0) for i, text in enumerate(PROMPTS)]
        batched = await asyncio.gather(ids_and_finish(engine, seeded(2, 42)), *(ids_and_finish(engine, inp) for inp in crowd))
        assert batched[0][0] == alone
        assert len({tuple(ids) for ids, _, _ in batched}) == len(batched)
        rest, finish, _ = await ids_and_finish(engine, seeded(3, 42, prefix=tuple(alone[:5])))
        assert alone[:5] + rest == alone and finish == FINISH_LENGTH
        other, _, _ = await ids_and_finish(engine, seeded(4, 43))
        assert other != alone
    finally:
        await engine.close()


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


def test_a_seeded_uniform_depends_on_the_seed_and_the_place_only():
    draws = [seeded_uniform(seed, place) for seed in (-(2**63), -1, 0, 1, 42, 2**63 - 1) for place in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    assert draws == [seeded_uniform(seed, place) for seed in (-(2**63), -1, 0, 1, 42, 2**63 - 1) for place in range(50)]
    assert 0.4 < sum(draws) / len(draws) < 0.6


async def test_a_closed_engine_lets_go_of_its_model_and_cache(sharp_model):
    """A process that starts engines one after another (a benchmark's phases) must get each one's
    device memory back: nothing of the model or the slots' cache outlives ``close``."""
    import gc
    import weakref

    engine = await started(sharp_model)
    await ids_and_finish(engine, request(1, "hi", max_tokens=4))
    model, cache = weakref.ref(engine.model), weakref.ref(engine._slots._model._keys[0])
    await engine.close()
    gc.collect()
    assert (model(), cache()) == (None, None)


def test_slots_are_the_default_on_cuda_for_llama_shaped_models_only(sharp_model):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    llama = AutoModelForCausalLM.from_pretrained(sharp_model)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    auto = HfEngineSettings()
    assert unsupported(llama) is None and "gpt2" in (unsupported(gpt2) or "")
    assert (uses_slots(auto, "cuda", llama), uses_slots(auto, "cpu", llama), uses_slots(auto, "cuda", gpt2)) == \
        (True, False, False)
    assert uses_slots(HfEngineSettings(batching="slots"), "cpu", llama)
    assert not uses_slots(HfEngineSettings(batching="manager"), "cuda", llama)
    with pytest.raises(ValueError, match="cannot run this model"):
        uses_slots(HfEngineSettings(batching="slots"), "cuda", gpt2)
    with pytest.raises(ValueError, match="auto, slots or manager"):
        uses_slots(HfEngineSettings(batching="paged"), "cuda", llama)


def test_graph_buckets_are_powers_of_two_multiples_capped_at_the_largest():
    assert [bucket(n, 1, 64) for n in (1, 2, 3, 17, 64, 65)] == [1, 2, 4, 32, 64, 64]
    assert [bucket(n, 256, 4096) for n in (1, 256, 257, 1000, 5000)] == [256, 256, 512, 1024, 4096]


@pytest.mark.parametrize(("slots", "max_model_len"), [(1, 256), (6, 1000), (64, 4096), (256, 4096), (100, 300)])
def test_the_graphs_captured_at_start_are_every_shape_a_decode_step_takes(slots, max_model_len):
    """A step's rows are rounded up from its highest running slot, its cache length from its
    longest sequence's next position: every such shape has its graph before the first request."""
    captured = set(graph_buckets(slots, max_model_len))
    taken = {(bucket(highest, 1, slots), bucket(position + 1, LENGTH_BUCKET, max_model_len))
             for highest in range(1, slots + 1) for position in range(max_model_len)}
    assert taken == captured
