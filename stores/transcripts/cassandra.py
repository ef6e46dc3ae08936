"""Transcripts on Cassandra (or ScyllaDB) through cassandra-driver.

Prepared statements only, executed asynchronously (the driver's ``ResponseFuture``
bridged to asyncio), every statement idempotent so a timed-out write is simply retried.
The tables are ``stores/transcripts/schema.cql``; pages use the clustering key as a cursor,
so a page token can only continue inside the partition the caller's tenant names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tokenbus.schemas import now_ms
from tokenbus.stores.ddl import ddl_statements
from tokenbus.stores.transcripts.base import TranscriptSettings
from tokenbus.stores.transcripts.model import (
    Conversation,
    Page,
    Summary,
    TranscriptMessage,
    Turn,
    decode_cursor,
    page_size,
)

log = logging.getLogger(__name__)

INSERT_MESSAGE = (
    "INSERT INTO {ks}.messages_by_conversation (tenant, conversation_id, turn_at_ms, request_id, position, role, "
    "content, model, finish_reason, tool_calls, tool_call_id, written_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "USING TIMESTAMP ? AND TTL ?"
)
UPSERT_CONVERSATION = (
    "INSERT INTO {ks}.conversations_by_tenant (tenant, conversation_id, model, last_turn_at_ms, last_request_id) "
    "VALUES (?, ?, ?, ?, ?) USING TIMESTAMP ? AND TTL ?"
)
SELECT_CONVERSATIONS = (
    "SELECT conversation_id, model, last_turn_at_ms, last_request_id FROM {ks}.conversations_by_tenant "
    "WHERE tenant = ? AND conversation_id > ? LIMIT ?"
)
SELECT_CONVERSATION = (
    "SELECT conversation_id, model, last_turn_at_ms, last_request_id, summary, summary_through_ms, "
    "summary_through_request_id FROM {ks}.conversations_by_tenant WHERE tenant = ? AND conversation_id = ? LIMIT ?"
)
# Cells written at the summary's own time: the summary of the latest turns stands, whatever the order.
WRITE_SUMMARY = (
    "INSERT INTO {ks}.conversations_by_tenant (tenant, conversation_id, summary, summary_through_ms, "
    "summary_through_request_id) VALUES (?, ?, ?, ?, ?) USING TIMESTAMP ? AND TTL ?"
)
SELECT_MESSAGES = (
    "SELECT turn_at_ms, request_id, position, role, content, model, finish_reason, tool_calls, tool_call_id, "
    "written_at_ms FROM {ks}.messages_by_conversation "
    "WHERE tenant = ? AND conversation_id = ? AND (turn_at_ms, request_id, position) > (?, ?, ?) LIMIT ?"
)
RETRY_ATTEMPTS = 5
RETRY_BASE_DELAY_S = 0.05


def schema_statements(keyspace: str) -> list[str]:
    """The DDL of ``stores/transcripts/schema.cql`` for ``keyspace``, one statement each."""
    return [s.replace("{keyspace}", keyspace) for s in ddl_statements("tokenbus.stores.transcripts", "schema.cql")]


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors a retry can cure: timeouts and too few replicas (all statements are idempotent)."""
    from cassandra import OperationTimedOut, ReadTimeout, Unavailable, WriteTimeout
    from cassandra.cluster import NoHostAvailable

    return OperationTimedOut, ReadTimeout, WriteTimeout, Unavailable, NoHostAvailable


def wait_for(response_future: Any) -> asyncio.Future[Any]:
    """The driver calls back on its own threads; hand the result to this loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not done.done():
            setter(value)

    response_future.add_callbacks(
        lambda rows: loop.call_soon_threadsafe(settle, done.set_result, rows),
        lambda exc: loop.call_soon_threadsafe(settle, done.set_exception, exc),
    )
    return done


class CassandraTranscriptStore:
    def __init__(self, session: Any, keyspace: str, ttl_s: int = 0, *, attempts: int = RETRY_ATTEMPTS,
                 base_delay_s: float = RETRY_BASE_DELAY_S, cluster: Any = None) -> None:
        from cassandra.query import BatchStatement, BatchType

        self._session = session
        self._cluster = cluster
        self._ttl_s = max(0, ttl_s)  # a TTL of 0 means none
        self._attempts = attempts
        self._base_delay_s = base_delay_s
        self._transient = transient_errors()
        self._new_batch: Callable[[], Any] = lambda: BatchStatement(batch_type=BatchType.UNLOGGED)
        self.insert_message = self._prepare(INSERT_MESSAGE, keyspace)
        self.upsert_conversation = self._prepare(UPSERT_CONVERSATION, keyspace)
        self.select_conversations = self._prepare(SELECT_CONVERSATIONS, keyspace)
        self.select_conversation = self._prepare(SELECT_CONVERSATION, keyspace)
        self.write_summary_statement = self._prepare(WRITE_SUMMARY, keyspace)
        self.select_messages = self._prepare(SELECT_MESSAGES, keyspace)

    @classmethod
    def connect(cls, settings: TranscriptSettings, create_schema: bool = True) -> CassandraTranscriptStore:
        from cassandra.cluster import Cluster

        cluster = Cluster(settings.cassandra_contact_points or ["127.0.0.1"], port=settings.cassandra_port)
        session = cluster.connect()
        if create_schema:
            for statement in schema_statements(settings.cassandra_keyspace):
                session.execute(statement)
        return cls(session, settings.cassandra_keyspace, settings.ttl_s, cluster=cluster)

    def _prepare(self, template: str, keyspace: str) -> Any:
        prepared = self._session.prepare(template.format(ks=keyspace))
        prepared.is_idempotent = True
        return prepared

    async def _execute(self, statement: Any) -> list[Any]:
        for attempt in range(self._attempts):
            try:
                return list(await wait_for(self._session.execute_async(statement)) or [])
            except self._transient as exc:
                if attempt == self._attempts - 1:
                    raise
                delay = self._base_delay_s * 2**attempt
                log.warning("cassandra %s; retrying in %.2fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def write_turn(self, turn: Turn) -> None:
        # A turn's messages share one partition: an unlogged batch is a single write there.
        batch = self._new_batch()
        batch.is_idempotent = True
        written = now_ms()
        for m in turn.messages:
            batch.add(self.insert_message, (m.tenant, m.conversation_id, m.turn_at_ms, m.request_id, m.position,
                                            m.role, m.content, m.model, m.finish_reason, m.tool_calls,
                                            m.tool_call_id, written, turn.version_ms * 1000, self._ttl_s))
        await self._execute(batch)
        await self._execute(self.upsert_conversation.bind((
            turn.tenant, turn.conversation_id, turn.model, turn.turn_at_ms, turn.request_id,
            turn.turn_at_ms * 1000, self._ttl_s)))

    async def list_conversations(self, tenant: str, limit: int = 50, after: str | None = None) -> Page[Conversation]:
        limit = page_size(limit)
        start = decode_cursor(after, 1)[0] if after else ""
        rows = await self._execute(self.select_conversations.bind((tenant, start, limit + 1)))
        items = [Conversation(tenant, r[0], r[1], r[2], r[3]) for r in rows[:limit]]
        return Page(items, items[-1].cursor if len(rows) > limit else None)

    async def get_conversation(self, tenant: str, conversation_id: str) -> Conversation | None:
        rows = await self._execute(self.select_conversation.bind((tenant, conversation_id, 1)))
        if not rows:
            return None
        r = rows[0]
        summary = Summary(r[4], r[5] or 0, r[6] or "") if r[4] else None
        return Conversation(tenant, r[0], r[1], r[2], r[3], summary)

    async def write_summary(self, tenant: str, conversation_id: str, summary: Summary) -> None:
        await self._execute(self.write_summary_statement.bind((
            tenant, conversation_id, summary.content, summary.through_turn_at_ms, summary.through_request_id,
            summary.through_turn_at_ms * 1000, self._ttl_s)))

    async def list_messages(self, tenant: str, conversation_id: str, limit: int = 100,
                            after: str | None = None) -> Page[TranscriptMessage]:
        limit = page_size(limit)
        turn_at, request_id, position = decode_cursor(after, 3) if after else (-1, "", -1)
        rows = await self._execute(self.select_messages.bind(
            (tenant, conversation_id, int(turn_at), str(request_id), int(position), limit + 1)))
        items = [TranscriptMessage(tenant, conversation_id, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7] or "",
                                   r[8] or "", r[9] or 0) for r in rows[:limit]]
        return Page(items, items[-1].cursor if len(rows) > limit else None)

    async def close(self) -> None:
        if self._cluster is not None:
            await asyncio.to_thread(self._cluster.shutdown)
