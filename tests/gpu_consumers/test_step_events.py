"""What a request's engine steps become on the bus (gpu_consumers/step_events.py): who asked and
the prompt's usage on the first event, the finish and the counts on the last, nothing of either on
the events between (the common event, built the short way)."""

from tokenbus.gpu_consumers.engines import FINISH_LENGTH, StepOutput
from tokenbus.gpu_consumers.step_events import StepEvents
from tokenbus.schemas import ChatMessage, ChatRequest, TokenEvent, TokenLogprob, TopLogprob


def test_a_turns_first_middle_and_last_events():
    request = ChatRequest(request_id="r-1", model="m", tier="pro", tenant="acme", reply_topic="t", reply_partition=0,
                          messages=[ChatMessage("user", "hi")])
    steps = StepEvents(request, "w-1", "hermes", admitted_at_ms=1234)
    outs = [StepOutput("a", (7,), 12, 1, cached_tokens=4), StepOutput(" b", (8,), 12, 2),
            StepOutput(" c", (9,), 12, 3, FINISH_LENGTH, cached_tokens=4)]
    first, middle, last = (steps.event(seq, out) for seq, out in enumerate(outs))

    assert (first.tenant, first.tier, first.admitted_at_ms, first.prompt_tokens, first.cached_tokens) == (
        "acme", "pro", 1234, 12, 4)
    assert middle == TokenEvent(request_id="r-1", seq=1, text=" b", token_ids=[8], worker_id="w-1",
                                created_at_ms=middle.created_at_ms)
    assert (middle.tenant, middle.prompt_tokens, middle.completion_tokens, middle.finish_reason) == (None,) * 4
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (
        FINISH_LENGTH, 12, 3, 4)
    assert last.tenant is None and [e.worker_id for e in (first, middle, last)] == ["w-1"] * 3
    assert (first.echo, first.prompt_logprobs) == (None, [])


def test_an_echo_s_prompt_and_its_log_probabilities_go_on_the_first_event_alone():
    """A text completion asking for its prompt back: the first event carries the prompt as sent and
    the engine's scores of its tokens; the later ones neither."""
    request = ChatRequest(request_id="r-2", model="m", tier="pro", reply_topic="t", reply_partition=0,
                          messages=[ChatMessage("user", "the  bus\n")], text_prompt=True, echo=True, logprobs=True)
    steps = StepEvents(request, "w-1", "hermes")
    scored = (TokenLogprob("the", 0.0), TokenLogprob("  bus", -1.5, [TopLogprob(" bus", -0.5)]))
    first, last = steps.event(0, StepOutput(" a", (7,), 2, 1, prompt_logprobs=scored)), steps.event(
        1, StepOutput(" b", (8,), 2, 2, FINISH_LENGTH))
    assert (first.echo, first.prompt_logprobs, first.text) == ("the  bus\n", list(scored), " a")
    assert (last.echo, last.prompt_logprobs) == (None, [])
