"""What the edge keeps of a Responses API turn, against the real Redis: stored as it starts (its
input pending), ended by whoever reads its stream to the end (rebuilt from the stored start alone),
the chain kept to its newest turns, and an answer's calls carried into the next turn's prompt."""

import json

from tokenbus.schemas import ChatMessage, ToolCall
from tokenbus.sse_edge.plumbing.history import StoredTurn
from tokenbus.sse_edge.plumbing.kept_responses import KeptResponse, chain_of, conversation_of, listed_items
from tokenbus.sse_edge.protocol.response_objects import function_call_item, message_item
from tokenbus.sse_edge.protocol.responses import FunctionCallOutputItem, MessageItem
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

    reader = KeptResponse.of_stored(store, started, chain_turns=3)  # another edge, from the store alone
    assert reader is not None and reader.pending == kept.pending and reader.earlier == earlier
    assert reader.conversation == "resp_first" == conversation_of(started)
    output = [message_item("msg_1", "Let me look.", "completed"),
              function_call_item("fc_1", "call_1", "weather", '{"city": "Oslo"}', "completed")]
    await reader.ended({"id": response_id, "status": "completed", "output": output})
    ended = await store.get("acme", response_id)
    chain = chain_of(ended)
    assert KeptResponse.of_stored(store, ended, chain_turns=3) is None  # ended: nothing to finish
    assert [t.request_id for t in chain] == ["resp_1", "resp_2", response_id]  # the newest 3
    assert chain[-1].messages == (ChatMessage("user", "weather?"),
                                  ChatMessage("assistant", "Let me look.",
                                              (ToolCall("call_1", "weather", '{"city": "Oslo"}'),)))
    assert json.loads(ended.body)["status"] == "completed" and conversation_of(ended) == "resp_first"
