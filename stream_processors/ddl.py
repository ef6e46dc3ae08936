"""The stores' DDL files in ``infra/`` (ClickHouse, Cassandra), read as single statements."""

from __future__ import annotations

from importlib import resources


def ddl_statements(path: str) -> list[str]:
    """The statements of ``infra/<path>``, ``--`` comment lines dropped, split on ``;``."""
    text = resources.files("infra").joinpath(path).read_text()
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
