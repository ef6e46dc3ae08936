"""Slot batching in the ``hf`` engine (engines/hf_slots.py, hf_slot_model.py), run eagerly on the CPU with the tiny
random Llama: the same attention, cache and scheduling code the CUDA graphs capture (graphs
themselves need a GPU: `python -m bench gpu` checks them against plain ``generate`` there).
Float32 on the CPU, so its tokens must equal transformers' own greedy decoding exactly. The tiny
model's queries and keys are scaled up first: with random weights its attention is near uniform,
and a mistake in positions or scaling would barely change a token."""

from __future__ import annotations

import asyncio

import pytest

from tests.gpu_consumers.slot_engines import ids_and_finish, plain_greedy, request, started, transformers_own
from tokenbus.gpu_consumers.engines import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, GenerationInput, hf_slot_logprobs
from tokenbus.gpu_consumers.engines.hf import HfEngine
from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings, uses_slots
from tokenbus.gpu_consumers.engines.hf_slot_model import LENGTH_BUCKET, bucket, graph_buckets, unsupported
from tokenbus.gpu_consumers.engines.hf_slot_sampling import seeded_uniform

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
            _, steps = transformers_own(engine, inp, 6)
            ids = [t for o in outs for t in o.token_ids_diff]
            assert len(scored) == len(ids) == 6
            for token_id, token, expected in zip(ids, scored, steps, strict=True):
                assert token.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
                top = expected.topk(inp.sampling.logprobs)
                assert [a.logprob for a in token.top] == pytest.approx(top.values.tolist(), abs=1e-4)
                assert [a.token for a in token.top] == [engine.tokenizer.decode([i]) for i in top.indices.tolist()]
                assert token.token == engine.tokenizer.decode([token_id])
    finally:
        await engine.close()


@pytest.mark.parametrize("chunk", [hf_slot_logprobs.PROMPT_CHUNK, 5])
async def test_prompt_log_probabilities_are_the_model_s_own_over_the_whole_prompt(sharp_model, monkeypatch, chunk):
    """A prompt asked to be scored (an echo with logprobs) is prefilled whole, even where the prefix
    cache holds it: each token after the first gets the log-softmax of the logits the model gives
    the tokens before it, with its likeliest, its logits made a chunk of positions at a time (here
    also 5, so that a chunk ends in the middle); the first is unscored, and a batch-mate asks nothing."""
    import torch

    monkeypatch.setattr(hf_slot_logprobs, "PROMPT_CHUNK", chunk)
    engine = await started(sharp_model)
    try:
        text = PROMPTS[3]
        await ids_and_finish(engine, request(0, text, 2))  # its blocks are now in the prefix cache
        scored, plain = request(1, text, 2, prompt_logprobs=3), request(2, PROMPTS[2], 2)
        outs, plain_outs = await asyncio.gather(collect_outs(engine, scored), collect_outs(engine, plain))
        assert all(o.prompt_logprobs == () for o in outs[1:] + plain_outs)
        prompt = engine.prompt_ids(scored)
        with torch.no_grad():
            expected = torch.log_softmax(engine.model(torch.tensor([prompt])).logits[0].float(), -1)
        first, *rest = outs[0].prompt_logprobs
        assert (first.token, first.logprob, first.top) == (engine.tokenizer.decode([prompt[0]]), 0.0, [])
        assert len(rest) == len(prompt) - 1
        for place, token in enumerate(rest):
            assert token.token == engine.tokenizer.decode([prompt[place + 1]])
            assert token.logprob == pytest.approx(expected[place, prompt[place + 1]].item(), abs=1e-4)
            top = expected[place].topk(3)
            assert [a.logprob for a in token.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert [a.token for a in token.top] == [engine.tokenizer.decode([i]) for i in top.indices.tolist()]
        assert outs[0].cached_tokens == 0  # computed, not taken from the cache
    finally:
        await engine.close()


async def test_a_logit_bias_is_added_to_its_own_rows_logits_alone(sharp_model):
    """Batched with requests that have none, a request's ``logit_bias`` shifts its own logits
    alone: each biased request decodes what transformers' ``generate`` decodes with that bias
    (its ``sequence_bias``), scored as that bias leaves the logits; the others decode as plain
    ``generate`` does. Biases small enough that the model still chooses, on tokens it chooses."""

    engine = await started(sharp_model)
    try:
        firsts = [plain_greedy(engine, request(i, text), 8) for i, text in enumerate(PROMPTS)]
        inputs = [request(i, text, 8, logprobs=2,
                          logit_bias=tuple(sorted({(t, -3.0) for t in firsts[i][:3]} | {(firsts[i][-1], 2.5)}))
                          if i % 2 == 0 else ())
                  for i, text in enumerate(PROMPTS)]
        served = await asyncio.gather(*(collect_outs(engine, inp) for inp in inputs))
        changed = 0
        for inp, outs, plain in zip(inputs, served, firsts, strict=True):
            ids = [t for o in outs for t in o.token_ids_diff]
            if not inp.sampling.logit_bias:
                assert ids == plain
                continue
            own, steps = transformers_own(engine, inp, 8, sequence_bias={(t,): b for t, b in inp.sampling.logit_bias})
            assert ids == own
            changed += ids != plain
            for token_id, token, expected in zip(ids, [t for o in outs for t in o.logprobs], steps, strict=True):
                assert token.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
        assert changed  # the biases did change an output
    finally:
        await engine.close()


async def test_a_repetition_penalty_is_transformers_own_over_the_prompt_and_the_output(sharp_model):
    """Batched with requests that have none, a request's ``repetition_penalty`` decodes what
    transformers' ``generate`` decodes with that ``repetition_penalty`` (its processor over the
    prompt's tokens and the output's), scored as that penalty leaves the logits."""

    engine = await started(sharp_model)
    try:
        inputs = [request(i, text, 10, logprobs=1, repetition_penalty=1.5 if i % 2 == 0 else 1.0)
                  for i, text in enumerate(PROMPTS)]
        served = await asyncio.gather(*(collect_outs(engine, inp) for inp in inputs))
        changed = 0
        for inp, outs in zip(inputs, served, strict=True):
            ids = [t for o in outs for t in o.token_ids_diff]
            own, steps = transformers_own(engine, inp, 10, repetition_penalty=inp.sampling.repetition_penalty)
            assert ids == own
            changed += inp.sampling.repetition_penalty != 1 and ids != plain_greedy(engine, inp, 10)
            for token_id, token, expected in zip(ids, [t for o in outs for t in o.logprobs], steps, strict=True):
                assert token.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
        assert changed  # the penalty did change an output
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
    """With ``do_sample`` the slot batcher samples each row with its request's own temperature,
    top-p, top-k and min-p; near zero the first two, a ``top_k`` of 1 or a ``min_p`` of 1 leave only
    the most likely token, in a batch whose other rows sample hot."""
    greedy = await started(sharp_model)
    sampled = await started(sharp_model, do_sample=True, seed=3)
    try:
        for i, text in enumerate(PROMPTS):
            expected, _, _ = await ids_and_finish(greedy, request(i, text, max_tokens=16))
            cold = await ids_and_finish(sampled, request(i, text, max_tokens=16, temperature=0.0))
            narrow = await ids_and_finish(sampled, request(i, text, max_tokens=16, temperature=1.0, top_p=1e-6))
            assert cold[0] == expected and narrow[0] == expected
            top_one, floored, _hot = await asyncio.gather(
                ids_and_finish(sampled, request(i, text, max_tokens=16, temperature=5.0, top_k=1)),
                ids_and_finish(sampled, request(20 + i, text, max_tokens=16, temperature=5.0, min_p=1.0)),
                ids_and_finish(sampled, request(40 + i, text, max_tokens=16, temperature=5.0, top_k=50, min_p=0.01)))
            assert top_one[0] == expected and floored[0] == expected
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
