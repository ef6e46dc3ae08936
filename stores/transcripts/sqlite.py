"""The embedded transcript store: one SQLite file with Cassandra's data model.

Two tables, as in ``stores/transcripts/schema.cql``: messages keyed by
``(tenant, conversation_id)`` then ``(turn_at_ms, request_id, position)``, and
conversations keyed by ``(tenant, conversation_id)``. WAL mode lets the edge read while
the processors write. SQLite is synchronous, so calls run on one worker thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tokenbus.schemas import now_ms
from tokenbus.stores.transcripts.model import (
    Conversation,
    Page,
    Summary,
    TranscriptMessage,
    Turn,
    decode_cursor,
    page_size,
)

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages_by_conversation (
    tenant TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    turn_at_ms INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    model TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    expires_at_ms INTEGER,
    tool_calls TEXT NOT NULL DEFAULT '',
    tool_call_id TEXT NOT NULL DEFAULT '',
    version_ms INTEGER NOT NULL DEFAULT 0,
    written_at_ms INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, conversation_id, turn_at_ms, request_id, position)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS conversations_by_tenant (
    tenant TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    model TEXT NOT NULL,
    last_turn_at_ms INTEGER NOT NULL,
    last_request_id TEXT NOT NULL,
    expires_at_ms INTEGER,
    summary TEXT NOT NULL DEFAULT '',
    summary_through_ms INTEGER NOT NULL DEFAULT 0,
    summary_through_request_id TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (tenant, conversation_id)
) WITHOUT ROWID;
"""

UPSERT_MESSAGE = """
INSERT INTO messages_by_conversation (tenant, conversation_id, turn_at_ms, request_id, position, role, content,
    model, finish_reason, expires_at_ms, tool_calls, tool_call_id, version_ms, written_at_ms)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT DO UPDATE SET role = excluded.role, content = excluded.content, model = excluded.model,
    finish_reason = excluded.finish_reason, expires_at_ms = excluded.expires_at_ms,
    tool_calls = excluded.tool_calls, tool_call_id = excluded.tool_call_id, version_ms = excluded.version_ms,
    written_at_ms = excluded.written_at_ms
WHERE excluded.version_ms >= messages_by_conversation.version_ms
"""
# Columns added after the first release: a file written before gets them on open.
ADDED_COLUMNS = {
    "messages_by_conversation": {"tool_calls": "TEXT NOT NULL DEFAULT ''", "tool_call_id": "TEXT NOT NULL DEFAULT ''",
                                 "version_ms": "INTEGER NOT NULL DEFAULT 0",
                                 "written_at_ms": "INTEGER NOT NULL DEFAULT 0"},
    "conversations_by_tenant": {"summary": "TEXT NOT NULL DEFAULT ''", "summary_through_ms": "INTEGER NOT NULL DEFAULT 0",
                                "summary_through_request_id": "TEXT NOT NULL DEFAULT ''"},
}
WRITE_SUMMARY = """
UPDATE conversations_by_tenant SET summary = ?, summary_through_ms = ?, summary_through_request_id = ?
WHERE tenant = ? AND conversation_id = ? AND (summary_through_ms, summary_through_request_id) <= (?, ?)
"""
# The latest turn wins whatever order turns are written in, like Cassandra's USING TIMESTAMP.
UPSERT_CONVERSATION = """
INSERT INTO conversations_by_tenant (tenant, conversation_id, model, last_turn_at_ms, last_request_id, expires_at_ms)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT DO UPDATE SET model = excluded.model, last_turn_at_ms = excluded.last_turn_at_ms,
    last_request_id = excluded.last_request_id, expires_at_ms = excluded.expires_at_ms
WHERE (excluded.last_turn_at_ms, excluded.last_request_id) >= (last_turn_at_ms, last_request_id)
"""
LIVE = "(expires_at_ms IS NULL OR expires_at_ms > ?)"
SELECT_CONVERSATIONS = f"""
SELECT conversation_id, model, last_turn_at_ms, last_request_id FROM conversations_by_tenant
WHERE tenant = ? AND conversation_id > ? AND {LIVE} ORDER BY conversation_id LIMIT ?
"""
SELECT_CONVERSATION = f"""
SELECT conversation_id, model, last_turn_at_ms, last_request_id, summary, summary_through_ms,
    summary_through_request_id FROM conversations_by_tenant
WHERE tenant = ? AND conversation_id = ? AND {LIVE}
"""
SELECT_MESSAGES = f"""
SELECT turn_at_ms, request_id, position, role, content, model, finish_reason, tool_calls, tool_call_id,
    written_at_ms FROM messages_by_conversation
WHERE tenant = ? AND conversation_id = ? AND (turn_at_ms, request_id, position) > (?, ?, ?) AND {LIVE}
ORDER BY turn_at_ms, request_id, position LIMIT ?
"""


class SqliteTranscriptStore:
    def __init__(self, path: Path, ttl_s: int = 0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._ttl_ms = ttl_s * 1000 if ttl_s > 0 else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transcripts-sqlite")
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def write_turn(self, turn: Turn) -> None:
        await self._run(self._write_turn, turn)

    def _write_turn(self, turn: Turn) -> None:
        expires = turn.turn_at_ms + self._ttl_ms if self._ttl_ms else None
        written = now_ms()
        with self._db:
            self._db.executemany(UPSERT_MESSAGE, [
                (m.tenant, m.conversation_id, m.turn_at_ms, m.request_id, m.position, m.role, m.content, m.model,
                 m.finish_reason, expires, m.tool_calls, m.tool_call_id, turn.version_ms, written)
                for m in turn.messages])
            self._db.execute(UPSERT_CONVERSATION, (turn.tenant, turn.conversation_id, turn.model, turn.turn_at_ms,
                                                   turn.request_id, expires))

    async def list_conversations(self, tenant: str, limit: int = 50, after: str | None = None) -> Page[Conversation]:
        limit = page_size(limit)
        start = decode_cursor(after, 1)[0] if after else ""
        rows = await self._run(self._query, SELECT_CONVERSATIONS, (tenant, start, now_ms(), limit + 1))
        items = [Conversation(tenant, *row) for row in rows[:limit]]
        return Page(items, items[-1].cursor if len(rows) > limit else None)

    async def get_conversation(self, tenant: str, conversation_id: str) -> Conversation | None:
        rows = await self._run(self._query, SELECT_CONVERSATION, (tenant, conversation_id, now_ms()))
        if not rows:
            return None
        cid, model, last_at, last_id, content, through_ms, through_id = rows[0]
        summary = Summary(content, through_ms, through_id) if content else None
        return Conversation(tenant, cid, model, last_at, last_id, summary)

    async def write_summary(self, tenant: str, conversation_id: str, summary: Summary) -> None:
        def write() -> None:
            with self._db:
                self._db.execute(WRITE_SUMMARY, (summary.content, *summary.through, tenant, conversation_id,
                                                 *summary.through))
        await self._run(write)

    async def list_messages(self, tenant: str, conversation_id: str, limit: int = 100,
                            after: str | None = None) -> Page[TranscriptMessage]:
        limit = page_size(limit)
        turn_at, request_id, position = decode_cursor(after, 3) if after else (-1, "", -1)
        rows = await self._run(self._query, SELECT_MESSAGES,
                               (tenant, conversation_id, turn_at, request_id, position, now_ms(), limit + 1))
        items = [TranscriptMessage(tenant, conversation_id, *row) for row in rows[:limit]]
        return Page(items, items[-1].cursor if len(rows) > limit else None)

    def _query(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, params).fetchall()

    async def purge_expired(self) -> int:
        def purge() -> int:
            with self._db:
                cursor = self._db.execute("DELETE FROM messages_by_conversation WHERE expires_at_ms <= ?", (now_ms(),))
                self._db.execute("DELETE FROM conversations_by_tenant WHERE expires_at_ms <= ?", (now_ms(),))
                return cursor.rowcount
        return await self._run(purge)

    async def close(self) -> None:
        await self._run(self._db.close)
        self._executor.shutdown(wait=False)
