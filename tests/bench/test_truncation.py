"""The truncation scenario's reading of a stream's log (bench/truncation.py)."""

from bench.truncation import cut_after_phrase
from tokenbus.schemas import TokenEvent


def logged(*events: tuple[int, TokenEvent]) -> list[tuple[int, int, TokenEvent]]:
    return [(offset, timestamp, event) for offset, (timestamp, event) in enumerate(events)]


def test_the_cut_is_timed_from_the_event_that_completes_the_phrase_and_counts_the_events_between():
    stream = logged((100, TokenEvent("r", 0, "on ")), (110, TokenEvent("r", 1, "the ed")), (120, TokenEvent("r", 2, "ge of")),
                    (130, TokenEvent("r", 3, " it")), (140, TokenEvent("r", 4, " all")),
                    (127, TokenEvent("r", 5, finish_reason="content_filter", truncate=True)))
    assert cut_after_phrase(stream, "the edge") == (7, 2)


def test_a_stream_never_cut_or_cut_without_the_phrase_has_no_figure():
    said = logged((100, TokenEvent("r", 0, "the edge")), (110, TokenEvent("r", 1, "!", finish_reason="stop")))
    assert cut_after_phrase(said, "the edge") is None
    cut = logged((100, TokenEvent("r", 0, "calm")), (101, TokenEvent("r", 1, truncate=True)))
    assert cut_after_phrase(cut, "the edge") is None
