"""OpenAI's ``service_tier`` in tokenbus's tiers, which run highest priority first
(``TOKENBUS_TIERS``): ``priority`` asks for the highest, ``flex`` (cheaper, and slower under load)
for the lowest, ``auto``, ``default`` and ``scale`` for the key's own; a tier's own name asks for
it. A request never runs above its key's tier: one that asks for more runs at its key's, and its
response says which it got, as OpenAI's does where priority processing is not enabled.

A response names the tier it ran at in OpenAI's words: the highest tier is ``priority``, the
lowest ``flex``, any other ``default`` (one tier alone: ``default``)."""

from __future__ import annotations

from collections.abc import Sequence

AS_THE_KEY = ("auto", "default", "scale")
PRIORITY, FLEX, DEFAULT = "priority", "flex", "default"


def tier_asked(service_tier: str | None, tiers: Sequence[str]) -> str | None:
    """The tier ``service_tier`` names (None: the key's); ``ValueError`` for one it does not."""
    if service_tier is None or service_tier in AS_THE_KEY:
        return None
    if service_tier == PRIORITY:
        return tiers[0]
    if service_tier == FLEX:
        return tiers[-1]
    if service_tier in tiers:
        return service_tier
    raise ValueError(f"service_tier must be one of {', '.join((*AS_THE_KEY, FLEX, PRIORITY))} or a tier of this "
                     f"deployment ({', '.join(tiers)})")


def tier_served(asked: str | None, key_tier: str, tiers: Sequence[str]) -> str:
    """The tier a request runs at: the one it asks for (``tier_asked``), never above its key's."""
    if asked is None or key_tier not in tiers or tiers.index(asked) < tiers.index(key_tier):
        return key_tier
    return asked


def openai_name(tier: str, tiers: Sequence[str]) -> str:
    """The ``service_tier`` a response names for the tier it ran at."""
    if len(tiers) > 1 and tier == tiers[0]:
        return PRIORITY
    if len(tiers) > 1 and tier == tiers[-1]:
        return FLEX
    return DEFAULT
