"""One contract for every transcript store: SQLite (the embedded default), Cassandra through
the driver against an in-memory session (no server can run here; see
tests/fakes/cassandra_session.py), and Cassandra against a real cluster when
TOKENBUS_CASSANDRA_CONTACT_POINTS is set."""

from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

from tests.fakes.cassandra_session import FakeSession
from tokenbus.schemas import ChatMessage, Completion
from tokenbus.stores.transcripts import TranscriptSettings
from tokenbus.stores.transcripts.cassandra import CassandraTranscriptStore, schema_statements
from tokenbus.stores.transcripts.model import BadCursor, Summary, turn_of
from tokenbus.stores.transcripts.sqlite import SqliteTranscriptStore

KEYSPACE = "tokenbus_test"
REAL_CASSANDRA = os.environ.get("TOKENBUS_CASSANDRA_CONTACT_POINTS")


@pytest.fixture(params=["sqlite", "cassandra-driver", "cassandra-server"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        store = SqliteTranscriptStore(tmp_path / "t.sqlite3")
    elif request.param == "cassandra-driver":
        store = CassandraTranscriptStore(FakeSession(schema_statements(KEYSPACE)), KEYSPACE, base_delay_s=0)
    else:
        if not REAL_CASSANDRA:
            pytest.skip("set TOKENBUS_CASSANDRA_CONTACT_POINTS to run against a Cassandra cluster")
        store = CassandraTranscriptStore.connect(TranscriptSettings(
            backend="cassandra", cassandra_contact_points=REAL_CASSANDRA.split(","), cassandra_keyspace=KEYSPACE))
    yield store
    await store.close()


def completion(request_id: str, tenant: str, at_ms: int, messages: list[tuple[str, str]], text: str,
               conversation_id: str | None = None) -> Completion:
    return Completion(request_id, "m", "standard", text, "stop", 3, 5, at_ms, at_ms, at_ms + 5, tenant=tenant,
                      conversation_id=conversation_id, messages=[ChatMessage(r, c) for r, c in messages])


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def test_a_conversation_reads_back_in_order_and_only_new_prompt_messages_are_stored(store):
    tenant, conv = unique("acme"), unique("conv")
    first = completion("r1", tenant, 1000, [("system", "be brief"), ("user", "hi")], "hello", conv)
    second = completion("r2", tenant, 2000, [("system", "be brief"), ("user", "hi"), ("assistant", "hello"),
                                             ("user", "bye")], "goodbye", conv)
    for c in (second, first):  # order of arrival does not matter
        await store.write_turn(turn_of(c))
    page = await store.list_messages(tenant, conv)
    assert [(m.role, m.content) for m in page.items] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "bye"), ("assistant", "goodbye")]
    assert [m.finish_reason for m in page.items] == ["", "", "stop", "", "stop"]
    conversations = (await store.list_conversations(tenant)).items
    assert [(c.conversation_id, c.last_request_id, c.last_turn_at_ms) for c in conversations] == [(conv, "r2", 2000)]
    assert await store.get_conversation(tenant, conv) == conversations[0]
    assert await store.get_conversation(unique("other"), conv) is None  # another tenant's reads as missing


async def test_writing_a_turn_again_changes_nothing(store):
    tenant, conv = unique("acme"), unique("conv")
    turn = turn_of(completion("r1", tenant, 1000, [("user", "hi")], "hello", conv))
    await store.write_turn(turn)
    before = await store.list_messages(tenant, conv)
    await store.write_turn(turn)
    await store.write_turn(turn)
    after = await store.list_messages(tenant, conv)
    assert [dataclasses.replace(m, written_at_ms=0) for m in after.items] == \
        [dataclasses.replace(m, written_at_ms=0) for m in before.items]  # only the write time moves
    assert len(before.items) == 2 and all(m.written_at_ms >= b.written_at_ms > 0 for m, b in zip(after.items, before.items))


@pytest.mark.parametrize("order", ["in order", "reversed"])
async def test_a_continued_turn_stands_over_its_incomplete_version_whatever_the_order(store, order):
    tenant, conv = unique("acme"), unique("conv")
    broken = completion("r1", tenant, 1000, [("user", "tell me")], "once upon", conv)
    broken.finish_reason, broken.finished_at_ms = "incomplete", 2000
    continued = completion("r2", tenant, 5000, [("user", "tell me")], "once upon a time", conv)
    continued.continues_request_id, continued.continues_turn_at_ms, continued.finished_at_ms = "r1", 1000, 6000
    versions = [broken, continued] if order == "in order" else [continued, broken]
    for version in versions:  # a takeover may publish the incomplete version again, late
        await store.write_turn(turn_of(version))
    rows = (await store.list_messages(tenant, conv)).items
    assert [(m.request_id, m.role, m.content, m.status) for m in rows] == [
        ("r1", "user", "tell me", "completed"), ("r1", "assistant", "once upon a time", "completed")]


async def test_the_summary_of_the_latest_turns_stands_whatever_the_order(store):
    tenant, conv = unique("acme"), unique("conv")
    await store.write_turn(turn_of(completion("r1", tenant, 1000, [("user", "hi")], "hello", conv)))
    assert (await store.get_conversation(tenant, conv)).summary is None
    newer, older = Summary("they said hi twice", 3000, "r3"), Summary("they said hi", 1000, "r1")
    for summary in (newer, older):
        await store.write_summary(tenant, conv, summary)
    await store.write_turn(turn_of(completion("r4", tenant, 4000, [("user", "more")], "ok", conv)))
    conversation = await store.get_conversation(tenant, conv)
    assert conversation.summary == newer and conversation.last_request_id == "r4"
    await store.write_summary(unique("other"), conv, older)  # another tenant's write reaches nothing of this one
    assert (await store.get_conversation(tenant, conv)).summary == newer


async def test_pages_cover_everything_once(store):
    tenant = unique("acme")
    for i in range(7):
        await store.write_turn(turn_of(completion(f"r{i}", tenant, 1000 + i, [("user", f"q{i}")], f"a{i}")))
    seen, cursor = [], None
    while True:
        page = await store.list_conversations(tenant, limit=3, after=cursor)
        seen += [c.conversation_id for c in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert seen == sorted(f"r{i}" for i in range(7))
    conv = "r3"
    messages = await store.list_messages(tenant, conv, limit=1)
    rest = await store.list_messages(tenant, conv, limit=1, after=messages.next_cursor)
    assert [m.content for m in messages.items + rest.items] == ["q3", "a3"]
    assert rest.next_cursor is None


async def test_tenants_never_see_each_other(store):
    a, b, conv = unique("a"), unique("b"), unique("shared-name")
    await store.write_turn(turn_of(completion("r1", a, 1000, [("user", "a's secret")], "ok", conv)))
    assert (await store.list_messages(b, conv)).items == []
    assert (await store.list_conversations(b)).items == []
    assert len((await store.list_messages(a, conv)).items) == 2


async def test_a_forged_cursor_is_refused(store):
    with pytest.raises(BadCursor):
        await store.list_conversations("t", after="not-a-cursor!")
    with pytest.raises(BadCursor):
        await store.list_messages("t", "c", after="WyJvbmx5LW9uZSJd")  # a conversations cursor
