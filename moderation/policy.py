"""A moderation policy: categories, how each is detected, and what each tier does about it.

Policies are TOML files (``default_policy.toml`` beside this module shows every key).
A policy scans text into findings, and decides one action for them by the request's tier
and stage (``input`` for prompts, ``output`` for token streams): the most severe action
of any finding wins (block > redact > flag > allow).
"""

from __future__ import annotations

import importlib
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenbus.moderation.detectors import BUILT_IN, Detector, RegexDetector, phrase_detector

DEFAULT_POLICY_FILE = Path(__file__).with_name("default_policy.toml")

ALLOW, FLAG, REDACT, BLOCK = "allow", "flag", "redact", "block"
SEVERITY = {ALLOW: 0, FLAG: 1, REDACT: 2, BLOCK: 3}
INPUT, OUTPUT = "input", "output"

# A classifier scores text per category (0..1); categories at or above the threshold are found.
Classifier = Callable[[str, str], Mapping[str, float]]


class PolicyError(ValueError):
    """The policy file is not valid."""


@dataclass(frozen=True, slots=True)
class Finding:
    category: str
    score: float
    start: int | None = None  # None: the classifier scored the whole text
    end: int | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    action: str
    findings: tuple[Finding, ...] = ()

    @property
    def categories(self) -> list[str]:
        return sorted({f.category for f in self.findings})

    @property
    def scores(self) -> dict[str, float]:
        scores: dict[str, float] = {}
        for f in self.findings:
            scores[f.category] = max(f.score, scores.get(f.category, 0.0))
        return scores


@dataclass
class Policy:
    name: str
    detectors: dict[str, Detector]
    actions: dict[str, dict[str, str]]  # tier (or "default") -> category -> action
    output_actions: dict[str, dict[str, str]] = field(default_factory=dict)
    refusal: str = "This request was blocked by the content policy."
    window_chars: int = 256
    classifier: Classifier | None = None
    classifier_threshold: float = 0.5

    # -- loading --------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | None = None) -> Policy:
        path = path or DEFAULT_POLICY_FILE
        try:
            return cls.from_dict(tomllib.loads(path.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise PolicyError(f"cannot read policy {path}: {exc}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        detectors = {name: _detector(name, spec) for name, spec in data.get("categories", {}).items()}
        actions = _actions(data.get("actions", {}), detectors)
        output_actions = _actions(data.get("output_actions", {}), detectors)
        classifier = _import_classifier(data["classifier"]) if data.get("classifier") else None
        return cls(
            name=f"{data.get('name', 'unnamed')}@{data.get('version', '0')}",
            detectors=detectors,
            actions=actions,
            output_actions=output_actions,
            refusal=data.get("refusal", cls.refusal),
            window_chars=int(data.get("window_chars", cls.window_chars)),
            classifier=classifier,
            classifier_threshold=float(data.get("classifier_threshold", cls.classifier_threshold)),
        )

    # -- scanning and deciding -------------------------------------------------------

    def scan(self, text: str, stage: str, new_from: int = 0) -> list[Finding]:
        """Findings in ``text``; with ``new_from``, those of detectors that end at or before it
        may be left out (the caller scanned that part before)."""
        findings = [Finding(category, 1.0, span.start, span.end)
                    for category, detector in self.detectors.items() for span in detector.find(text, new_from)]
        if self.classifier is not None and text:
            for category, score in self.classifier(text, stage).items():
                if score >= self.classifier_threshold:
                    findings.append(Finding(category, float(score)))
        return findings

    def action_for(self, category: str, tier: str, stage: str) -> str:
        tables = ([self.output_actions, self.actions] if stage == OUTPUT else [self.actions])
        for table in tables:
            for scope in (tier, "default"):
                if category in table.get(scope, {}):
                    return table[scope][category]
        return FLAG

    def decide(self, findings: list[Finding], tier: str, stage: str) -> Verdict:
        action = ALLOW
        for finding in findings:
            candidate = self.action_for(finding.category, tier, stage)
            if SEVERITY[candidate] > SEVERITY[action]:
                action = candidate
        return Verdict(action, tuple(findings))

    def redact(self, text: str, findings: list[Finding], tier: str, stage: str) -> str:
        """Replace the spans of categories whose action is ``redact`` (or ``block``) with a marker."""
        spans = sorted((f for f in findings if f.start is not None
                        and SEVERITY[self.action_for(f.category, tier, stage)] >= SEVERITY[REDACT]),
                       key=lambda f: f.start or 0)
        out, position = [], 0
        for finding in spans:
            assert finding.start is not None and finding.end is not None
            if finding.start < position:
                continue  # overlaps a span already redacted
            out.append(text[position:finding.start])
            out.append(f"[REDACTED:{finding.category}]")
            position = finding.end
        out.append(text[position:])
        return "".join(out)


def _detector(name: str, spec: dict[str, Any]) -> Detector:
    if "detector" in spec:
        if spec["detector"] not in BUILT_IN:
            raise PolicyError(f"category {name}: unknown detector {spec['detector']!r} (known: {sorted(BUILT_IN)})")
        return BUILT_IN[spec["detector"]]
    if spec.get("phrases"):
        return phrase_detector(list(spec["phrases"]))
    if spec.get("patterns"):
        try:
            return RegexDetector(list(spec["patterns"]))
        except re.error as exc:
            raise PolicyError(f"category {name}: bad pattern: {exc}") from None
    raise PolicyError(f"category {name} needs one of: detector, phrases, patterns")


def _actions(table: dict[str, Any], detectors: dict[str, Detector]) -> dict[str, dict[str, str]]:
    for scope, mapping in table.items():
        for category, action in mapping.items():
            if action not in SEVERITY:
                raise PolicyError(f"actions.{scope}.{category}: {action!r} is not one of {sorted(SEVERITY)}")
    return {scope: dict(mapping) for scope, mapping in table.items()}


def _import_classifier(target: str) -> Classifier:
    """``package.module:function``: the pluggable classifier hook."""
    module_name, _, attribute = target.partition(":")
    try:
        classifier: Classifier = getattr(importlib.import_module(module_name), attribute)
        return classifier
    except (ImportError, AttributeError) as exc:
        raise PolicyError(f"cannot load classifier {target!r}: {exc}") from None
