"""The stored-chat-completion store against the real Redis (one server, and a Redis Cluster): a
completion is its tenant's alone, keeps its TTL, has its metadata replaced and is gone once deleted;
a tenant's listing goes in creation order either way, filtered by model and metadata across more
than one read of ids, and drops what expired."""

import uuid

import pytest

from tokenbus.stores.chat_completions import READ_AHEAD, CompletionStore, StoredCompletion


def completion(tenant: str, created_at_ms: int, model: str = "m", **metadata: str) -> StoredCompletion:
    return StoredCompletion(f"chatcmpl-{uuid.uuid4().hex}", tenant, model, created_at_ms, metadata,
                            f'{{"created": {created_at_ms}}}', "[]")


async def test_a_completion_is_its_tenants_alone_until_deleted(each_redis):
    client, prefix = each_redis
    store = CompletionStore(client, prefix, ttl_s=60)
    made = completion("acme", 1_000, topic="a")
    await store.put(made)
    assert await store.get("acme", made.id) == made
    assert await store.get("globex", made.id) is None and await store.get("acme", "chatcmpl-x") is None
    assert await store.set_metadata("globex", made.id, {"topic": "b"}) is None
    assert not await store.delete("globex", made.id)
    assert 0 < await client.ttl(f"{prefix}chatcmpl:{made.id}") <= 60
    updated = await store.set_metadata("acme", made.id, {"topic": "b"})
    assert updated is not None and updated.metadata == {"topic": "b"} == (await store.get("acme", made.id)).metadata
    assert await store.delete("acme", made.id)
    assert await store.get("acme", made.id) is None
    assert await store.page("acme", 10) == ([], False)


async def test_a_listing_pages_in_order_filters_past_one_read_and_drops_what_expired(each_redis):
    client, prefix = each_redis
    store = CompletionStore(client, prefix, ttl_s=60)
    made = [completion("acme", 1_000 + i, model="m" if i % 3 else "other", kind="even" if i % 2 == 0 else "odd")
            for i in range(READ_AHEAD + 30)]
    for stored in made:
        await store.put(stored)
    await store.put(completion("globex", 500))

    page, more = await store.page("acme", 5)
    assert [s.id for s in page] == [s.id for s in made[:5]] and more
    page, more = await store.page("acme", 5, after=made[4].id)
    assert [s.id for s in page] == [s.id for s in made[5:10]] and more
    page, more = await store.page("acme", 3, newest_first=True)
    assert [s.id for s in page] == [s.id for s in made[::-1][:3]] and more

    wanted = [s.id for s in made if s.model == "other" and s.metadata["kind"] == "even"]
    assert len(wanted) > 20  # (spread over both reads of ids)
    page, more = await store.page("acme", 100, model="other", metadata={"kind": "even"})
    assert [s.id for s in page] == wanted and not more
    page, more = await store.page("acme", 20, model="other", metadata={"kind": "even"})
    assert [s.id for s in page] == wanted[:20] and more

    await client.delete(f"{prefix}chatcmpl:{made[1].id}", f"{prefix}chatcmpl:{made[2].id}")  # as if expired
    page, _ = await store.page("acme", 4)
    assert [s.id for s in page] == [made[0].id, made[3].id, made[4].id, made[5].id]
    assert await client.zcard(f"{prefix}chatcmpls:acme") == len(made) - 2  # dropped from the listing
    with pytest.raises(KeyError):
        await store.page("acme", 4, after=made[1].id)
