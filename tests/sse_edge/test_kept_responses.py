"""What the edge keeps of a Responses API turn, against the real Redis: stored as it starts (its
input pending), ended by whoever reads its stream to the end (rebuilt from the stored start alone),
the chain kept to its newest turns, and an answer's calls carried into the next turn's prompt."""

import json

from tokenbus.schemas import ChatMessage, ToolCall
from tokenbus.sse_edge.plumbing.history import StoredTurn
from tokenbus.sse_edge.plumbing.kept_responses import (
    GROUP_KEPT_CHARS,
    KeptResponse,
    _kept_group,
    chain_of,
    conversation_of,
    conversation_turns,
    listed_items,
)
from tokenbus.sse_edge.protocol.response_objects import function_call_item, message_item
from tokenbus.sse_edge.protocol.responses import FunctionCallOutputItem, MessageItem
from tokenbus.stores.conversations import ConversationStore, StoredConversation, group_field, new_conversation_id
from tokenbus.stores.responses import ResponseStore, new_response_id


async def test_a_response_started_is_ended_by_any_reader_from_what_was_stored(each_redis):
    client, prefix = each_redis
    store = ResponseStore(client, prefix, ttl_s=60)
    earlier = [StoredTurn(f"resp_{i}", i, (ChatMessage("user", f"q{i}"), ChatMessage("assistant", f"a{i}")))
               for i in range(3)]
    response_id = new_response_id()
    items = [MessageItem(role="user", content="weather?"),
             FunctionCallOutputItem(type="function_call_output", call_id="call_0", output="rain")]
    kept = KeptResponse(store, "acme", listed_items(items), False, earlier,
                        StoredTurn(response_id, 99, (ChatMessage("user", "weather?"),)), chain_turns=3,
                        conversation="resp_first")
    await kept.started({"id": response_id, "status": "in_progress", "output": []})
    started = await store.get("acme", response_id)
    assert chain_of(started) is None  # under way: nothing continues it yet
    assert [i["type"] for i in json.loads(started.input_items)] == ["message", "function_call_output"]

    reader = KeptResponse.of_stored(store, started, 3, ConversationStore(client, prefix))  # another edge, from the store alone
    assert reader is not None and reader.pending == kept.pending and reader.earlier == earlier
    assert reader.conversation == "resp_first" == conversation_of(started)
    output = [message_item("msg_1", "Let me look.", "completed"),
              function_call_item("fc_1", "call_1", "weather", '{"city": "Oslo"}', "completed")]
    await reader.ended({"id": response_id, "status": "completed", "output": output})
    ended = await store.get("acme", response_id)
    chain = chain_of(ended)
    assert KeptResponse.of_stored(store, ended, 3, ConversationStore(client, prefix)) is None  # ended: nothing to finish
    assert [t.request_id for t in chain] == ["resp_1", "resp_2", response_id]  # the newest 3
    assert chain[-1].messages == (ChatMessage("user", "weather?"),
                                  ChatMessage("assistant", "Let me look.",
                                              (ToolCall("call_1", "weather", '{"city": "Oslo"}'),)))
    assert json.loads(ended.body)["status"] == "completed" and conversation_of(ended) == "resp_first"


async def test_a_turn_in_a_conversation_adds_its_items_once_whoever_reads_it_to_the_end(each_redis):
    """A turn in a conversation object: prompted with its items as turns (calls joined to the
    assistant's message), and once it ends, its input and output added as one group, under its own
    start and id, however many readers store its end; a failed turn adds nothing."""
    client, prefix = each_redis
    store, conversations = ResponseStore(client, prefix, ttl_s=60), ConversationStore(client, prefix, ttl_s=60)
    conversation_id = new_conversation_id()
    made = [message_item("msg_a", "Checking.", "completed"),
            function_call_item("fc_a", "call_a", "weather", "{}", "completed"),
            {"id": "fco_a", "type": "function_call_output", "call_id": "call_a", "output": "rain",
             "status": "completed"}]
    await conversations.create(StoredConversation(conversation_id, "acme", 1, "{}", [
        (group_field(1_000, "first"), listed_items([MessageItem(role="user", content="weather?")])),
        (group_field(2_000, "second"), json.dumps(made))]))
    [asked, answered] = conversation_turns(await conversations.get("acme", conversation_id))
    assert (asked.request_id, asked.turn_at_ms, asked.messages) == ("first", 1_000, (ChatMessage("user", "weather?"),))
    assert answered.messages == (ChatMessage("assistant", "Checking.", (ToolCall("call_a", "weather", "{}"),)),
                                 ChatMessage("tool", "rain", (), "call_a"))

    response_id = new_response_id()
    kept = KeptResponse(store, "acme", listed_items([MessageItem(role="user", content="and tomorrow?")]), False,
                        [asked, answered], StoredTurn(response_id, 3_000, (ChatMessage("user", "and tomorrow?"),)),
                        chain_turns=8, conversation=conversation_id, adds_to=conversations)
    await kept.started({"id": response_id, "status": "in_progress", "output": []})
    taken_over = KeptResponse.of_stored(store, await store.get("acme", response_id), 8, conversations)
    assert taken_over.adds_to is conversations  # (an edge reading it on from the store alone adds it too)
    response = {"id": response_id, "status": "completed", "output": [message_item("msg_b", "Sun.", "completed")]}
    await kept.ended(response)
    again = KeptResponse.of_stored(store, await store.get("acme", response_id), 8, conversations)
    assert again is None  # ended: a reader after it has nothing to finish
    second_reader = KeptResponse(store, "acme", kept.items, False, kept.earlier, kept.pending, 8, conversation_id,
                                 conversations)
    await second_reader.ended(response)  # (one that raced the first to the end)
    stored = await conversations.get("acme", conversation_id)
    assert [StoredConversation.group_id(f) for f, _ in stored.groups] == ["first", "second", response_id]
    added = json.loads(stored.groups[-1][1])
    assert [(i["type"], i.get("role")) for i in added] == [("message", "user"), ("message", "assistant")]
    assert added[1]["id"] == "msg_b" and added[0]["content"][0]["text"] == "and tomorrow?"

    failed_id = new_response_id()
    failed = KeptResponse(store, "acme", "[]", False, [], StoredTurn(failed_id, 4_000, ()), 8, conversation_id,
                          conversations)
    await failed.ended({"id": failed_id, "status": "failed", "output": []})
    assert len((await conversations.get("acme", conversation_id)).groups) == 3


def test_a_conversations_groups_are_read_once_each_and_the_same_every_time():
    """Every turn in a conversation reads all its groups: each is checked and read as messages
    once a process (kept by its text), but for a large one, read each time."""
    small = json.dumps([{"id": "msg_a", "type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": f"hello {new_conversation_id()}"}]}])
    large = json.dumps([{"id": "msg_b", "type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "x" * (GROUP_KEPT_CHARS + 1)}]}])
    stored = StoredConversation(new_conversation_id(), "acme", 1, "{}",
                                [(group_field(1_000, "items_a"), small), (group_field(2_000, "items_b"), large)])
    before = _kept_group.cache_info()
    first, again = conversation_turns(stored), conversation_turns(stored)
    after = _kept_group.cache_info()
    assert first == again and [m.content for t in first for m in t.messages] == [
        json.loads(small)[0]["content"][0]["text"], "x" * (GROUP_KEPT_CHARS + 1)]
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)  # the small one, kept; the large, not
