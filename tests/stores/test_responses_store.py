"""The stored-response store against the real Redis (one server, and a Redis Cluster): a response
is read back by its tenant only, expires with its TTL, and is gone once deleted."""

from tokenbus.stores.responses import RESPONSE_ID, ResponseStore, StoredResponse, new_response_id


async def test_a_response_is_its_tenants_alone_until_deleted(each_redis):
    client, prefix = each_redis
    responses = ResponseStore(client, prefix, ttl_s=60)
    made = StoredResponse(new_response_id(), "acme", '{"id": 1}', '[{"id": "msg_1"}]', '{"turns": []}')
    assert RESPONSE_ID.fullmatch(made.id)
    await responses.put(made)
    assert await responses.get("acme", made.id) == made
    assert await responses.get("globex", made.id) is None
    assert not await responses.delete("globex", made.id)
    assert await responses.get("acme", made.id) == made  # another tenant's delete changed nothing
    assert 0 < await client.ttl(f"{prefix}response:{made.id}") <= 60
    assert await responses.delete("acme", made.id)
    assert await responses.get("acme", made.id) is None
    assert not await responses.delete("acme", made.id)


async def test_ids_that_are_not_response_ids_are_not_looked_up(each_redis):
    client, prefix = each_redis
    responses = ResponseStore(client, prefix, ttl_s=60)
    await client.hset(f"{prefix}response:resp_x", mapping={"tenant": "acme", "body": "{}", "input_items": "[]",
                                                             "context": "{}"})
    assert await responses.get("acme", "resp_x") is None
