"""The simulated engine's structured answers (engines/simulated_answers.py): a text drawn from a
regular expression matches it whole, whatever its parts, and the draw is the seed's."""

import random
import re

import pytest

from tokenbus.gpu_consumers.engines.simulated_answers import regex_sample

PATTERNS = [
    r"(yes|no|maybe)", r"[A-Z][a-z]{2,5} \d{1,3}(\.\d)?", r"\w+@\w+\.(com|org)", r"[^a-z\s]{4}",
    r"^(ab|cd)+$", r"(\d)-\1", r"a*b?c+?", r"(?:x|y){3}", r"[\-+]?\d+", r"\S\s\W", r".{5}",
    r'\{"answer": "(red|green)"\}', r"(?P<word>[a-c]{2})=(?P=word)", r"[\u00e9-\u00ea]z",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_drawn_text_matches_its_pattern_whole(pattern):
    for seed in range(20):
        assert re.fullmatch(pattern, regex_sample(pattern, random.Random(seed))), pattern


def test_the_draw_is_the_seeds_and_choices_are_each_drawn():
    pattern = r"(rail|road|sea|air)"
    assert regex_sample(pattern, random.Random(7)) == regex_sample(pattern, random.Random(7))
    assert {regex_sample(pattern, random.Random(seed)) for seed in range(60)} == {"rail", "road", "sea", "air"}
