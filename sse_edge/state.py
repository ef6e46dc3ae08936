"""Everything one edge process holds: its bus client (the SDK's, with the broker watch), Redis
(keys, rate limits, stream records, files, batches, stored responses and chat completions),
admission, metrics, and the transcript store."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import redis.asyncio as redis
from aiokafka.errors import KafkaError

from tokenbus.moderation import INPUT, InputReview
from tokenbus.producers import Placement, TokenbusClient
from tokenbus.schemas import ChatRequest, TokenEvent, group_cancel_id
from tokenbus.sse_edge.plumbing.admission import Admission
from tokenbus.sse_edge.plumbing.auth import Authenticator
from tokenbus.sse_edge.plumbing.broker_watch import BrokerWatch
from tokenbus.sse_edge.plumbing.context import ContextWindows
from tokenbus.sse_edge.plumbing.history import ConversationHistory
from tokenbus.sse_edge.plumbing.metrics import EdgeMetrics
from tokenbus.sse_edge.plumbing.queue_depth import QueueDepthMonitor
from tokenbus.sse_edge.plumbing.ratelimit import Bucket, RateLimiter
from tokenbus.sse_edge.plumbing.relay import Choices, RelayHooks
from tokenbus.sse_edge.plumbing.streams import StreamRecord, StreamRegistry
from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.batches import BatchStore
from tokenbus.stores.chat_completions import CompletionStore
from tokenbus.stores.conversations import ConversationStore
from tokenbus.stores.files import FileStore
from tokenbus.stores.keys import KeyStore
from tokenbus.stores.redis_client import redis_client
from tokenbus.stores.responses import ResponseStore
from tokenbus.stores.transcripts import TranscriptStore, open_store
from tokenbus.topics import ReplyStreamError, cancel_task, record_at, replay
from tokenbus.topics.reply_stream import ROUTER_STOPPED

log = logging.getLogger(__name__)

CLOSE_ATTEMPTS = 12
CLOSE_READ_IDLE_S = 2.0  # a stalled stream's events are all in the log already


class EdgeState:
    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.metrics = EdgeMetrics()
        self.policy = settings.moderation.load_policy()  # inline moderation's, and /v1/moderations'
        self.bus = TokenbusClient(settings.bus, settings.reply_partitions, settings.stream_idle_timeout_s,
                                  rotate_every_s=settings.reply_rotate_s,
                                  rotate_after_streams=settings.reply_rotate_streams,
                                  policy=self.policy if settings.route == "inline" else None,
                                  on_review=self._count_decision, on_placed=self._count_placement)
        self.watch = BrokerWatch(self.bus.producer, self.bus.router, settings.broker_check_s, settings.broker_grace_s)
        self.redis = redis_client(settings.redis_url, settings.redis_cluster, socket_connect_timeout=0.5,
                                  socket_timeout=1.0)
        self.keys = KeyStore(self.redis, settings.redis_prefix)
        self.auth = Authenticator(self.keys, settings.key_cache_ttl_s)
        self.limiter = RateLimiter(self.redis, settings.redis_prefix, settings.redis_failure_mode)
        self.streams = StreamRegistry(self.redis, settings.redis_prefix, settings.stream_ttl_s)
        self.files = FileStore(self.redis, settings.redis_prefix, settings.file_ttl_s)
        self.batches = BatchStore(self.redis, settings.redis_prefix, settings.file_ttl_s)
        self.responses = ResponseStore(self.redis, settings.redis_prefix, settings.response_ttl_s)
        self.completions = CompletionStore(self.redis, settings.redis_prefix, settings.response_ttl_s)
        self.conversations = ConversationStore(self.redis, settings.redis_prefix, settings.conversation_ttl_s)
        self.queues = QueueDepthMonitor(settings.bus, gauge=self.metrics.queue_depth)
        self.admission = Admission(self.watch, self.queues, self.auth, self.limiter, settings, self.metrics)
        self._background: set[asyncio.Task[None]] = set()
        self.draining = False  # shutting down: no new work begins here (a response's reading is left to another edge)
        self._transcripts: TranscriptStore | None = None
        self.history = ConversationHistory(self.redis, settings.redis_prefix, self.transcripts, settings.history_turns,
                                           settings.history_ttl_s, settings.history_wait_s)
        self.context = ContextWindows(settings)

    def _count_decision(self, review: InputReview) -> None:
        self.metrics.decisions.labels(INPUT, review.verdict.action).inc()

    def _count_placement(self, placement: Placement) -> None:
        self.metrics.placements.labels(placement.reason).inc()
        self.metrics.placed_hit_tokens.inc(placement.hit_tokens)

    def transcripts(self) -> TranscriptStore:
        """Opened on first read: an edge that serves no transcript reads needs no store."""
        if self._transcripts is None:
            self._transcripts = open_store(self.settings.transcripts)
        return self._transcripts

    async def start(self) -> None:
        await self.bus.start()
        await self.watch.start()
        await self.queues.start()

    async def stop(self) -> None:
        for task in list(self._background):
            await cancel_task(task)
        await self.queues.stop()
        await self.watch.stop()
        await self.bus.stop()
        await self.admission.close()  # the completion tokens still to be charged, before Redis goes
        await self.redis.aclose()
        if self._transcripts is not None:
            await self._transcripts.close()

    def in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, grace_s: float) -> None:
        """Shutting down (no new connections are taken by then): give open streams ``grace_s`` to
        finish, then end the rest with an event that tells their clients to resume on another edge."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.bus.router.open_streams and loop.time() < deadline:
            await asyncio.sleep(0.1)
        ended = self.bus.router.fail_all(ReplyStreamError(
            "This edge is shutting down; resume the stream on another edge with Last-Event-ID or after_chunks.",
            ROUTER_STOPPED))
        if ended:
            log.info("shutting down: %d open streams told to resume elsewhere", ended)

    async def turn_request(self, record: StreamRecord) -> ChatRequest | None:
        """The request a stream record was registered for, as it was published: read from where
        it landed on the bus; None where the record names none or the log no longer holds it."""
        if record.request:  # a record written before the request's place was kept holds it
            return self.bus.codec.decode(base64.b64decode(record.request), ChatRequest)
        if record.request_offset < 0:
            return None
        value = await record_at(self.settings.bus, record.request_topic, record.request_partition,
                                record.request_offset)
        return self.bus.codec.decode(value, ChatRequest) if value is not None else None

    async def read_stream(self, record: StreamRecord, idle_s: float) -> tuple[list[TokenEvent], bool]:
        """A stream's events as the log holds them, and whether its final event is among them
        (no event for ``idle_s`` ends the read)."""
        events: list[TokenEvent] = []
        try:
            async for reply in replay(self.settings.bus, record.request_id, record.partition, record.start_offset,
                                      topic=record.topic, idle_timeout=idle_s, codec=self.bus.codec):
                events.append(reply.event)
        except ReplyStreamError:
            return events, False
        return events, bool(events) and events[-1].is_final

    async def close_incomplete(self, request_id: str) -> None:
        """Close a stream nothing answered for its idle timeout (producers' close_incomplete), with
        what its log holds, once the bus takes it; a stream that has ended meanwhile is left alone."""
        try:
            record = await self.streams.get(request_id)
        except (redis.RedisError, OSError):
            record = None
        if record is None or not record.names_request:
            log.error("could not close %s as incomplete: its stream record is gone", request_id)
            return
        for attempt in range(CLOSE_ATTEMPTS):
            try:
                events, ended = await self.read_stream(record, CLOSE_READ_IDLE_S)
                if not ended:
                    request = await self.turn_request(record)
                    if request is None:
                        log.error("could not close %s as incomplete: the bus no longer holds its request", request_id)
                        return
                    await self.bus.close_incomplete(request, events)
                return
            except KafkaError as exc:
                log.warning("closing %s as incomplete failed (%s); retrying", request_id, type(exc).__name__)
                await asyncio.sleep(min(2**attempt, 10))
        log.error("could not close %s as incomplete: the bus did not answer", request_id)

    async def cancel_unless_resumed(self, request_id: str, generations: Sequence[str] = ()) -> None:
        """After a client went away: wait out the grace window, then cancel unless it came back
        (``generations``: the ones to cancel, where the stream is several's: a response's choices)."""
        grace = self.settings.disconnect_grace_s
        try:
            await self.streams.detach(request_id, grace)
            await asyncio.sleep(grace)
            resumed = not await self.streams.still_detached(request_id)
        except (redis.RedisError, OSError):
            await asyncio.sleep(grace)
            resumed = False  # cannot tell without Redis: stop the work nobody may want
        if not resumed:
            # Several generations are a response's choices, ``{request_id}-{n}``: one record cancels them.
            targets = list(generations) or [request_id]
            await self.bus.cancel(group_cancel_id(request_id) if len(targets) > 1 else targets[0], "client went away")
            self.metrics.cancelled.inc()


class TurnHooks(RelayHooks):
    """What a turn's stream does at this edge when it ends: its completion tokens are charged to
    its token buckets (none for a resumed stream: the edge that admitted it charges them), a
    client that went away has the generation cancelled unless it resumes within the grace window,
    and a stream nothing answered is closed as incomplete. A response with several choices
    (``choices``, each a generation of its own) does so for each choice the relay has not seen end.
    A background turn (``background``: the Responses API's) is not cancelled when its reader goes."""

    __slots__ = ("_edge", "_request_id", "_token_buckets", "_choices", "background")

    def __init__(self, edge: EdgeState, request_id: str, token_buckets: list[Bucket] | None = None,
                 choices: Choices | None = None, background: bool = False) -> None:
        self._edge = edge
        self._request_id = request_id
        self._token_buckets = token_buckets
        self._choices = choices if choices is not None and choices.several else None
        self.background = background

    async def on_final(self, event: TokenEvent) -> None:
        if self._token_buckets:
            self._edge.admission.charge_completion(self._token_buckets, event.completion_tokens or 0)

    def _unfinished(self) -> list[str]:
        return [self._request_id] if self._choices is None else self._choices.unfinished()

    def on_abandoned(self) -> None:
        if self.background:
            return
        self._edge.in_background(self._edge.cancel_unless_resumed(self._request_id, self._unfinished()))

    def on_stalled(self) -> None:
        for generation in self._unfinished():
            self._edge.in_background(self._edge.close_incomplete(generation))
