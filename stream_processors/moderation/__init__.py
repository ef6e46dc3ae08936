"""Moderation: a policy (categories, detectors, per-tier actions, classifier hook) applied to
prompts on the ingress path and to token streams on the way out."""

from tokenbus.stream_processors.moderation.policy import (
    ALLOW,
    BLOCK,
    FLAG,
    INPUT,
    OUTPUT,
    REDACT,
    Finding,
    Policy,
    PolicyError,
    Verdict,
)
from tokenbus.stream_processors.moderation.window import StreamWindows

__all__ = ["ALLOW", "BLOCK", "FLAG", "INPUT", "OUTPUT", "REDACT", "Finding", "Policy", "PolicyError", "StreamWindows",
           "Verdict"]
