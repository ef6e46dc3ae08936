"""Requests a GPU consumer fetches and does not serve, and what becomes of them.

A record that does not decode, a request on another model's or tier's topic (served here it would
jump, or lose, its place among the tiers), one that asks for what no engine can do as asked
(schemas/request_checks.py, or more tokens than the worker holds in flight in all) and one whose
reply log is not a reply log of this bus (its events would land in another topic, or in a
partition nobody reads, and the token log's scan of a partition that does not exist would hold up
every other lookup) go to ``dlq`` unchanged, with why in its headers. Where the request names a
reply partition a reader may wait on, it is also answered there with a final event that says why,
so that its stream ends at once rather than at its reader's idle timeout; nothing is billed.

A reply partition of ``tokens`` is checked against the worker's cluster metadata, which its
client refreshes every ``metadata_max_age_ms`` (five minutes by default): on a miss it is
refreshed at once (at most once a second), so that a partition added to ``tokens`` on a live
cluster is served from its first request rather than refused until the next refresh.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRecord

from tokenbus.gpu_consumers.engines import FINISH_ERROR
from tokenbus.schemas import ChatRequest, TokenEvent, request_problem
from tokenbus.schemas.request_checks import INVALID_REQUEST
from tokenbus.topics import DeadLetterPublisher, RecordSender, TopicCatalog
from tokenbus.topics.catalog import ROLLED_REPLY_LOG_PARTITIONS

WRONG_ROUTE = "wrong_route"
NO_REPLY_LOG = "no_reply_log"
METADATA_REFRESH_MIN_INTERVAL_S = 1.0  # a stream of requests to a partition that is not there refreshes once a second


class Refusals:
    """``known_partitions(topic)`` is what the worker's producer knows of a topic's partitions
    (its cluster metadata; None where it knows nothing of the topic), ``refresh_metadata()`` fetches
    that metadata again. ``cost(request)`` is the
    tokens a request holds in flight, ``budget`` the most the worker runs at once: a request that
    costs more would be admitted alone and hold the worker until it finished."""

    def __init__(self, catalog: TopicCatalog, dead_letters: DeadLetterPublisher, sender: RecordSender,
                 worker_id: str, known_partitions: Callable[[str], set[int] | None],
                 refresh_metadata: Callable[[], Awaitable[object]],
                 cost: Callable[[ChatRequest], int], budget: int) -> None:
        self._catalog = catalog
        self._dead_letters = dead_letters
        self._sender = sender
        self._worker_id = worker_id
        self._known_partitions = known_partitions
        self._refresh_metadata = refresh_metadata
        self._refreshed_at = -METADATA_REFRESH_MIN_INTERVAL_S
        self._cost = cost
        self._budget = budget

    def reply_problem(self, request: ChatRequest) -> str | None:
        """Why the request's events could not go where it says, or None."""
        topic, partition = request.reply_topic, request.reply_partition
        if not self._catalog.is_reply_log(topic):
            return f"reply_topic {topic!r} is not a reply log of this bus"
        if topic == self._catalog.tokens:
            partitions = self._known_partitions(topic)
            present = partitions is None or partition in partitions
        else:  # a rolled reply log
            present = partition < ROLLED_REPLY_LOG_PARTITIONS
        if partition < 0 or not present:
            return f"reply_partition {partition} is not a partition of {topic}"
        return None

    def route_problem(self, request: ChatRequest, model: str, tier: str | None) -> tuple[str, str] | None:
        """``(reason, detail)`` where a worker of ``model`` fetching the request from ``tier``'s
        topic does not serve it; None where it does."""
        if request.model != model or request.tier != tier:
            return WRONG_ROUTE, f"model={request.model} tier={request.tier}"
        problem = self.reply_problem(request)
        if problem is not None:
            return NO_REPLY_LOG, problem
        problem = request_problem(request)
        if problem is not None:
            return INVALID_REQUEST, problem
        if self._cost(request) > self._budget:
            return INVALID_REQUEST, (f"max_tokens {request.max_tokens} with the prompt's ~{request.estimated_prompt_tokens} "
                                     f"tokens exceeds the {self._budget} tokens a worker of this model holds in flight")
        return None

    async def problem(self, request: ChatRequest, model: str, tier: str | None) -> tuple[str, str] | None:
        """``route_problem``, asked again after a metadata refresh where the reply partition is one
        ``tokens`` may have gained since the worker's metadata was fetched."""
        refused = self.route_problem(request, model, tier)
        if (refused is None or refused[0] != NO_REPLY_LOG or request.reply_topic != self._catalog.tokens
                or request.reply_partition < 0
                or time.monotonic() - self._refreshed_at < METADATA_REFRESH_MIN_INTERVAL_S):
            return refused
        self._refreshed_at = time.monotonic()
        await self._refresh_metadata()
        return self.route_problem(request, model, tier)

    async def dead_letter(self, record: ConsumerRecord, reason: str, detail: str) -> None:
        await self._dead_letters.send(record, reason, detail)

    async def refuse(self, record: ConsumerRecord, request: ChatRequest, reason: str, detail: str) -> None:
        """Dead-letter the request and, where its reply partition is one, answer it there."""
        await self._dead_letters.send(record, reason, detail)
        if reason == NO_REPLY_LOG:
            return
        answer = TokenEvent(request.request_id, 0, finish_reason=FINISH_ERROR, error=f"{reason}: {detail}",
                            prompt_tokens=0, completion_tokens=0, worker_id=self._worker_id,
                            tenant=request.tenant or None, tier=request.tier)
        await self._sender.send_and_wait(request.reply_topic, answer, request.request_id,
                                         partition=request.reply_partition)
