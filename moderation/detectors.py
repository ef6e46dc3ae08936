"""What finds a category in text: phrase lists, regular expressions and PII detectors.

Each detector returns the spans it matched, so a policy can redact exactly them. The
card detector keeps only digit runs that pass the Luhn check, which is what separates a
card number from an order number of the same length.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    end: int


class Detector(Protocol):
    def find(self, text: str) -> Iterator[Span]: ...


class RegexDetector:
    def __init__(self, patterns: list[str]) -> None:
        self._regex = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)

    def find(self, text: str) -> Iterator[Span]:
        for match in self._regex.finditer(text):
            if match.end() > match.start():
                yield Span(match.start(), match.end())


def phrase_detector(phrases: list[str]) -> RegexDetector:
    """Phrases match case-insensitively, whole words, with any whitespace between words
    (a phrase split across two token events arrives with the space in either of them)."""
    patterns = [r"\b" + r"\s+".join(re.escape(word) for word in phrase.split()) + r"\b" for phrase in phrases]
    return RegexDetector(patterns)


EMAIL = RegexDetector([r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"])


class PhoneDetector:
    """International (+CC ...) or national numbers with 9 to 15 digits in common groupings."""

    _candidate = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){2,4}(?!\w)")

    def find(self, text: str) -> Iterator[Span]:
        for match in self._candidate.finditer(text):
            digits = sum(ch.isdigit() for ch in match.group())
            if 9 <= digits <= 15 and not CARD.is_card(match.group()):
                yield Span(match.start(), match.end())


def luhn_valid(digits: str) -> bool:
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


class CardDetector:
    """13 to 19 digits, optionally grouped by spaces or dashes, passing the Luhn check."""

    _candidate = re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)")

    def is_card(self, text: str) -> bool:
        digits = re.sub(r"\D", "", text)
        return 13 <= len(digits) <= 19 and luhn_valid(digits)

    def find(self, text: str) -> Iterator[Span]:
        for match in self._candidate.finditer(text):
            if self.is_card(match.group()):
                yield Span(match.start(), match.end())


class Gated:
    """Runs ``detector`` only on text where ``gate`` matches: output moderation scans a window
    per token event, and most windows hold no ``@`` and no digit."""

    def __init__(self, gate: str, detector: Detector) -> None:
        self._gate = re.compile(gate)
        self._detector = detector

    def find(self, text: str) -> Iterator[Span]:
        if self._gate.search(text):
            yield from self._detector.find(text)


CARD = CardDetector()
PHONE = PhoneDetector()
BUILT_IN: dict[str, Detector] = {"email": Gated("@", EMAIL), "phone": Gated(r"\d", PHONE), "card": Gated(r"\d", CARD)}
