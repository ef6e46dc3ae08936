"""Which moderation policy a service applies (``TOKENBUS_MODERATION_*``): the edge to prompts
before it publishes them, the stream processors to ``requests.ingress``, token streams and
transcripts. Every service of a deployment should read the same file."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenbus.moderation.policy import Policy


class ModerationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENBUS_MODERATION_", extra="ignore")

    # A policy TOML file; unset, the default policy in the package (moderation/default_policy.toml).
    policy_file: Path | None = None

    def load_policy(self) -> Policy:
        return Policy.load(self.policy_file)
