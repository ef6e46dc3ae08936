"""DDL files shipped beside the store that uses them, read as single statements."""

from __future__ import annotations

from importlib import resources


def ddl_statements(package: str, filename: str) -> list[str]:
    """The statements of ``filename`` in ``package``, ``--`` comment lines dropped, split on ``;``."""
    text = resources.files(package).joinpath(filename).read_text()
    lines = [line for line in text.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]
