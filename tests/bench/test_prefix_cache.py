"""`python -m bench prefix_cache`'s workloads and summary (the run itself is a benchmark, not a test)."""

from bench import prefix_cache


def systems(workload: str, round_no: int) -> list[str]:
    return [inp.messages[0].content for inp in prefix_cache.round_inputs(round_no, workload, prefix_cache.REQUESTS[workload])]


def test_shared_rounds_draw_on_a_few_system_prompts_of_their_own_and_unique_ones_share_none():
    shared, unique = systems("shared", 0), systems("unique", 0)
    assert len(shared) == prefix_cache.REQUESTS["shared"] and len(set(shared)) <= prefix_cache.PROMPTS < len(shared)
    assert len(set(unique)) == len(unique) == prefix_cache.REQUESTS["unique"]
    busy = systems("busy", 0)
    assert prefix_cache.PROMPTS_OF["shared"] < len(set(busy)) <= prefix_cache.PROMPTS_OF["busy"] < len(busy)
    assert not set(shared) & set(systems("shared", 1))  # no round inherits another's cache
    assert len({inp.request_id for inp in prefix_cache.round_inputs(0, "shared", 16)}) == len(shared)


def test_the_summary_counts_the_cached_share_and_rates_over_every_round():
    rounds = [{"ttft_ms": [100.0, 300.0], "prompt_tokens": 600, "cached_tokens": 300, "output_tokens": 16,
               "requests": 2, "wall_s": 1.0},
              {"ttft_ms": [200.0, 400.0], "prompt_tokens": 600, "cached_tokens": 0, "output_tokens": 16,
               "requests": 2, "wall_s": 3.0}]
    s = prefix_cache.summary(rounds)
    assert (s["requests"], s["cached_share"], s["output_tokens_per_s"], s["requests_per_s"]) == (4, 0.25, 8.0, 1.0)
    assert s["prompt_tokens_mean"] == 300.0 and s["ttft_p50_ms"] > 200.0 and s["ttft_p99_ms"] <= 400.0
