"""Transcripts: the data model, the store interface, and its two implementations
(Cassandra in production, SQLite embedded). ``open_store`` picks the one the settings name."""

from tokenbus.stores.transcripts.base import TranscriptSettings, TranscriptStore
from tokenbus.stores.transcripts.model import BadCursor, Conversation, Page, Summary, TranscriptMessage, Turn


def open_store(settings: TranscriptSettings) -> TranscriptStore:
    if settings.backend == "cassandra":
        from tokenbus.stores.transcripts.cassandra import CassandraTranscriptStore

        return CassandraTranscriptStore.connect(settings)
    from tokenbus.stores.transcripts.sqlite import SqliteTranscriptStore

    return SqliteTranscriptStore(settings.sqlite_path, settings.ttl_s)


__all__ = ["BadCursor", "Conversation", "Page", "Summary", "TranscriptMessage", "TranscriptSettings", "TranscriptStore",
           "Turn", "open_store"]
