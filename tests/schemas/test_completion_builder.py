"""CompletionBuilder: the Completion of a turn from its token events, gathered one by one."""

import pytest

from tokenbus.schemas import ChatMessage, ChatRequest, CompletionBuilder, TokenEvent, ToolCall, ToolCallDelta


def request(prefix_text: str = "") -> ChatRequest:
    return ChatRequest(request_id="req-1", model="m", messages=[ChatMessage("user", "hi")], tier="standard",
                       reply_topic="tokens", reply_partition=0,
                       tenant="acme", prefix_text=prefix_text, prefix_token_ids=[5] if prefix_text else [])


def test_a_turn_gathered_event_by_event():
    events = [
        TokenEvent("req-1", 0, "", prompt_tokens=9, created_at_ms=1000),  # the role: no token yet
        TokenEvent("req-1", 1, "Hel", [11], created_at_ms=1010),
        TokenEvent("req-1", 2, "lo", [12], tool_calls=[ToolCallDelta(0, "call-1", "f", '{"a"')], created_at_ms=1020),
        TokenEvent("req-1", 3, "", [13], tool_calls=[ToolCallDelta(0, None, None, ": 1}")], created_at_ms=1030),
        TokenEvent("req-1", 4, "!", [14], finish_reason="tool_calls", prompt_tokens=9, completion_tokens=5,
                   cached_tokens=4, created_at_ms=1040),
    ]
    builder = CompletionBuilder(events[:2])
    for event in events[2:]:
        builder.add(event)
    turn = request(prefix_text="Oh. ")  # one request: two would differ in created_at_ms across a millisecond
    completion = builder.build(turn, "w-1")

    assert builder.count == 5 and builder.last is events[-1]
    assert completion == CompletionBuilder(events).build(turn, "w-1")
    assert completion.text == "Oh. Hello!"
    assert completion.tool_calls == [ToolCall("call-1", "f", '{"a": 1}')]
    assert (completion.started_at_ms, completion.first_token_at_ms, completion.finished_at_ms) == (1000, 1010, 1040)
    assert (completion.prompt_tokens, completion.completion_tokens, completion.cached_prompt_tokens) == (9, 5, 4)
    assert completion.finish_reason == "tool_calls" and not completion.cancelled
    assert (completion.worker_id, completion.tenant, completion.carried_tokens) == ("w-1", "acme", 1)


def test_a_turn_that_ended_without_a_finish_reason_or_a_token():
    builder = CompletionBuilder([TokenEvent("req-1", 0, "", created_at_ms=7)])
    completion = builder.build(request(), "w-1")
    assert completion.finish_reason == "error" and completion.first_token_at_ms is None
    assert completion.started_at_ms == completion.finished_at_ms == 7


def test_no_event_no_completion():
    with pytest.raises(ValueError, match="last token event"):
        CompletionBuilder().build(request(), "w-1")
