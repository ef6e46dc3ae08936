"""The stores below the services: transcripts (Cassandra, SQLite), billing (ClickHouse: writer,
reports, prices), API keys, files and batches (Redis), each with the DDL and data files it owns;
and the Redis client of the services that keep state there (one server or a Redis Cluster)."""
