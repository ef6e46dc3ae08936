"""The placement index on its own: which partition a request goes to, from the reports GPU
consumers publish (no broker needed: the index does no I/O)."""

import dataclasses

from tokenbus.producers.placement import (
    ROUTE_BALANCE,
    ROUTE_EXPECTED,
    ROUTE_MISS,
    ROUTE_PREFIX,
    ROUTE_UNKNOWN,
    PrefixIndex,
)
from tokenbus.schemas import CachedPrefix, CacheReport, ChatMessage, ChatRequest
from tokenbus.schemas.prefixes import segment_hashes

TOPIC = "tokenbus.requests.m.standard"
SYSTEM = ChatMessage("system", "You are the assistant of a long shared prompt.")


def chat(user: str, conversation: str, system: ChatMessage = SYSTEM) -> ChatRequest:
    return ChatRequest(request_id=f"r-{conversation}-{user}", model="m", tier="standard",
                       messages=[system, ChatMessage("user", user)], reply_topic="t", reply_partition=0,
                       conversation_id=conversation)


def report(worker: str, partitions: list[int], stored: dict[int, int] | None = None, seq: int = 0,
           started: int = 1, **fields) -> CacheReport:
    return CacheReport(worker, "m", started, seq, stored=[CachedPrefix(h, t) for h, t in (stored or {}).items()],
                       partitions=[(TOPIC, p) for p in partitions], **fields)


def system_prefix(request: ChatRequest) -> int:
    return segment_hashes(request)[0]


def two_workers(index: PrefixIndex, a_holds: dict[int, int] | None = None, b_holds: dict[int, int] | None = None,
                now: float = 0.0) -> None:
    index.apply(report("a", [0, 1], a_holds), now)
    index.apply(report("b", [2, 3], b_holds), now)


def test_a_request_goes_to_the_worker_holding_the_longest_prefix_of_its_prompt():
    index = PrefixIndex(stale_after_s=30)
    first = chat("hello", "c1")
    later = dataclasses.replace(first, request_id="r2", messages=[*first.messages, ChatMessage("assistant", "hi"),
                                                                  ChatMessage("user", "more")])
    prefixes = segment_hashes(later)
    # b holds the system prompt only; a holds the whole first turn (a longer prefix of `later`).
    two_workers(index, a_holds={prefixes[1]: 32}, b_holds={prefixes[0]: 16})
    placed = index.place(later, TOPIC, now=1.0)
    assert (placed.reason, placed.worker_id, placed.hit_tokens) == (ROUTE_PREFIX, "a", 32)
    assert placed.partition in (0, 1)
    # Another conversation sharing only the system prompt goes to b, which holds it.
    other = index.place(chat("unrelated", "c9"), TOPIC, now=1.0)
    assert (other.reason, other.worker_id, other.hit_tokens) == (ROUTE_PREFIX, "b", 16)
    assert other.partition in (2, 3)
    assert other.annotations() == {"route": "prefix", "route.hit_tokens": "16", "route.worker": "b"}


def test_one_conversation_keeps_to_one_partition_of_the_chosen_worker():
    index = PrefixIndex(stale_after_s=30)
    request = chat("hello", "conv-42")
    partitions = set()
    for i in range(5):  # each turn after the last was answered (and reported)
        two_workers(index, a_holds={system_prefix(request): 16})
        partitions.add(index.place(chat(f"turn {i}", "conv-42"), TOPIC, now=1.0).partition)
    assert len(partitions) == 1


def test_knowing_nothing_leaves_the_partition_to_the_key():
    index = PrefixIndex(stale_after_s=30)
    assert index.place(chat("hi", "c1"), TOPIC, now=0.0).reason == ROUTE_UNKNOWN
    two_workers(index)
    placed = index.place(chat("hi", "c1"), TOPIC, now=0.0)
    assert (placed.partition, placed.reason) == (None, ROUTE_MISS)
    # A worker that owns no partition of the request's topic is no candidate.
    index.apply(report("a", [0, 1], {system_prefix(chat("hi", "c1")): 16}), 0.0)
    assert index.place(chat("hi", "c1"), "tokenbus.requests.m.batch", now=0.0).reason == ROUTE_UNKNOWN


def test_a_prefix_just_sent_somewhere_is_expected_there_until_its_report():
    index = PrefixIndex(stale_after_s=30)
    two_workers(index)
    first = chat("a", "c1")
    placed = index.place(first, TOPIC, now=0.0)
    assert placed.reason == ROUTE_MISS
    index.landed(placed, TOPIC, 2, now=0.0)  # its key sent it to partition 2, b's
    follower = index.place(chat("b", "c2"), TOPIC, now=1.0)
    assert (follower.reason, follower.worker_id, follower.hit_tokens) == (ROUTE_EXPECTED, "b", 0)
    # b's report confirms it: a plain hit from then on.
    index.apply(report("b", [2, 3], {system_prefix(first): 16}, seq=1), 1.0)
    assert index.place(chat("c", "c3"), TOPIC, now=1.0).reason == ROUTE_PREFIX
    # An expectation no report confirms lapses after a few seconds.
    other = ChatMessage("system", "another shared prompt")
    index.landed(index.place(chat("d", "c4", other), TOPIC, now=1.0), TOPIC, 0, now=1.0)
    assert index.place(chat("e", "c5", other), TOPIC, now=2.0).worker_id == "a"
    assert index.place(chat("e", "c5", other), TOPIC, now=7.0).reason == ROUTE_MISS


def test_an_overloaded_holder_passes_the_request_to_the_least_loaded_worker():
    index = PrefixIndex(stale_after_s=30)
    prefix = system_prefix(chat("x", "c"))
    index.apply(report("a", [0, 1], {prefix: 16}, running=8, waiting=4), 0.0)
    index.apply(report("b", [2, 3], running=1), 0.0)
    index.apply(report("c", [4, 5], running=2), 0.0)
    placed = index.place(chat("x", "c"), TOPIC, now=1.0)
    assert (placed.reason, placed.worker_id, placed.hit_tokens) == (ROUTE_BALANCE, "b", 0)
    # Within 1.5x of the mean (and a few more), the holder keeps it; what this router placed there
    # counts until the next report (b has the one above): a's 2 + 7 placed > 1.5 x (9 + 2 + 2) / 3 + 2.
    index.apply(report("a", [0, 1], {prefix: 16}, seq=1, running=2), 0.0)
    reasons = [index.place(chat(f"x{i}", f"c{i}"), TOPIC, now=1.0).reason for i in range(8)]
    assert reasons == [ROUTE_PREFIX] * 7 + [ROUTE_BALANCE]


def test_turns_this_router_saw_finish_no_longer_count_as_load():
    """One user's short turns in a row, all between two reports: each ends before the next is
    placed, so the holder never looks overloaded; left unfinished, the same turns would be."""
    prefix = system_prefix(chat("x", "c"))
    for finish in (True, False):
        index = PrefixIndex(stale_after_s=30)
        two_workers(index, a_holds={prefix: 16})
        routes = []
        for i in range(10):
            request = chat(f"turn {i}", f"c{i}")
            routes.append(index.place(request, TOPIC, now=1.0).reason)
            if finish:
                index.finished(request.request_id)
        if finish:
            assert routes == [ROUTE_PREFIX] * 10
        else:  # a's 9 placed > 1.5 x (9 + 0) / 2 + 2
            assert routes == [ROUTE_PREFIX] * 9 + [ROUTE_BALANCE]


def test_ownership_follows_the_latest_claim_and_a_leaving_worker_is_forgotten():
    index = PrefixIndex(stale_after_s=30)
    request = chat("hi", "c1")
    two_workers(index, a_holds={system_prefix(request): 16})
    # A rebalance: b now owns everything; a's next report owns nothing.
    index.apply(report("b", [0, 1, 2, 3], seq=1), 1.0)
    assert index.place(request, TOPIC, now=1.0).reason == ROUTE_MISS  # a holds it but owns nothing
    index.apply(report("a", [], {system_prefix(request): 16}, seq=1), 1.0)
    assert index.place(request, TOPIC, now=1.0).reason == ROUTE_MISS
    index.apply(report("a", [0, 1], {system_prefix(request): 16}, seq=2), 2.0)
    assert index.place(request, TOPIC, now=2.0).worker_id == "a"
    index.apply(report("a", [], seq=3, leaving=True), 3.0)
    assert index.workers == ["b"]
    assert index.place(request, TOPIC, now=3.0).reason == ROUTE_MISS


def test_silent_workers_age_out_and_restarts_and_snapshots_replace_what_was_known():
    index = PrefixIndex(stale_after_s=30)
    request = chat("hi", "c1")
    prefix = system_prefix(request)
    two_workers(index, a_holds={prefix: 16})
    assert index.place(request, TOPIC, now=29.0).worker_id == "a"
    index.apply(report("b", [2, 3], seq=1), 31.0)
    assert index.place(request, TOPIC, now=31.0).reason == ROUTE_MISS  # a said nothing for 31 s
    assert index.workers == ["b"]
    # A report from a's earlier run is ignored once its new run is known.
    index.apply(report("a", [0, 1], started=5), 32.0)
    index.apply(report("a", [0, 1], {prefix: 16}, started=1, seq=9), 32.0)
    assert index.place(request, TOPIC, now=32.0).reason == ROUTE_MISS
    # A snapshot is everything a worker holds; a delta removes what was evicted.
    index.apply(report("a", [0, 1], {prefix: 16}, started=5, seq=1), 33.0)
    assert index.place(request, TOPIC, now=33.0).worker_id == "a"
    index.apply(report("a", [0, 1], started=5, seq=2, removed=[prefix]), 34.0)
    assert index.place(request, TOPIC, now=34.0).reason == ROUTE_MISS
    index.apply(report("a", [0, 1], {prefix: 16}, started=5, seq=3), 35.0)
    index.apply(report("a", [0, 1], {}, started=5, seq=4, snapshot=True), 35.0)
    assert index.place(request, TOPIC, now=35.0).reason == ROUTE_MISS


def test_prefix_names_depend_on_every_segment_before_them():
    a, b = chat("same user words", "c1"), chat("same user words", "c2", ChatMessage("system", "another prompt"))
    assert segment_hashes(a)[1] != segment_hashes(b)[1]
    assert segment_hashes(a) == segment_hashes(chat("same user words", "c3"))
    assert len(set(segment_hashes(a))) == 2


def test_a_text_prompt_is_named_apart_from_a_message_saying_the_same():
    """A text completion's prompt reaches the engine without a chat template: its tokens are not a
    chat message's, so no prefix of one names the other."""
    message = ChatRequest(request_id="r-m", model="m", tier="standard", messages=[ChatMessage("user", "Once upon")],
                          reply_topic="t", reply_partition=0)
    text = dataclasses.replace(message, request_id="r-t", text_prompt=True)
    assert len(segment_hashes(text)) == 1
    assert not set(segment_hashes(text)) & set(segment_hashes(message))
    assert segment_hashes(text) == segment_hashes(dataclasses.replace(text, request_id="r-t2"))


def test_a_final_message_left_open_is_named_apart_from_the_same_message_closed():
    """vLLM's ``continue_final_message``: the prompt ends inside the final message, so its tokens are
    not those of the message closed; the segments before it are the same."""
    closed = ChatRequest(request_id="r-c", model="m", tier="standard", reply_topic="t", reply_partition=0,
                         messages=[ChatMessage("user", "Say hi"), ChatMessage("assistant", "Hi, I am")])
    left_open = dataclasses.replace(closed, request_id="r-o", continue_final_message=True, add_generation_prompt=False)
    assert segment_hashes(left_open)[0] == segment_hashes(closed)[0]
    assert segment_hashes(left_open)[1] != segment_hashes(closed)[1]


def test_a_prompt_of_token_ids_is_named_by_its_ids():
    """A text prompt given as token ids is those tokens, whatever its text: named by the ids, apart
    from the same text given as text (another tokenization of it need not be those ids)."""
    text = ChatRequest(request_id="r-t", model="m", tier="standard", messages=[ChatMessage("user", "Once upon")],
                       reply_topic="t", reply_partition=0, text_prompt=True)
    ids = dataclasses.replace(text, request_id="r-i", prompt_token_ids=[7, 8])
    assert segment_hashes(ids) != segment_hashes(text)
    assert segment_hashes(ids) == segment_hashes(dataclasses.replace(ids, messages=[ChatMessage("user", "other")]))
    assert segment_hashes(ids) != segment_hashes(dataclasses.replace(ids, prompt_token_ids=[7, 9]))


def test_a_prompt_the_engine_truncates_names_no_prefix():
    """vLLM's ``truncate_prompt_tokens``: what the engine keeps begins at no segment's start, so no
    prefix of the messages names it (nor is it reported under one)."""
    request = ChatRequest(request_id="r-t", model="m", tier="standard", messages=[ChatMessage("user", "Once upon")],
                          reply_topic="t", reply_partition=0)
    assert segment_hashes(dataclasses.replace(request, truncate_prompt_tokens=4)) == [] != segment_hashes(request)
