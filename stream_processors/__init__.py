"""Stream processors on faust-streaming: moderation on the ingress and token paths,
transcripts (Cassandra, SQLite embedded) and billing rollups (ClickHouse). Not built yet:
see issue 6. The topics they read and write (`requests.ingress`, `completions`,
`moderation`, `dlq`) already exist in the catalog."""
