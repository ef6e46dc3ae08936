"""The simulated engine's structured answers (engines/simulated.py): a value a JSON Schema
describes (for a JSON ``response_format`` and for a function's arguments), and a text a regular
expression matches (vLLM's ``guided_regex`` and ``guided_choice``), each drawn by a seeded
generator, as a decoder constrained to them would answer."""

from __future__ import annotations

import json
import random
import re
import zlib

# Python's own regular expression parser: ``re._parser`` (the deprecated ``sre_parse`` before 3.11).
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from tokenbus.gpu_consumers.engines.base import GenerationInput
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY
from tokenbus.schemas import RESPONSE_JSON_SCHEMA, RESPONSE_REGEX, RESPONSE_TEXT

JSON_OBJECT_ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}}}
REPEAT_BEYOND_MIN = 3  # an open-ended repeat (``*``, ``+``, ``{2,}``) draws at most this many more
PRINTABLE = [chr(c) for c in range(0x20, 0x7f)]


def sample_value(schema: Any, rng: random.Random) -> Any:
    """A value that fits a (simple) JSON Schema."""
    if not isinstance(schema, dict):
        return None
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return {name: sample_value(sub, rng) for name, sub in (schema.get("properties") or {}).items()}
    return {"string": lambda: rng.choice(VOCABULARY), "integer": lambda: rng.randint(0, 100),
            "number": lambda: rng.randint(0, 1000) / 10, "boolean": lambda: rng.random() < 0.5,
            "array": list, "null": lambda: None}.get(kind if isinstance(kind, str) else "", lambda: None)()


def regex_sample(pattern: str, rng: random.Random) -> str:
    """A text ``pattern`` matches whole, drawn from its parse: each branch, class member and
    repeat count chosen by ``rng`` (an open-ended repeat at most ``REPEAT_BEYOND_MIN`` past its
    least). Anchors and lookarounds are passed over, back-references repeat what their group drew."""
    groups: dict[int, str] = {}

    def draw(items: Any) -> str:
        return "".join(one(op, av) for op, av in items)

    def one(op: Any, av: Any) -> str:
        if op is sre_constants.LITERAL:
            return chr(av)
        if op is sre_constants.NOT_LITERAL:
            return rng.choice([c for c in PRINTABLE if ord(c) != av])
        if op is sre_constants.ANY:
            return rng.choice(PRINTABLE)
        if op is sre_constants.IN:
            return rng.choice(in_class(av))
        if op is sre_constants.BRANCH:
            return draw(rng.choice(av[1]))
        if op is sre_constants.SUBPATTERN:
            group, *_, inner = av
            text = draw(inner)
            if group is not None:
                groups[group] = text
            return text
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None)):
            low, high, inner = av
            high = low + REPEAT_BEYOND_MIN if high is sre_constants.MAXREPEAT else high
            return "".join(draw(inner) for _ in range(rng.randint(low, high)))
        if op is sre_constants.GROUPREF:
            return groups.get(av, "")
        if op is sre_constants.ATOMIC_GROUP:
            return draw(av)
        return ""  # AT (anchors), ASSERT and ASSERT_NOT (lookarounds): no text of their own

    def in_class(items: Any) -> list[str]:
        chars: list[str] = []
        negated = False
        for op, av in items:
            if op is sre_constants.NEGATE:
                negated = True
            elif op is sre_constants.LITERAL:
                chars.append(chr(av))
            elif op is sre_constants.RANGE:
                chars += [chr(c) for c in range(av[0], min(av[1], av[0] + 255) + 1)]
            elif op is sre_constants.CATEGORY:
                chars += [c for c in PRINTABLE if re.fullmatch(CATEGORIES.get(av, "."), c)]
        if negated:
            return [c for c in PRINTABLE if c not in chars] or ["~"]
        return chars or ["~"]

    return draw(sre_parse.parse(pattern))


CATEGORIES = {sre_constants.CATEGORY_DIGIT: r"\d", sre_constants.CATEGORY_NOT_DIGIT: r"\D",
              sre_constants.CATEGORY_SPACE: r"\s", sre_constants.CATEGORY_NOT_SPACE: r"\S",
              sre_constants.CATEGORY_WORD: r"\w", sre_constants.CATEGORY_NOT_WORD: r"\W"}


def guided_answer(inp: GenerationInput, seed_material: str) -> str:
    """A structured answer's text where the response format asks for one, "" where it does not: a
    value the request's ``json_schema`` describes (for ``json_object``, a small object), or a text
    its ``guided_regex`` matches, drawn by a generator seeded like the text."""
    sampling = inp.sampling
    if sampling.response_format == RESPONSE_TEXT:
        return ""
    rng = random.Random(zlib.crc32(f"{seed_material}:json".encode()))
    if sampling.response_format == RESPONSE_REGEX:
        return regex_sample(sampling.guided_regex, rng)
    schema = json.loads(sampling.json_schema) if sampling.response_format == RESPONSE_JSON_SCHEMA else JSON_OBJECT_ANSWER
    return json.dumps(sample_value(schema, rng))
