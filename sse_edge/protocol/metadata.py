"""OpenAI's ``metadata``, as every object that carries one takes it (a chat request, a batch, a
Responses request, a conversation): at most 16 pairs, keys of up to 64 characters, values of up
to 512."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

PAIRS_MAX, KEY_MAX, VALUE_MAX = 16, 64, 512


def within_limits(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > PAIRS_MAX or any(len(k) > KEY_MAX or len(v) > VALUE_MAX for k, v in metadata.items()):
        raise ValueError(f"at most {PAIRS_MAX} pairs, keys of up to {KEY_MAX} characters, values of up to {VALUE_MAX}")
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(within_limits)]
