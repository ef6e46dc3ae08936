"""The SDK internal services use to publish requests and read their token streams
straight from the bus, with no HTTP hop.

    async with TokenbusClient() as client:
        request = client.new_request("tokenbus-sim", [ChatMessage("user", "Hello")])
        async for reply in client.stream(request):
            print(reply.event.text, end="")

Fire-and-forget batch work: ``await client.publish(request)`` at a low tier and read
the results later from the ``completions`` topic. With a ``policy`` the client reviews each
prompt before publishing it (producers/moderated.py), as the edge does; without one, publish
to ``requests.ingress`` (``topic=client.catalog.ingress``) to have the moderation processor
review it. The edge is built on this client too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from tokenbus.moderation import InputReview, Policy
from tokenbus.producers.moderated import InputModerator
from tokenbus.producers.placement import Placement, PrefixRouter
from tokenbus.producers.publisher import RequestPublisher
from tokenbus.schemas import (
    FINISH_INCOMPLETE,
    ChatMessage,
    ChatRequest,
    Completion,
    CompletionBuilder,
    TokenEvent,
    check_request,
)
from tokenbus.topics import (
    BusSettings,
    FetchPacer,
    RecordSender,
    ReplyEvent,
    ReplyGroup,
    ReplyRouter,
    ReplyStream,
    TopicCatalog,
    make_codec,
    make_producer,
    profile,
)

CLOSED_BY = "closer"  # the worker_id of records that close a stream nothing answers


class Submission(NamedTuple):
    stream: ReplyStream
    landed: RecordMetadata | None  # where the request lies on the bus; None when the policy refused it


def new_request_id(kind: str = "chatcmpl") -> str:
    """A request's id, which its client sees as the completion's: ``chatcmpl-...`` (``cmpl-...`` for
    a text completion, as OpenAI names them)."""
    return f"{kind}-{uuid.uuid4().hex}"


class TokenbusClient:
    def __init__(
        self,
        settings: BusSettings | None = None,
        reply_partitions: list[int] | None = None,
        idle_timeout: float | None = 60.0,
        rotate_every_s: float = 0.0,
        rotate_after_streams: int = 0,
        policy: Policy | None = None,
        on_review: Callable[[InputReview], None] | None = None,
        on_placed: Callable[[Placement], None] | None = None,
    ) -> None:
        self.settings = settings or BusSettings()
        self.catalog = TopicCatalog(self.settings)
        self.codec = make_codec(self.settings)
        self.idle_timeout = idle_timeout
        # On the embedded broker a rotating router rolls its logs (topics/replies.py).
        rolls = profile(self.settings).roll_reply_logs and (rotate_every_s > 0 or rotate_after_streams > 0)
        self.router = ReplyRouter(self.settings, reply_partitions or [0], self.codec, rotate_every_s=rotate_every_s,
                                  rotate_after_streams=rotate_after_streams, roll_logs=rolls,
                                  keep_s=self.settings.rolled_reply_log_keep_s)
        self.producer: AIOKafkaProducer = make_producer(self.settings)
        self.sender = RecordSender(self.producer, self.codec, self.catalog)
        self.placement = PrefixRouter(self.settings, self.codec, on_placed=on_placed) if self.settings.prefix_routing else None
        # The express lane saves a light stack the broker's fetch cycle; under load fetches return
        # records at once and a hand-over would only add work (BENCHMARKS.md §11).
        publisher = RequestPublisher(self.sender, self.placement,
                                     lambda: self.router.open_streams <= FetchPacer.LIGHT_IN_FLIGHT)
        self.publisher = InputModerator(publisher, policy, on_review) if policy is not None else publisher

    async def start(self) -> None:
        await self.producer.start()
        await self.router.start()
        if self.placement is not None:
            await self.placement.start()

    async def stop(self) -> None:
        if self.placement is not None:
            await self.placement.stop()
        await self.router.stop()
        await self.producer.stop()

    async def __aenter__(self) -> TokenbusClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def new_request(self, model: str, messages: list[ChatMessage], tier: str | None = None, **params: Any) -> ChatRequest:
        """A request whose replies come back to this client's reply partition."""
        return ChatRequest(
            request_id=params.pop("request_id", None) or new_request_id(),
            model=model,
            tier=tier or self.settings.tiers[-1],
            messages=messages,
            reply_topic=self.router.reply_topic,
            reply_partition=self.router.reply_partition,
            **params,
        )

    async def publish(self, request: ChatRequest, topic: str | None = None) -> RecordMetadata | None:
        """Publish to the request's model and tier topic (or ``topic``, e.g. ``requests.ingress``);
        None when this client's policy refused it (the refusal is on the request's reply stream).
        A request out of range (schemas/request_checks.py) raises ``RequestOutOfRange`` here: a GPU
        consumer would only dead-letter it."""
        check_request(request)
        return await self.publisher.publish(request, topic)

    async def cancel(self, request_id: str, reason: str = "") -> None:
        """Ask whichever GPU consumer holds the request to stop it (within one engine step)."""
        await self.sender.cancel(request_id, reason)

    async def close_incomplete(self, request: ChatRequest, delivered: list[TokenEvent]) -> Completion:
        """End a stream that nothing answers any more (its GPU consumer died with no one to take
        over): a final ``incomplete`` event after what was delivered, which every reader of the
        stream and any later owner of the request honour as the end, a cancel in case the
        generation is only stalled, and the Completion that stores the turn as incomplete with
        the text delivered and bills the tokens generated. A consumer that takes the request over
        later finds the final event and publishes the same Completion again (billed once)."""
        usage = next((e.prompt_tokens for e in delivered if e.prompt_tokens is not None), None)
        final = TokenEvent(request.request_id, len(delivered), finish_reason=FINISH_INCOMPLETE, truncate=True,
                           prompt_tokens=usage if usage is not None else request.estimated_prompt_tokens,
                           completion_tokens=len(request.prefix_token_ids) + sum(len(e.token_ids) for e in delivered),
                           worker_id=CLOSED_BY)
        await self.sender.send_and_wait(request.reply_topic, final, request.request_id,
                                        partition=request.reply_partition)
        await self.sender.cancel(request.request_id, "stream closed as incomplete")
        completion = CompletionBuilder([*delivered, final]).build(request, CLOSED_BY)
        await self.sender.send_and_wait(self.catalog.completions, completion, request.request_id)
        return completion

    async def submit(self, request: ChatRequest, topic: str | None = None) -> ReplyStream:
        """Open the reply stream first, then publish: no event can slip past. The caller reads
        ``stream.events()`` and calls ``finish`` when done."""
        return (await self.submission(request, topic)).stream

    async def submission(self, request: ChatRequest, topic: str | None = None) -> Submission:
        """``submit``, telling also where the request landed."""
        check_request(request)
        stream = self.router.open(request.request_id, request.reply_partition, request.reply_topic)
        try:
            landed = await self.publisher.publish(request, topic)
        except BaseException:
            self.finish(request.request_id)
            raise
        return Submission(stream, landed)

    async def group_submission(self, group_id: str, requests: Sequence[ChatRequest],
                               topic: str | None = None) -> tuple[ReplyGroup, list[RecordMetadata | None]]:
        """Several requests read back as one stream (the choices of ``group_id``, each a request
        of its own): every stream is opened first, then the requests go out together; where each
        landed, in their order."""
        for request in requests:
            check_request(request)
        group = ReplyGroup(group_id, [self.router.open(r.request_id, r.reply_partition, r.reply_topic)
                                      for r in requests])
        outcomes = await asyncio.gather(*(self.publisher.publish(r, topic) for r in requests), return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:  # all or none: the ones that went out are stopped
            for request, outcome in zip(requests, outcomes, strict=True):
                self.finish(request.request_id)
                if not isinstance(outcome, BaseException):
                    await self.cancel(request.request_id, "another choice of its response could not be published")
            raise failed
        return group, [o for o in outcomes if not isinstance(o, BaseException)]

    def finish(self, request_id: str) -> None:
        """Done with a submitted request's stream: its reply router entry goes, and placement no
        longer counts it as load on the worker it was sent to."""
        self.router.close(request_id)
        if self.placement is not None:
            self.placement.finished(request_id)

    async def stream(self, request: ChatRequest) -> AsyncIterator[ReplyEvent]:
        stream = await self.submit(request)
        try:
            async for reply in stream.events(self.idle_timeout):
                yield reply
        finally:
            self.finish(request.request_id)
