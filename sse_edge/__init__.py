"""The HTTP/SSE edge: OpenAI's chat-completions API in front of the bus."""
