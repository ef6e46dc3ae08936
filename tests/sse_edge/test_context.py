"""Context windows: counting a prompt's tokens (a real tokenizer, or the estimate) and fitting
stored turns before a request's messages."""

import pytest
from tokenizers import Tokenizer

from tests.gpu_consumers.tiny_model import build_tiny_model
from tokenbus.schemas import ChatMessage
from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.sse_edge.plumbing.context import ContextWindows
from tokenbus.sse_edge.plumbing.history import History, StoredTurn
from tokenbus.sse_edge.plumbing.summaries import needs_summary
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.transcripts import Summary


def turn(i: int, words: int) -> StoredTurn:
    return StoredTurn(f"r{i}", 1000 + i, (ChatMessage("user", f"q{i} " + "word " * words),
                                          ChatMessage("assistant", f"a{i}")))


def test_the_newest_whole_turns_that_fit_go_between_the_system_message_and_the_new_ones():
    windows = ContextWindows(EdgeSettings(context_windows={"m": 100}))
    new = [ChatMessage("system", "Be brief."), ChatMessage("user", "And now?")]
    turns = [turn(0, 2), turn(1, 40), turn(2, 2), turn(3, 2)]  # turn 1 alone is too big to fit
    prompt, dropped = windows.with_history("m", new, History(turns), max_tokens=10)
    assert [m.content.split()[0] for m in prompt] == ["Be", "q2", "a2", "q3", "a3", "And"]  # nothing older than 1
    assert windows.count("m", prompt) <= 100 - 10 and dropped == turns[:2]


def test_the_summary_of_left_out_turns_goes_first_and_only_when_turns_are_left_out():
    windows = ContextWindows(EdgeSettings(context_windows={"m": 100}))
    new = [ChatMessage("system", "Be brief."), ChatMessage("user", "And now?")]
    summary = Summary("they asked about q0 and q1", 1001, "r1")
    turns = [turn(0, 2), turn(1, 40), turn(2, 2), turn(3, 2)]
    prompt, dropped = windows.with_history("m", new, History(turns, summary), max_tokens=10)
    assert prompt[1] == ChatMessage("system", "Summary of the earlier conversation: they asked about q0 and q1")
    assert [m.content.split()[0] for m in prompt[2:]] == ["q2", "a2", "q3", "a3", "And"]
    assert needs_summary(History(turns, summary), dropped) is False  # it covers r1, the newest left out
    assert needs_summary(History(turns, Summary("older", 1000, "r0")), dropped) is True
    everything, none_dropped = windows.with_history("m", new, History(turns[2:], summary), max_tokens=10)
    assert none_dropped == [] and all("Summary" not in m.content for m in everything)


def test_a_prompt_that_cannot_fit_is_refused_with_the_numbers():
    windows = ContextWindows(EdgeSettings(context_windows={"m": 50}))
    with pytest.raises(InvalidRequest) as refused:
        windows.with_history("m", [ChatMessage("user", "x" * 200)], History([]), max_tokens=5)
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 50 tokens" in str(refused.value) and "(54 in the messages, 5 in" in str(refused.value)


def test_a_configured_tokenizer_counts_exactly(tmp_path):
    path = build_tiny_model(tmp_path) / "tokenizer.json"
    windows = ContextWindows(EdgeSettings(tokenizers={"m": str(path)}))
    text = "The bus carries every token to the edge."
    assert windows.count("m", [ChatMessage("user", text)]) == len(Tokenizer.from_file(str(path)).encode(text).ids) + 4
    assert windows.count("other", [ChatMessage("user", text)]) == len(text) // 4 + 4  # the estimate elsewhere
    tool = '{"name": "weather", "parameters": {"type": "object"}}'
    assert windows.count_texts("m", [text, tool]) == windows.count("m", [ChatMessage("user", text)]) + \
        len(Tokenizer.from_file(str(path)).encode(tool).ids) + 4  # a tool's text as a message's
