-- tokenbus billing and moderation review tables. `{db}` is TOKENBUS_CLICKHOUSE_DATABASE.
-- Applied by the billing processor at start (every statement is IF NOT EXISTS).
CREATE DATABASE IF NOT EXISTS {db};

-- One row per finished request (its Completion). Costs are integers in nano-USD, priced
-- when the row is written, so totals add up exactly and a later price change does not
-- rewrite history. The billing processor inserts a request only if its id is not here yet;
-- the ReplacingMergeTree key also folds duplicates on merge, as a second guard.
CREATE TABLE IF NOT EXISTS {db}.usage_events (
  request_id String,
  tenant LowCardinality(String),
  key_id String,
  model LowCardinality(String),
  tier LowCardinality(String),
  conversation_id String,
  prompt_tokens UInt32,
  completion_tokens UInt32,
  cached_prompt_tokens UInt32 DEFAULT 0,
  input_cost_nanousd UInt64,
  output_cost_nanousd UInt64,
  finish_reason LowCardinality(String),
  cancelled Bool,
  error String,
  worker_id String,
  created_at DateTime64(3, 'UTC'),
  started_at DateTime64(3, 'UTC'),
  first_token_at Nullable(DateTime64(3, 'UTC')),
  finished_at DateTime64(3, 'UTC'),
  inserted_at DateTime64(3, 'UTC') DEFAULT now64(3),
  INDEX request_id_bloom request_id TYPE bloom_filter GRANULARITY 4
) ENGINE = ReplacingMergeTree
ORDER BY (tenant, model, tier, finished_at, request_id);
-- Tables made before cached prompt tokens were billed get their column (before the views use it).
ALTER TABLE {db}.usage_events ADD COLUMN IF NOT EXISTS cached_prompt_tokens UInt32 DEFAULT 0;

-- Rollups per minute, hour and day by tenant, model and tier. SummingMergeTree merges
-- rows lazily: always read them with sum(...) GROUP BY. Each view's query is also applied to a
-- view that exists already (ALTER ... MODIFY QUERY, added by stores/billing/clickhouse.py), so a
-- rollup made by an older schema sums what this one does.
CREATE TABLE IF NOT EXISTS {db}.usage_{bucket} (
  bucket DateTime('UTC'),
  tenant LowCardinality(String),
  model LowCardinality(String),
  tier LowCardinality(String),
  requests UInt64,
  cancelled UInt64,
  prompt_tokens UInt64,
  completion_tokens UInt64,
  cached_prompt_tokens UInt64 DEFAULT 0,
  input_cost_nanousd UInt64,
  output_cost_nanousd UInt64
) ENGINE = SummingMergeTree
ORDER BY (tenant, model, tier, bucket);
ALTER TABLE {db}.usage_{bucket} ADD COLUMN IF NOT EXISTS cached_prompt_tokens UInt64 DEFAULT 0;

CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.usage_{bucket}_mv TO {db}.usage_{bucket} AS
SELECT
  toStartOf{Bucket}(finished_at) AS bucket,
  tenant, model, tier,
  count() AS requests,
  countIf(cancelled) AS cancelled,
  sum(prompt_tokens) AS prompt_tokens,
  sum(completion_tokens) AS completion_tokens,
  sum(cached_prompt_tokens) AS cached_prompt_tokens,
  sum(input_cost_nanousd) AS input_cost_nanousd,
  sum(output_cost_nanousd) AS output_cost_nanousd
FROM {db}.usage_events
GROUP BY bucket, tenant, model, tier;

-- The price table in force (from TOKENBUS_BILLING_PRICES_FILE), for analysts to read.
CREATE TABLE IF NOT EXISTS {db}.prices (
  model String,
  tier String,
  input_usd_per_mtok Float64,
  output_usd_per_mtok Float64,
  cached_input_usd_per_mtok Float64,
  loaded_at DateTime64(3, 'UTC') DEFAULT now64(3)
) ENGINE = ReplacingMergeTree(loaded_at)
ORDER BY (model, tier);
ALTER TABLE {db}.prices ADD COLUMN IF NOT EXISTS cached_input_usd_per_mtok Float64 AFTER output_usd_per_mtok;

-- Every moderation decision, for review.
CREATE TABLE IF NOT EXISTS {db}.moderation_decisions (
  request_id String,
  tenant LowCardinality(String),
  model LowCardinality(String),
  tier LowCardinality(String),
  stage LowCardinality(String),
  action LowCardinality(String),
  categories Array(String),
  scores Map(String, Float64),
  seq Nullable(Int32),
  policy String,
  decided_at DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree
ORDER BY (tenant, decided_at, request_id, stage, ifNull(seq, -1))
SETTINGS allow_nullable_key = 1;
