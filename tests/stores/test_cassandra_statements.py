"""The Cassandra store's statements, binding, TTL, timestamps and retries, checked through
the driver's own prepared statements (tests/fakes/cassandra_session.py; no server runs here)."""

from __future__ import annotations

import pytest
from cassandra import OperationTimedOut, Unavailable
from cassandra.query import BatchStatement

from tests.fakes.cassandra_session import FakeSession
from tokenbus.schemas import ChatMessage, Completion
from tokenbus.stores.transcripts.cassandra import CassandraTranscriptStore, schema_statements
from tokenbus.stores.transcripts.model import turn_of

KS = "ks"


def make(ttl_s: int = 0, attempts: int = 5) -> tuple[CassandraTranscriptStore, FakeSession]:
    session = FakeSession(schema_statements(KS))
    return CassandraTranscriptStore(session, KS, ttl_s, attempts=attempts, base_delay_s=0), session


def a_turn(request_id: str = "r1", at_ms: int = 1000):
    return turn_of(Completion(request_id, "m", "standard", "hello", "stop", 1, 1, at_ms, at_ms, at_ms, tenant="t",
                              conversation_id="c", messages=[ChatMessage("user", "hi")]))


def test_ddl_keys_messages_by_tenant_and_conversation():
    statements = schema_statements("prod")
    assert statements[0].startswith("CREATE KEYSPACE IF NOT EXISTS prod")
    messages = next(s for s in statements if "messages_by_conversation" in s)
    assert "PRIMARY KEY ((tenant, conversation_id), turn_at_ms, request_id, position)" in messages
    session = FakeSession(statements)
    assert session.tables["prod.messages_by_conversation"].partition_key == ["tenant", "conversation_id"]


def test_statements_are_prepared_once_and_idempotent():
    store, session = make()
    assert len(session.plans) == 6
    for prepared in (store.insert_message, store.upsert_conversation, store.select_conversations,
                     store.select_conversation, store.select_messages, store.write_summary_statement):
        assert prepared.is_idempotent
    assert store.insert_message.routing_key_indexes == [0, 1]  # token-aware routing on (tenant, conversation_id)


def test_binding_checks_arity_and_types_like_the_driver():
    store, _ = make()
    with pytest.raises(ValueError):
        store.select_messages.bind(("t", "c", 1, "r", 0, 10, "extra"))  # more values than markers
    with pytest.raises(TypeError):
        store.select_conversations.bind(("t", "", "ten"))  # LIMIT must be an int


async def test_a_turn_is_one_unlogged_batch_then_a_timestamped_upsert():
    store, session = make(ttl_s=3600)
    await store.write_turn(a_turn(at_ms=1234))
    batch, upsert = session.executed
    assert isinstance(batch, BatchStatement) and len(batch._statements_and_parameters) == 2
    messages = session.tables[f"{KS}.messages_by_conversation"]
    assert set(messages.ttls.values()) == {3600}
    conversations = session.tables[f"{KS}.conversations_by_tenant"]
    assert set(conversations.write_times.values()) == {1234 * 1000}  # USING TIMESTAMP: the turn's time


async def test_an_older_turn_written_late_does_not_become_the_latest():
    store, _ = make()
    await store.write_turn(a_turn("new", 2000))
    await store.write_turn(a_turn("old", 1000))
    (conversation,) = (await store.list_conversations("t")).items
    assert conversation.last_request_id == "new"


async def test_transient_errors_are_retried():
    store, session = make()
    session.fail_next(OperationTimedOut("slow"), Unavailable("one replica down"))
    await store.write_turn(a_turn())
    assert len(session.executed) == 4  # two failed attempts, then the batch and the upsert
    assert len((await store.list_messages("t", "c")).items) == 2


async def test_retries_give_up_after_the_last_attempt():
    store, session = make(attempts=2)
    session.fail_next(OperationTimedOut("1"), OperationTimedOut("2"))
    with pytest.raises(OperationTimedOut):
        await store.write_turn(a_turn())


async def test_other_errors_are_not_retried():
    store, session = make()
    session.fail_next(RuntimeError("syntax error"))
    with pytest.raises(RuntimeError):
        await store.list_conversations("t")
    assert len(session.executed) == 1
