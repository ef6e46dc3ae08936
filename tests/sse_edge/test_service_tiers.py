"""OpenAI's service_tier read as tokenbus's tiers (highest first), and named back."""

import pytest

from tokenbus.sse_edge.protocol.service_tiers import openai_name, tier_asked, tier_served

TIERS = ["interactive", "standard", "batch"]


@pytest.mark.parametrize(("asked", "key_tier", "served"), [
    (None, "standard", "standard"), ("auto", "standard", "standard"), ("default", "batch", "batch"),
    ("scale", "interactive", "interactive"),
    ("flex", "standard", "batch"), ("flex", "interactive", "batch"), ("flex", "batch", "batch"),
    ("priority", "interactive", "interactive"),
    ("priority", "standard", "standard"),  # never above the key's tier
    ("standard", "interactive", "standard"), ("interactive", "batch", "batch"), ("batch", "standard", "batch"),
])
def test_a_request_runs_at_the_tier_it_asks_for_never_above_its_keys(asked, key_tier, served):
    assert tier_served(tier_asked(asked, TIERS), key_tier, TIERS) == served


def test_a_tier_it_does_not_know_is_refused_naming_the_ones_it_does():
    with pytest.raises(ValueError, match="auto, default, scale, flex, priority or a tier of this deployment "
                                         r"\(interactive, standard, batch\)"):
        tier_asked("gold", TIERS)


def test_a_response_names_its_tier_in_openais_words():
    assert [openai_name(t, TIERS) for t in TIERS] == ["priority", "default", "flex"]
    assert [openai_name(t, ["fast", "mid", "bulk", "idle"]) for t in ("mid", "bulk")] == ["default", "default"]
    assert openai_name("only", ["only"]) == "default"
