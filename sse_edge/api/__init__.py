"""The edge's HTTP endpoints, one module each: chat completions, stream resumption,
conversations, usage, models and the operational ones (health, readiness, metrics, OpenAPI)."""
