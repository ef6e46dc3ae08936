"""What every record's class shares: the time stamps its records carry, and its fields as a
shallow dict (``to_avro`` of most records)."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any


def now_ms() -> int:
    return int(time.time() * 1000)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def shallow_fields(record: object) -> dict[str, Any]:
    """A dataclass's fields as a shallow dict: ``dataclasses.asdict`` deep-copies, and this is on hot paths."""
    # mypy does not take a class for Hashable here; it is.
    return {name: getattr(record, name) for name in _field_names(type(record))}  # type: ignore[arg-type]
