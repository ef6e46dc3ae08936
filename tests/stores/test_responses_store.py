"""The stored-response store against the real Redis (one server, and a Redis Cluster): a response
is read back by its tenant only, expires with its TTL, and is gone once deleted; a background
response's reader lease is held by one reader at a time."""

import asyncio

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


async def test_one_reader_at_a_time_holds_a_response_until_it_lets_go_or_its_lease_lapses(each_redis):
    client, prefix = each_redis
    responses = ResponseStore(client, prefix, ttl_s=60)
    response_id = new_response_id()
    assert await responses.claim_reader(response_id, "edge-a", lease_s=0.3)
    assert not await responses.claim_reader(response_id, "edge-b", lease_s=0.3)
    assert await responses.claim_reader(response_id, "edge-a", lease_s=0.3)  # kept by claiming again
    await responses.release_reader(response_id)
    assert await responses.claim_reader(response_id, "edge-b", lease_s=0.3)
    await asyncio.sleep(0.5)  # edge-b stopped: its lease lapses
    assert await responses.claim_reader(response_id, "edge-a", lease_s=0.3)
