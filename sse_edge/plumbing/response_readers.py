"""Who reads a stored response's stream to its end, and so stores it as it ended.

A stored response under way is kept as it started (plumbing/kept_responses.py); whoever meets its
final event stores it ended. One reader at a time holds it, by a lease in the response store that
it renews while it reads (``ReaderLease``, ``TOKENBUS_EDGE_READER_LEASE_S``): the edge serving the turn (its stream, or its whole
answer), or, for a background turn, that edge's background reader.

So that no response stays under way for good, a client's reading that stops before the end (the
client went away, the stream failed) hands the reading over (``served_frames``, ``serving``):
the edge reads on from the log at once, by itself (``read_to_the_end``, which hands over no
further). An edge that stops releases its leases, or, killed, leaves them to lapse; the next edge
asked about such a response takes the reading over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import redis.asyncio as redis

from tokenbus.sse_edge.plumbing.kept_responses import KeptResponse
from tokenbus.stores.responses import ResponseStore
from tokenbus.topics import cancel_task

log = logging.getLogger(__name__)

READER = f"edge-{uuid.uuid4().hex[:12]}"  # this process, as a reader of stored responses


class ReaderLease:
    """This edge's lease on reading one stored response, held ``lease_s`` unless claimed again
    (each third of it, while it reads). Without Redis, no lease can be claimed: the serving edge
    reads on regardless, and no other edge takes over."""

    __slots__ = ("store", "response_id", "lease_s")

    def __init__(self, store: ResponseStore, response_id: str, lease_s: float) -> None:
        self.store = store
        self.response_id = response_id
        self.lease_s = lease_s

    async def claim(self) -> bool:
        """Whether this edge holds the lease now: no other reader held it, or this edge did."""
        try:
            return await self.store.claim_reader(self.response_id, READER, self.lease_s)
        except (redis.RedisError, OSError):
            return False

    async def release(self) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            await self.store.release_reader(self.response_id)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.claim()  # (one another edge took after a lapse is read by both: each stores the same end)

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the lease (claimed) while the body reads, renewed each third of it; then release it."""
        renewing = asyncio.ensure_future(self._renew())
        try:
            yield
        finally:
            await cancel_task(renewing)
            await self.release()


async def served_frames(frames: AsyncGenerator[bytes, None], kept: KeptResponse, hand_over: Callable[[], None],
                        lease: ReaderLease | None = None) -> AsyncGenerator[bytes, None]:
    """A stream's frames as its client reads them (under ``lease``, where the reader holds it), and
    ``hand_over`` once the client goes before the response ends."""
    async with serving(kept, hand_over, lease):
        async for frame in frames:
            yield frame


@contextlib.asynccontextmanager
async def serving(kept: KeptResponse, hand_over: Callable[[], None],
                  lease: ReaderLease | None = None) -> AsyncIterator[None]:
    """A client's reading of a response (under ``lease``, where the reader holds it): where it stops
    before the response ends (the client went away, the stream failed), ``hand_over`` starts a
    reader from the log."""
    try:
        async with lease.held() if lease is not None else contextlib.nullcontext():
            yield
    finally:
        if not kept.has_ended:
            hand_over()


async def read_to_the_end(lease: ReaderLease, frames: AsyncGenerator[bytes, None]) -> None:
    """A stream read to its end for what it stores (its frames go nowhere), under the lease: a
    background turn's, or one taken over. An edge that stops mid-stream (this task cancelled)
    releases the lease, and the next edge asked about the response takes the reading over."""
    try:
        async with lease.held():
            async for _ in frames:
                pass
    except Exception as exc:  # (a task in the background: nobody else would hear of it)
        log.error("response %s: reading its stream failed: %r", lease.response_id, exc)
