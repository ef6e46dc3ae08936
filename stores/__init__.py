"""The stores below the services: transcripts (Cassandra, SQLite), billing (ClickHouse: writer,
reports, prices) and API keys (Redis), each with the DDL and data files it owns."""
