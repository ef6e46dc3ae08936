"""What a request asks of the sampling, every engine (the contract's engines, engine_contract.py): stop
sequences, vLLM's ``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``top_k``, ``min_p`` and
``repetition_penalty``, OpenAI's presence and frequency penalties, logit bias and log probabilities,
each honoured as asked or refused as an engine cannot (transformers' manager batching takes no
per-request penalty, bias, repetition penalty or ``min_tokens``, and scores the sampled token
alone)."""

import contextlib
import dataclasses
import json
import logging
import re

import jsonschema
import pytest

from tests.gpu_consumers.engine_contract import collect, continues_after_takeover, ids_of, published, request, text_of
from tokenbus.gpu_consumers.engines import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationInput,
    InvalidInput,
    SamplingParams,
    SimulatedEngine,
)
from tokenbus.gpu_consumers.engines.bad_words import bad_word_variants
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY
from tokenbus.gpu_consumers.engines.simulated_words import decode as simulated_decode
from tokenbus.gpu_consumers.engines.simulated_words import encode as simulated_encode
from tokenbus.schemas import ChatMessage

pytestmark = pytest.mark.asyncio(loop_scope="module")


@contextlib.asynccontextmanager
async def ending_early(engine, inp: GenerationInput):
    """Yields whether ``inp`` now ends before its ``max_tokens`` at an end-of-sequence token: the
    simulated engine's natural length (40 here) is its end; an ``hf`` engine is told that the token
    greedy decoding gives ``inp`` first is an end token, while this lasts (its generation config's
    and the slots' ends); the TensorRT-LLM fake never samples one."""
    if isinstance(engine, SimulatedEngine):
        yield True
        return
    if not hasattr(engine, "eos_token_ids"):
        yield False
        return
    (token,) = [t for o in await collect(engine, dataclasses.replace(inp, sampling=SamplingParams(max_tokens=1)))
                for t in o.token_ids_diff]
    kept = set(engine.eos_token_ids)
    slots, manager = engine._slots, engine._manager
    engine.eos_token_ids = kept | {token}
    if slots is not None:
        slots._eos = frozenset(engine.eos_token_ids)
    if manager is not None:
        manager.generation_config.eos_token_id = sorted(engine.eos_token_ids)
    try:
        yield True
    finally:
        engine.eos_token_ids = kept
        if slots is not None:
            slots._eos = frozenset(kept)
        if manager is not None:
            manager.generation_config.eos_token_id = sorted(kept)


async def test_ignore_eos_generates_on_past_the_end_token_to_max_tokens(engine):
    """vLLM's ``ignore_eos``: an end-of-sequence token does not end the output, ``max_tokens`` does."""
    plain = request(23, "on and on", max_tokens=48)
    async with ending_early(engine, plain) as ends:
        stopped = await collect(engine, plain)
        going = await collect(engine, dataclasses.replace(plain, sampling=SamplingParams(max_tokens=48, ignore_eos=True)))
    if ends:
        assert stopped[-1].finish_reason == FINISH_STOP and stopped[-1].completion_tokens < 48
    assert going[-1].finish_reason == FINISH_LENGTH and going[-1].completion_tokens == 48


async def test_stop_token_ids_end_the_output_where_they_come_as_an_end_token_would(engine):
    """vLLM's ``stop_token_ids``: the output is the plain one up to and with the first of them,
    finished ``stop``; nothing else changes. An id outside the model's vocabulary is refused."""
    plain = ids_of(await collect(engine, request(29, "stop at a token", max_tokens=24)))
    stop = plain[6]
    with pytest.raises(InvalidInput, match="token id 1000000000 is not in the model's vocabulary"):
        engine.generate(request(29, "stop at a token", max_tokens=24, stop_token_ids=(stop, 10**9)))
    outs = await collect(engine, request(29, "stop at a token", max_tokens=24, stop_token_ids=(stop,)))
    assert ids_of(outs) == plain[: plain.index(stop) + 1]
    assert outs[-1].finish_reason == FINISH_STOP


async def test_min_tokens_holds_off_the_end_token_and_the_stop_token_ids(engine):
    """vLLM's ``min_tokens``: neither the end-of-sequence token nor a stop token id ends the output
    before it holds that many tokens (a stop id is not picked before then), and both end it after.
    Transformers' manager batching cannot hold them off for one request: it refuses."""
    plain = request(37, "hold the end off", max_tokens=48)
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="takes no min_tokens"):
            engine.generate(dataclasses.replace(plain, sampling=SamplingParams(max_tokens=48, min_tokens=5)))
        return
    async with ending_early(engine, plain) as ends:
        stopped = await collect(engine, plain)
        held = await collect(engine, dataclasses.replace(plain, sampling=SamplingParams(max_tokens=48, min_tokens=44)))
    if ends:
        assert stopped[-1].completion_tokens < 44
        assert held[-1].completion_tokens >= 44
    plain_ids = ids_of(stopped)
    first = plain_ids[0]
    outs = await collect(engine, request(37, "hold the end off", max_tokens=48, min_tokens=4, stop_token_ids=(first,)))
    ids = ids_of(outs)
    assert first not in ids[:4] and len(ids) >= 4
    assert outs[-1].finish_reason == FINISH_STOP if first in ids else outs[-1].finish_reason in (FINISH_STOP, FINISH_LENGTH)
    assert first not in ids[:-1]  # once allowed, the first stop id ends it


async def test_allowed_token_ids_are_the_only_tokens_the_output_holds(engine):
    """vLLM's ``allowed_token_ids``: every token of the output is one of them (three the plain
    output never holds, here: ordinary tokens of every engine's vocabulary), with a logit bias on
    top; transformers' manager batching refuses them."""
    plain = ids_of(await collect(engine, request(67, "only these", max_tokens=16)))
    allowed = tuple(i for i in range(3, 43) if i not in plain)[:3]
    inp = request(67, "only these", max_tokens=16, allowed_token_ids=allowed, logit_bias=((allowed[0], 0.5),))
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="takes no logit_bias or allowed_token_ids"):
            engine.generate(inp)
        return
    ids = ids_of(await collect(engine, inp))
    assert len(ids) == 16 and set(ids) <= set(allowed)


def coder(engine):
    """How the engine reads a bad word, and writes token ids: its own tokenizer (the simulated
    engine's: its words)."""
    if isinstance(engine, SimulatedEngine):
        return simulated_encode, simulated_decode
    tokenizer = engine._llm.tokenizer if hasattr(engine, "_llm") else engine.tokenizer
    return lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.decode


def holds(ids: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(ids[i:i + len(sequence)]) == sequence for i in range(len(ids) - len(sequence) + 1))


async def test_bad_words_never_end_in_the_output_and_a_takeover_keeps_to_them(engine):
    """vLLM's ``bad_words``: a word of two tokens and one of one, each read by the engine's own
    tokenizer as vLLM reads it (as it is, and with a space before it), taken from the plain
    output, which holds them; the output asked to leave them out holds none of their readings, and
    a sequence taken over midway gives the uninterrupted one's rest. Transformers' manager
    batching refuses them."""
    plain = ids_of(await collect(engine, request(71, "say it plainly", max_tokens=24)))
    encode, decode = coder(engine)
    words = []
    for length in (2, 1):  # the first stretch of the plain output that reads back as a word it holds
        for i in range(4, len(plain) - length):
            word = decode(plain[i:i + length]).strip()
            readings = [ids for _, ids in bad_word_variants([word], encode)] if word else []
            if any(len(ids) == length and holds(plain, ids) for ids in readings):
                words.append((word, readings))
                break
    assert len(words) == 2, f"no stretch of {plain} reads back as a word"
    inp = request(71, "say it plainly", max_tokens=24, bad_words=tuple(word for word, _ in words))
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="takes no bad_words"):
            engine.generate(inp)
        return
    for asked in (words[:1], words):  # the word of two tokens alone (ruled out on the device in the slots), then both
        inp = request(71, "say it plainly", max_tokens=24, bad_words=tuple(word for word, _ in asked))
        outs = await collect(engine, inp)
        ids = ids_of(outs)
        assert ids != plain and len(ids) == 24
        assert not any(holds(ids, reading) for _, readings in asked for reading in readings)
    await continues_after_takeover(engine, inp, outs, 10)


async def test_top_k_and_min_p_keep_the_likeliest_tokens_alone(engine):
    """vLLM's ``top_k`` and ``min_p`` leave greedy decoding as it is (the likeliest token passes
    both); the simulated engine samples, and with ``top_k`` 1 draws its heaviest word alone, the
    first of its equally weighted vocabulary, every time."""
    plain = ids_of(await collect(engine, request(47, "keep the best", max_tokens=12)))
    kept = await collect(engine, request(47, "keep the best", max_tokens=12, top_k=1, min_p=0.5))
    ids = ids_of(kept)
    if isinstance(engine, SimulatedEngine):
        assert ids == [0] * len(ids) and plain != ids
    else:
        assert ids == plain


TRIP = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                        "mode": {"enum": ["rail", "road"]}}, "required": ["city", "days", "mode"]}


async def test_a_json_response_format_is_answered_in_json_of_its_schema_or_refused(engine):
    """OpenAI's ``response_format``: ``json_schema`` answers with JSON its schema describes,
    ``json_object`` with a JSON object, each to its end (``stop``): the simulated engine draws a
    value of the schema, TensorRT-LLM decodes under it (guided decoding; its fake answers with one
    fixed instance). The ``hf`` engine cannot constrain its decoding: it refuses."""
    inp = request(59, "plan a trip", max_tokens=200, response_format="json_schema", json_schema=json.dumps(TRIP))
    if engine.name == "hf":
        with pytest.raises(InvalidInput, match="cannot constrain its output"):
            engine.generate(inp)
        return
    outs = await collect(engine, inp)
    jsonschema.validate(json.loads(text_of(outs)), TRIP)
    assert outs[-1].finish_reason == FINISH_STOP
    plain = await collect(engine, request(59, "plan a trip", max_tokens=200, response_format="json_object"))
    assert isinstance(json.loads(text_of(plain)), dict) and plain[-1].finish_reason == FINISH_STOP


async def test_a_regex_response_format_is_answered_with_a_text_it_matches_or_refused(engine):
    """vLLM's ``guided_regex`` (and ``guided_choice``, the alternation of its choices): the whole
    answer matches it, to its end (``stop``); the ``hf`` engine refuses, as it does JSON."""
    patterns = [r"(rail|road|sea)", r"[A-Z][a-z]{2,5} \d{1,3}(\.\d)?"]
    for i, pattern in enumerate(patterns):
        inp = request(61 + i, "answer in form", max_tokens=100, response_format="regex", guided_regex=pattern)
        if engine.name == "hf":
            with pytest.raises(InvalidInput, match="cannot constrain its output"):
                engine.generate(inp)
            return
        outs = await collect(engine, inp)
        assert re.fullmatch(pattern, text_of(outs)) and outs[-1].finish_reason == FINISH_STOP


def repeats(outs) -> int:
    """How many of the output's tokens it held already."""
    ids = ids_of(outs)
    return len(ids) - len(set(ids))


async def test_penalties_make_the_output_repeat_itself_less_and_survive_a_takeover(engine, caplog):
    """OpenAI's presence and frequency penalties come off the logits of tokens the output holds, so
    a penalized output repeats itself less (the tiny random model and the simulated engine repeat
    themselves plenty; TensorRT-LLM's fake, a hash of the last tokens, seldom does, and passes over
    every token a penalty counts). A taken-over penalized sequence counts what was published as
    output and continues as the uninterrupted one would have. Transformers' continuous-batching
    manager takes no per-request penalty (engines/hf.py): it generates the plain output, and says so."""
    messages = (ChatMessage("user", "say it again and again"),)
    plain = await collect(engine, GenerationInput("contract-31", messages, SamplingParams(max_tokens=32)))
    inp = GenerationInput("contract-31", messages, SamplingParams(max_tokens=32, presence_penalty=2, frequency_penalty=2))
    with caplog.at_level(logging.WARNING, logger="tokenbus.gpu_consumers.engines.hf"):
        penalized = await collect(engine, inp)
    if getattr(engine, "batching", None) == "manager":
        assert ids_of(penalized) == ids_of(plain)
        assert "does not apply presence or frequency penalties" in caplog.text
        return
    if engine.name != "trtllm":
        assert repeats(plain) > 0
    assert repeats(penalized) < max(repeats(plain), 1)
    await continues_after_takeover(engine, inp, penalized, 10)


async def test_a_repetition_penalty_makes_the_output_repeat_itself_less_and_survives_a_takeover(engine):
    """vLLM's ``repetition_penalty`` shrinks the logits of the tokens the prompt or the output
    holds (divided where positive, multiplied where not), so the output repeats itself less. The
    simulated engine's words all have logits of 0, which the penalty leaves as they are (as it
    would a model's): there, every word is lifted by a bias of 1 first. A taken-over sequence
    continues as the uninterrupted one would have. Transformers' manager batching refuses it."""
    messages = (ChatMessage("user", "say it again and again"),)
    lifted = tuple((i, 1.0) for i in range(len(VOCABULARY))) if isinstance(engine, SimulatedEngine) else ()
    base = SamplingParams(max_tokens=32, logit_bias=lifted)
    inp = GenerationInput("contract-53", messages, dataclasses.replace(base, repetition_penalty=10.0))
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="takes no repetition_penalty"):
            engine.generate(inp)
        return
    plain = await collect(engine, GenerationInput("contract-53", messages, base))
    penalized = await collect(engine, inp)
    if engine.name != "trtllm":
        assert repeats(plain) > 0
    assert repeats(penalized) < max(repeats(plain), 1)
    await continues_after_takeover(engine, inp, penalized, 10)


async def test_logit_bias_forces_or_bans_the_tokens_it_names_and_survives_a_takeover(engine):
    """OpenAI's ``logit_bias`` adds to the logits of the tokens it names: +100 on one token makes
    it every token of the output, -100 on each token the plain output holds keeps them all out of
    it. A biased sequence taken over continues as the uninterrupted one would have. An id outside
    the model's vocabulary is refused; so is any bias by transformers' manager batching, which
    cannot apply one (engines/hf.py)."""
    plain = ids_of(await collect(engine, request(41, "bias me", max_tokens=12)))
    target = next(t for t in reversed(plain) if t != plain[0])
    with pytest.raises(InvalidInput, match="not in the model's vocabulary"):
        engine.generate(request(41, "bias me", max_tokens=12, logit_bias=((10**9, 1.0),)))
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="takes no logit_bias"):
            engine.generate(request(41, "bias me", max_tokens=12, logit_bias=((target, 100.0),)))
        return
    forced = await collect(engine, request(41, "bias me", max_tokens=12, logit_bias=((target, 100.0),)))
    assert ids_of(forced) == [target] * 12
    ban = tuple((t, -100.0) for t in sorted(set(plain)))
    inp = request(41, "bias me", max_tokens=12, logit_bias=ban)
    banned = await collect(engine, inp)
    banned_ids = ids_of(banned)
    assert len(banned_ids) == 12 and not set(banned_ids) & set(plain)
    await continues_after_takeover(engine, inp, banned, 5)


async def test_asked_for_logprobs_each_token_is_scored_with_the_likeliest_first(engine):
    """Each generated token's log probability and the likeliest tokens' in its place, likeliest
    first, one entry a token; asking changes no token. Greedy decoding (hf, TensorRT-LLM's fake)
    picks the likeliest: its log probability is the first alternative's. Transformers' manager
    batching scores the sampled token alone (engines/hf.py): it refuses ``top_logprobs``, and its
    scores are the log-softmax of the logits transformers' own ``generate`` scores the prompt with."""
    inp = request(17, "tell me a story", max_tokens=8, logprobs=3)
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="scores the sampled token alone"):
            engine.generate(inp)
        await manager_scores_are_the_model_s(engine, dataclasses.replace(inp, sampling=SamplingParams(max_tokens=8,
                                                                                                      logprobs=0)))
        return
    outs = await collect(engine, inp)
    plain = await collect(engine, request(17, "tell me a story", max_tokens=8))
    # (the tokens, not how they were grouped: a reader that falls behind takes two steps as one)
    assert ids_of(outs) == ids_of(plain)
    assert [len(o.logprobs) for o in outs] == [len(o.token_ids_diff) for o in outs]
    scored = [t for o in outs for t in o.logprobs]
    assert len(scored) == 8
    for t in scored:
        likeliest = [a.logprob for a in t.top]
        assert len(likeliest) == 3 and likeliest == sorted(likeliest, reverse=True)
        assert all(lp <= 0 for lp in [t.logprob, *likeliest]) and t.logprob <= likeliest[0] + 1e-5
    if engine.name != "simulated":
        assert all(t.token == t.top[0].token and t.logprob == pytest.approx(t.top[0].logprob) for t in scored)


async def manager_scores_are_the_model_s(engine, inp: GenerationInput) -> None:
    import torch

    outs = await collect(engine, inp)
    ids = ids_of(outs)
    scored = [t for o in outs for t in o.logprobs]
    assert len(scored) == len(ids) == 8 and all(t.top == [] for t in scored)
    prompt = torch.tensor([engine.prompt_ids(inp)])
    out = engine.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for step, (token_id, token) in enumerate(zip(ids, scored, strict=True)):
        assert token.logprob == pytest.approx(torch.log_softmax(out.scores[step][0].float(), -1)[token_id].item(),
                                              abs=1e-4)


async def test_stop_sequences_never_leak_into_the_text(engine):
    full_text = text_of(await collect(engine, request(3, "stop me", max_tokens=30)))
    stop = full_text[8:11]
    assert len(stop) == 3
    outs = await collect(engine, request(3, "stop me", max_tokens=30, stop=(stop,)))
    assert outs[-1].finish_reason == FINISH_STOP
    assert text_of(outs) == full_text[: full_text.index(stop)]


async def test_a_stop_sequence_stays_in_the_text_where_asked(engine):
    """vLLM's ``include_stop_str_in_output``: the output ends with the stop sequence that ended it,
    where without it the text ends before it (TensorRT-LLM is asked to keep the stop's tokens)."""
    full_text = text_of(await collect(engine, request(4, "stop me", max_tokens=30)))
    stop = full_text[8:11]
    outs = await collect(engine, request(4, "stop me", max_tokens=30, stop=(stop,), include_stop_str_in_output=True))
    assert outs[-1].finish_reason == FINISH_STOP
    assert text_of(outs) == full_text[: full_text.index(stop) + len(stop)]


async def test_a_stop_sequence_ends_nothing_before_min_tokens(engine):
    """vLLM's rule: no stop condition ends an output that holds fewer than ``min_tokens`` tokens,
    a stop sequence's neither: one the first tokens hold is passed over and kept in the text.
    Transformers' manager batching refuses ``min_tokens`` (see above)."""
    if getattr(engine, "batching", None) == "manager":
        return
    full_text = text_of(await collect(engine, request(5, "stop me late", max_tokens=30, ignore_eos=True)))
    stop = full_text[:3]
    outs = await collect(engine, request(5, "stop me late", max_tokens=30, ignore_eos=True, stop=(stop,), min_tokens=10))
    assert outs[-1].completion_tokens >= 10 and stop in text_of(outs)
    assert full_text.startswith(text_of(outs))


async def test_a_prompt_s_log_probabilities_come_with_the_first_step_alone(engine):
    """A text completion's echo with logprobs (``prompt_logprobs``): the first step carries one for
    each prompt token, the first unscored (0, no likeliest) and each later one at most 0 with the
    likeliest asked; later steps, a request that does not ask and a taken-over sequence (its first
    step was published) carry none, and asking changes no token. Transformers' manager batching
    cannot score a prompt: it refuses."""
    plain = dataclasses.replace(request(71, "the bus carries every token to the edge", max_tokens=4), text_prompt=True)
    scored = dataclasses.replace(plain, sampling=SamplingParams(max_tokens=4, prompt_logprobs=2))
    if getattr(engine, "batching", None) == "manager":
        with pytest.raises(InvalidInput, match="takes no prompt_logprobs"):
            engine.generate(scored)
        return
    outs, plain_outs = await collect(engine, scored), await collect(engine, plain)
    first, *rest = outs[0].prompt_logprobs
    assert len(outs[0].prompt_logprobs) == outs[0].prompt_tokens > 1
    assert (first.logprob, first.top) == (0.0, [])
    assert all(t.logprob <= 0 and len(t.top) == 2 for t in rest)
    assert all(o.prompt_logprobs == () for o in outs[1:] + plain_outs)
    assert ids_of(outs) == ids_of(plain_outs)
    prefix_ids, prefix_text = published(outs, 2)
    taken_over = await collect(engine, dataclasses.replace(scored, prefix_token_ids=prefix_ids, prefix_text=prefix_text))
    assert all(o.prompt_logprobs == () for o in taken_over)
    cut = await collect(engine, dataclasses.replace(scored, truncate_prompt_tokens=3))  # the last three alone
    assert len(cut[0].prompt_logprobs) == cut[0].prompt_tokens == 3
    assert (cut[0].prompt_logprobs[0].logprob, cut[0].prompt_logprobs[0].top) == (0.0, [])
    assert [t.token for t in cut[0].prompt_logprobs[1:]] == [t.token for t in outs[0].prompt_logprobs[-2:]]


async def test_a_prompt_with_more_scores_than_a_token_event_carries_is_refused(engine, monkeypatch):
    """Its tokens x (likeliest + 1) past ``PROMPT_SCORES_MAX`` (lowered here): ``InvalidInput`` before
    anything runs, for the engine to answer as a request it cannot serve; a taken-over one is not
    scored again, so not refused. (The manager refuses every prompt score.)"""
    monkeypatch.setattr("tokenbus.gpu_consumers.engines.base.PROMPT_SCORES_MAX", 20)
    inp = dataclasses.replace(request(73, "the bus carries every token to the edge", max_tokens=2,
                                      prompt_logprobs=2), text_prompt=True)
    with pytest.raises(InvalidInput, match="more than 20 scores|takes no prompt_logprobs"):
        engine.generate(inp)
    if getattr(engine, "batching", None) != "manager":
        plain = await collect(engine, dataclasses.replace(inp, sampling=SamplingParams(max_tokens=2)))
        prefix_ids, prefix_text = published(plain, 1)
        outs = await collect(engine, dataclasses.replace(inp, prefix_token_ids=prefix_ids, prefix_text=prefix_text))
        assert outs[-1].finished and outs[-1].error is None
