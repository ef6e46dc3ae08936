"""OpenAI's wire shapes as the edge speaks them: request models and validation, response and
chunk bodies, and the OpenAPI document. No I/O here."""
