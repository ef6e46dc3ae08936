"""The transcripts job: each Completion becomes a turn in the transcript store, but one that
answers a summarizing request (server-side history), which becomes its conversation's summary."""

from __future__ import annotations

from typing import Any

from tokenbus.moderation import OUTPUT, Policy
from tokenbus.schemas import Completion
from tokenbus.stores.transcripts import TranscriptStore
from tokenbus.stores.transcripts.model import is_summary, summary_of, turn_of


class TranscriptWriter:
    name = "write-transcripts"

    def __init__(self, store: TranscriptStore, policy: Policy) -> None:
        self.store = store
        self.policy = policy

    def assistant_text(self, completion: Completion) -> str:
        """The reply as stored: masked where the tier's output action for a category is redact."""
        findings = self.policy.scan(completion.text, OUTPUT)
        return self.policy.redact(completion.text, findings, completion.tier, OUTPUT) if findings else completion.text

    async def handle(self, completion: Completion, message: Any) -> None:
        summary = summary_of(completion)
        if summary is not None:
            await self.store.write_summary(completion.tenant, *summary)
        elif not is_summary(completion):  # a summary request is not a turn of its conversation
            await self.store.write_turn(turn_of(completion, self.assistant_text(completion)))
