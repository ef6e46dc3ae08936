"""The content policy, a library below the services: categories and their detectors, what each
tier does about them, and the review of a prompt. The edge reviews prompts before it publishes
them; the stream processors review ``requests.ingress``, token streams and transcripts."""

from tokenbus.moderation.policy import (
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
from tokenbus.moderation.review import (
    FINISH_CONTENT_FILTER,
    MODERATION_WORKER,
    InputReview,
    closing_records,
    review_input,
)
from tokenbus.moderation.settings import ModerationSettings

__all__ = ["ALLOW", "BLOCK", "FINISH_CONTENT_FILTER", "FLAG", "INPUT", "MODERATION_WORKER", "OUTPUT", "REDACT",
           "Finding", "InputReview", "ModerationSettings", "Policy", "PolicyError", "Verdict", "closing_records",
           "review_input"]
