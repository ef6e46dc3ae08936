"""What every transcript store offers (idempotent writes of turns, tenant-scoped paginated
reads) and the settings that choose and configure one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tokenbus.stores.transcripts.model import Conversation, Page, Summary, TranscriptMessage, Turn
from tokenbus.topics.settings import split_csv


class TranscriptSettings(BaseSettings):
    """``TOKENBUS_TRANSCRIPTS_*``: shared by the writer (processors) and the reader (edge)."""

    model_config = SettingsConfigDict(env_prefix="TOKENBUS_TRANSCRIPTS_", extra="ignore")

    backend: Literal["sqlite", "cassandra"] = "sqlite"
    sqlite_path: Path = Path(".run/transcripts.sqlite3")
    cassandra_contact_points: Annotated[list[str], NoDecode] = []
    cassandra_port: int = 9042
    cassandra_keyspace: str = "tokenbus"
    ttl_s: int = 0  # 0 keeps transcripts forever

    _split_points = field_validator("cassandra_contact_points", mode="before")(split_csv)


class TranscriptStore(Protocol):
    async def write_turn(self, turn: Turn) -> None:
        """Write a turn's rows; writing the same turn again changes nothing."""

    async def list_conversations(self, tenant: str, limit: int = 50, after: str | None = None) -> Page[Conversation]:
        """A tenant's conversations, ordered by id."""

    async def list_messages(self, tenant: str, conversation_id: str, limit: int = 100,
                            after: str | None = None) -> Page[TranscriptMessage]:
        """A conversation's messages in order; empty for another tenant's conversation."""

    async def get_conversation(self, tenant: str, conversation_id: str) -> Conversation | None:
        """One of the tenant's conversations (its latest turn and summary); None for another tenant's."""

    async def write_summary(self, tenant: str, conversation_id: str, summary: Summary) -> None:
        """Keep ``summary`` for the conversation unless the one it has covers later turns."""

    async def close(self) -> None: ...
