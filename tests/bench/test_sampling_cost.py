"""`python -m bench sampling_cost`'s requests and rounds (the run itself is a benchmark, not a test):
each option's requests ask it and nothing else, every request runs to its full length, and the
table shows every option against plain decoding."""

import pytest

from bench import sampling_cost
from tokenbus.gpu_consumers.engines import SamplingParams, SimulatedEngine, SimulatedEngineSettings


@pytest.mark.parametrize("asked", [sampling_cost.PLAIN, *sampling_cost.ASKED])
def test_each_option_s_requests_ask_it_alone_and_run_to_their_full_length(asked):
    work = sampling_cost.inputs(asked)
    assert len(work) == sampling_cost.REQUESTS and len({inp.request_id for inp in work}) == len(work)
    plain = SamplingParams(max_tokens=sampling_cost.OUTPUT_TOKENS, ignore_eos=True)
    differs = {name for name in SamplingParams.__slots__ if getattr(work[0].sampling, name) != getattr(plain, name)}
    assert differs == set(sampling_cost.ASKED.get(asked, {}))


async def test_a_round_counts_every_request_s_tokens():
    engine = SimulatedEngine(SimulatedEngineSettings(ttft_ms=0, tokens_per_s=10_000))
    await engine.start()
    try:
        tokens, seconds = await sampling_cost.run_round(engine, sampling_cost.inputs("penalties")[:4])
    finally:
        await engine.close()
    assert tokens == 4 * sampling_cost.OUTPUT_TOKENS and seconds > 0


async def test_a_scoring_round_counts_every_prompt_s_tokens_and_scores_each_where_asked():
    """The scoring rows' text prompts share no prefix (the prefix cache would favour plain ones,
    which it serves, over scored ones, which it does not) and are scored where a row asks."""
    plain, scored = sampling_cost.scoring_inputs(sampling_cost.PLAIN), sampling_cost.scoring_inputs("prompt logprobs (top 1)")
    assert len({inp.messages[0].content.split(":")[0] for inp in plain + scored}) == 2 * sampling_cost.SCORED_REQUESTS
    assert {inp.sampling.prompt_logprobs for inp in plain} == {None} and {inp.sampling.prompt_logprobs for inp in scored} == {1}
    engine = SimulatedEngine(SimulatedEngineSettings(ttft_ms=0, tokens_per_s=10_000))
    await engine.start()
    try:
        tokens, seconds = await sampling_cost.run_round(engine, scored[:4], prompts=True)
    finally:
        await engine.close()
    assert tokens == 4 * len(scored[0].messages[0].content.split()) and seconds > 0
