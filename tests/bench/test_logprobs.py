"""The log probabilities scenario (bench/logprobs.py): each way is timed on both sides after its
chunk is checked to carry the scores its request asks (and none where it does not), and a scored
token event is the larger for its scores."""

from bench.logprobs import WAYS, run, table


def test_each_way_is_timed_on_both_sides_and_a_scored_event_is_larger():
    result = run(calls=20, rounds=1)
    assert set(result["bytes"]) == set(WAYS)
    assert result["bytes"]["not asked"] < result["bytes"]["logprobs"] < result["bytes"]["top_logprobs 5"]
    assert all(result["us"][side][way] > 0 for side in ("consumer", "edge") for way in WAYS)
    assert len(table(result).splitlines()) == 2 + len(WAYS)
