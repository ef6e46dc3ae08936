"""The conversation store against the real Redis (one server, and a Redis Cluster): a conversation
is read back by its tenant only, its groups of items in the order they were added; a group written
again is one group; a group added to a deleted conversation does not bring it back; every write
renews its TTL; and one turn at a time holds a conversation."""

from tokenbus.stores.conversations import (
    CONVERSATION_ID,
    ConversationStore,
    StoredConversation,
    TurnHolder,
    group_field,
    new_conversation_id,
)


async def test_a_conversation_is_its_tenants_with_its_groups_in_the_order_added(each_redis):
    client, prefix = each_redis
    conversations = ConversationStore(client, prefix, ttl_s=60)
    made = StoredConversation(new_conversation_id(), "acme", 1_700_000_000, '{"k": "v"}',
                              [(group_field(1_700_000_000_000, "first"), '[{"id": "msg_1"}]')])
    assert CONVERSATION_ID.fullmatch(made.id)
    await conversations.create(made)
    assert await conversations.get("acme", made.id) == made
    assert await conversations.get("globex", made.id) is None
    assert not await conversations.delete("globex", made.id)

    await client.expire(f"{prefix}conversation:{made.id}", 5)
    later, earlier = group_field(1_700_000_000_900, "turn-b"), group_field(1_700_000_000_500, "turn-a")
    assert await conversations.put_group(made.id, later, '[{"id": "msg_3"}]')
    assert await conversations.put_group(made.id, earlier, '[{"id": "msg_2"}]')
    assert await conversations.put_group(made.id, later, '[{"id": "msg_3"}]')  # written again: the same group
    assert 5 < await client.ttl(f"{prefix}conversation:{made.id}") <= 60  # renewed by the write
    stored = await conversations.get("acme", made.id)
    assert [(StoredConversation.group_id(f), items) for f, items in stored.groups] == [
        ("first", '[{"id": "msg_1"}]'), ("turn-a", '[{"id": "msg_2"}]'), ("turn-b", '[{"id": "msg_3"}]')]

    await conversations.set_metadata(made.id, "{}")
    await conversations.put_group(made.id, earlier, "[]")  # its items deleted
    stored = await conversations.get("acme", made.id)
    assert stored.metadata == "{}" and [items for _, items in stored.groups] == ['[{"id": "msg_1"}]', "[]",
                                                                                 '[{"id": "msg_3"}]']
    assert await conversations.delete("acme", made.id)
    assert not await conversations.put_group(made.id, later, "[]")  # a turn ending after the delete adds nothing
    assert await conversations.get("acme", made.id) is None
    assert await client.exists(f"{prefix}conversation:{made.id}") == 0


async def test_ids_that_are_not_conversation_ids_are_not_looked_up(each_redis):
    client, prefix = each_redis
    await client.hset(f"{prefix}conversation:conv_x", mapping={"tenant": "acme", "created_at": "1", "metadata": "{}"})
    assert await ConversationStore(client, prefix).get("acme", "conv_x") is None


async def test_one_turn_holds_a_conversation_until_it_ends_or_is_replaced_as_stale(each_redis):
    client, prefix = each_redis
    conversations = ConversationStore(client, prefix, ttl_s=60)
    made = StoredConversation(new_conversation_id(), "acme", 1_700_000_000, "{}", [])
    await conversations.create(made)
    assert await conversations.hold_turn("acme", made.id, "resp_a", 1_000) == TurnHolder("resp_a", 1_000)
    assert await conversations.hold_turn("acme", made.id, "resp_b", 2_000) == TurnHolder("resp_a", 1_000)
    assert await conversations.hold_turn("globex", made.id, "resp_x", 2_000) is None  # nor is it told who holds it
    assert await conversations.hold_turn("acme", "conv_x", "resp_b", 2_000) is None
    assert await conversations.hold_turn("acme", new_conversation_id(), "resp_b", 2_000) is None  # none made

    field = group_field(1_700_000_000_100, "resp_a")
    assert await conversations.end_turn(made.id, "resp_b", (field, '[{"id": "msg_1"}]'))  # resp_b holds nothing
    assert await conversations.hold_turn("acme", made.id, "resp_b", 3_000) == TurnHolder("resp_a", 1_000)
    assert await conversations.end_turn(made.id, "resp_a", (field, '[{"id": "msg_1"}]'))
    assert await conversations.hold_turn("acme", made.id, "resp_b", 3_000) == TurnHolder("resp_b", 3_000)
    stored = await conversations.get("acme", made.id)
    assert stored.groups == [(field, '[{"id": "msg_1"}]')]  # the hold is no item
    # An item deleted (the group written without it), then a second reader of the turn: still deleted.
    assert await conversations.put_group(made.id, field, "[]")
    assert await conversations.end_turn(made.id, "resp_a", (field, '[{"id": "msg_1"}]'))
    assert (await conversations.get("acme", made.id)).groups == [(field, "[]")]

    # A stale holder is replaced only by a caller that names it: two callers, one wins.
    assert await conversations.hold_turn("acme", made.id, "resp_c", 4_000, replacing="resp_a") == TurnHolder(
        "resp_b", 3_000)
    assert await conversations.hold_turn("acme", made.id, "resp_c", 4_000, replacing="resp_b") == TurnHolder(
        "resp_c", 4_000)
    assert await conversations.hold_turn("acme", made.id, "resp_d", 4_000, replacing="resp_b") == TurnHolder(
        "resp_c", 4_000)
    assert await conversations.end_turn(made.id, "resp_c", None)  # (it added nothing: failed, say)
    assert await conversations.hold_turn("acme", made.id, "resp_d", 5_000) == TurnHolder("resp_d", 5_000)
    assert await conversations.delete("acme", made.id)
    assert not await conversations.end_turn(made.id, "resp_d", (field, "[]"))
    assert await client.exists(f"{prefix}conversation:{made.id}") == 0
