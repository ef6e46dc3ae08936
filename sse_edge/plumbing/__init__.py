"""What the endpoints stand on: authentication, rate limits, admission by queue depth, the
stream registry in Redis, the broker watch, SSE relaying, HTTP framing checks and metrics."""
