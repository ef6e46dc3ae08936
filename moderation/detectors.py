"""What finds a category in text: phrase lists, regular expressions and PII detectors.

Each detector returns the spans it matched, so a policy can redact exactly them. The
card detector keeps only digit runs that pass the Luhn check, which is what separates a
card number from an order number of the same length.

Output moderation scans a window per token event (the stream's last few hundred characters
and the event's text) and wants only the matches that reach into the new text: it passes
where that begins (``new_from``), and a detector whose matches all end with something it
can name (a phrase with its last word, a number with a digit) looks for that in the new
text first, and skips the whole scan when it is not there, as for nearly every token.
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
    def find(self, text: str, new_from: int = 0) -> Iterator[Span]:
        """The spans matched in ``text``; those that end at or before ``new_from`` may be left out."""
        ...


class RegexDetector:
    def __init__(self, patterns: list[str]) -> None:
        self._regex = re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)

    def find(self, text: str, new_from: int = 0) -> Iterator[Span]:
        for match in self._regex.finditer(text):
            if match.end() > match.start():
                yield Span(match.start(), match.end())


def phrase_detector(phrases: list[str]) -> Detector:
    """Phrases match case-insensitively, whole words, with any whitespace between words
    (a phrase split across two token events arrives with the space in either of them).
    A match ends with its phrase's last word, so the scan is gated on one of those."""
    patterns = [r"\b" + r"\s+".join(re.escape(word) for word in phrase.split()) + r"\b" for phrase in phrases]
    last_words = sorted({phrase.split()[-1] for phrase in phrases if phrase.split()}, key=len, reverse=True)
    if not last_words:
        return RegexDetector(patterns)
    gate = "|".join(re.escape(word) for word in last_words)
    words = tuple(word.casefold() for word in last_words) if all(word.isascii() for word in last_words) else None
    return Gated(gate, RegexDetector(patterns), reach=len(last_words[0]) - 1, flags=re.IGNORECASE, words=words)


# An e-mail address, as one regular expression: what ``EmailDetector`` finds.
EMAIL_PATTERN = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"


class EmailDetector:
    """The addresses ``EMAIL_PATTERN`` matches, found from each ``@``: its local part read back
    from it, its domain matched forward from it. The pattern run over the text tries its local
    part at every position of every word (over half the cost of moderating a long prompt); an
    address holds an ``@``, and text holds few."""

    # Case-insensitive as the pattern is run (which lets ``[A-Za-z]`` take a few letters beyond ASCII, the long s).
    _domain = re.compile(r"[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", re.IGNORECASE)
    _local = re.compile(r"[A-Za-z0-9._%+-]", re.IGNORECASE)

    def find(self, text: str, new_from: int = 0) -> Iterator[Span]:
        taken = 0  # where the last address ended: the next one's local part starts no earlier
        at = text.find("@")
        while at != -1:
            start = at
            while start > taken and self._local.match(text, start - 1):
                start -= 1
            domain = self._domain.match(text, at + 1) if start < at else None
            if domain is None:
                at = text.find("@", at + 1)
                continue
            yield Span(start, domain.end())
            taken = domain.end()
            at = text.find("@", taken)


EMAIL = EmailDetector()


class PhoneDetector:
    """International (+CC ...) or national numbers with 9 to 15 digits in common groupings."""

    _candidate = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4}){2,4}(?!\w)")

    def find(self, text: str, new_from: int = 0) -> Iterator[Span]:
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

    def find(self, text: str, new_from: int = 0) -> Iterator[Span]:
        for match in self._candidate.finditer(text):
            if self.is_card(match.group()):
                yield Span(match.start(), match.end())


DIGIT = r"\d"


class Gated:
    """Runs ``detector`` only on text where ``gate`` matches: output moderation scans a window
    per token event, and most windows hold no ``@`` and no digit.

    With ``reach``, every match of ``detector`` ends with a match of ``gate``, so one that ends
    after ``new_from`` has its gate starting no earlier than ``reach`` characters before it:
    only that much of the text is searched for the gate (a digit, ``reach`` 0, for a number; a
    phrase's last word for a phrase). Without, the gate may lie anywhere (an email's ``@``)."""

    def __init__(self, gate: str, detector: Detector, reach: int | None = None, flags: int = 0,
                 words: tuple[str, ...] | None = None) -> None:
        """``words``: the gate is these ASCII words, case-insensitively (a phrase list's last words)."""
        self._gate = re.compile(gate, flags)
        self._detector = detector
        self._reach = reach
        self._words = words
        self._digit = gate == DIGIT

    def find(self, text: str, new_from: int = 0) -> Iterator[Span]:
        start = 0 if self._reach is None else max(0, new_from - self._reach)
        if self._opens(text, start):
            yield from self._detector.find(text, new_from)

    def _opens(self, text: str, start: int) -> bool:
        if self._words is not None:
            # A case-insensitive regular expression of a few words costs ~40 ns a character of the
            # text; finding them in its case-folded copy, ~3. The two agree on ASCII words wherever
            # folding keeps each character one (then where it does not, the expression decides),
            # but for the dotless i, which the expression takes for an i.
            # (Only what lies from ``start`` on: output moderation asks of each token event's window.)
            searched = text[start:] if start else text
            folded = searched.casefold()
            if len(folded) == len(searched):
                folded = folded.replace("\u0131", "i")
                return any(word in folded for word in self._words)
        if self._digit and text.isascii():  # (``\d`` takes any script's digits: ASCII text has only these)
            return any(text.find(digit, start) != -1 for digit in "0123456789")
        return self._gate.search(text, start) is not None


CARD = CardDetector()
PHONE = PhoneDetector()
# A phone or card number ends with a digit; an email's ``@`` may be anywhere before its end.
BUILT_IN: dict[str, Detector] = {"email": Gated("@", EMAIL), "phone": Gated(DIGIT, PHONE, reach=0),
                                 "card": Gated(DIGIT, CARD, reach=0)}
