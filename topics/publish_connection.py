"""Redis PUBLISH that nobody waits for: a connection of its own, written to by plain functions.

The doorbell (doorbell.py) publishes rings, and records handed over on the express lane, to
readers that gain by having them a few milliseconds sooner and lose only that when one is lost.
Through redis-py each batch of publishes was a task, a round trip and the wakeup its reply brings:
~110-140 µs of CPU for a publish alone (BENCHMARKS.md §18), ~4 ms of a GPU consumer's request at
concurrency 1, where it hands over each token event. Here what a pass of the event loop publishes
is written at the pass's end, in one write, and nothing waits for it. The connection asks Redis
not to answer at all (``CLIENT REPLY OFF``): an answer would wake the event loop again for each
write, which costs a publish alone more than the write does. Managed Redis services often refuse
the CLIENT commands; there Redis answers each PUBLISH with the number of subscribers it reached,
and the protocol reads those answers and drops them. Either way an error answer (a wrong
password's, say) is logged.

redis-py reads the URL (host and port, a unix socket, TLS and its options, credentials), so any
URL a redis-py client takes works here. A publish that cannot go out is dropped and counted: while
the connection is being made publishes wait (up to ``MAX_WAITING``); when making it fails, publishes
are dropped until a later one tries again, ``RECONNECT_S`` on; and while Redis reads more slowly
than this process writes (over ``MAX_UNSENT_BYTES`` waiting in the socket's buffer), they are
dropped rather than held without bound.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time

import redis.asyncio as redis

log = logging.getLogger(__name__)

RECONNECT_S = 1.0
CONNECT_TIMEOUT_S = 1.0
MAX_WAITING = 10_000  # publishes held while the connection is made
MAX_UNSENT_BYTES = 4 * 1024 * 1024
MAX_CHANNELS_REMEMBERED = 1024


def command(*parts: bytes) -> bytes:
    """A command in RESP, as Redis reads it: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out += (b"$%d\r\n" % len(part), part, b"\r\n")
    return b"".join(out)


class PublishConnection:
    """Publishes to one Redis; see the module's docstring. One event loop at a time: used from
    another (a process that runs several loops in turn), it connects again on that one."""

    def __init__(self, url: str) -> None:
        # A redis-py connection object, never connected: what redis-py makes of the URL.
        self._options = redis.ConnectionPool.from_url(url).make_connection()  # type: ignore[no-untyped-call]
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._outbox: list[bytes] = []
        self._flush_due = False
        self._retry_at = float("-inf")
        self._channels: dict[str, bytes] = {}  # a channel's part of the command, made once
        self.writes = 0  # writes to the socket (a pass's publishes go in one)
        self.dropped = 0  # publishes that could not go out
        self.reply_bytes = 0  # what Redis answered: nothing, unless it refused CLIENT REPLY OFF
        self._warned = False

    def publish(self, channel: str, message: bytes) -> None:
        """Publish ``message`` on ``channel`` at the end of this pass of the running event loop."""
        head = self._channels.get(channel)
        if head is None:
            if len(self._channels) >= MAX_CHANNELS_REMEMBERED:  # rolled reply logs' lanes come and go
                self._channels.clear()
            name = channel.encode()
            head = self._channels[channel] = b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n" % (len(name), name)
        self._outbox.append(b"%s$%d\r\n%s\r\n" % (head, len(message), message))
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self._outbox:  # written when the connection was made
            return
        transport, loop = self._transport, asyncio.get_running_loop()
        if transport is None or transport.is_closing() or self._loop is not loop:
            self._reconnect(loop)
            return
        if transport.get_write_buffer_size() > MAX_UNSENT_BYTES:  # Redis is not reading: let these go
            self._drop("Redis reads too slowly")
            return
        transport.write(b"".join(self._outbox))
        self._outbox.clear()
        self.writes += 1

    def _reconnect(self, loop: asyncio.AbstractEventLoop) -> None:
        """Connect (the outbox waits) unless a connection is being made; after a failure, only
        once ``RECONNECT_S`` has passed (the outbox is dropped meanwhile)."""
        if self._connecting is not None and self._loop is loop and not self._connecting.done():
            if len(self._outbox) > MAX_WAITING:  # the oldest go first
                self.dropped += len(self._outbox) - MAX_WAITING
                del self._outbox[:-MAX_WAITING]
            return
        if time.monotonic() < self._retry_at:
            self._drop("no connection")
            return
        if self._transport is not None and self._loop is not loop:  # made on a loop since gone
            self._transport = None
        self._loop = loop
        self._connecting = loop.create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        options = self._options
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if isinstance(options, redis.UnixDomainSocketConnection):
                    transport, _ = await loop.create_unix_connection(lambda: _Replies(self), options.path)
                else:
                    context = _tls_context(options)
                    transport, _ = await loop.create_connection(
                        lambda: _Replies(self), options.host, options.port, ssl=context,
                        server_hostname=options.host if context is not None else None)
        except Exception as exc:  # Redis away (OSError, a timeout), or the URL's TLS options wrong
            if not isinstance(exc, OSError | TimeoutError) and not self._warned:
                self._warned = True  # a setting to mend, said once; the tries go on
                log.warning("redis publish: cannot connect: %r", exc)
            self._retry_at = time.monotonic() + RECONNECT_S
            self._drop(f"connecting failed ({exc!r})")
            return
        self._transport = transport  # (uvloop's transports are not of asyncio's classes: no isinstance here)
        if options.password is not None:  # Redis answers in order: a refusal shows as errors
            credentials = (options.username.encode(),) if options.username else ()
            transport.write(command(b"AUTH", *credentials, options.password.encode()))
        transport.write(command(b"CLIENT", b"REPLY", b"OFF"))  # no answer to it either, unless refused
        if self._outbox:
            self._flush()

    def _drop(self, why: str) -> None:
        if self._outbox:
            log.debug("redis publish: %d dropped: %s; readers catch up by fetching", len(self._outbox), why)
            self.dropped += len(self._outbox)
            self._outbox.clear()

    def _lost(self, transport: asyncio.BaseTransport) -> None:
        if self._transport is transport:
            self._transport = None

    async def close(self) -> None:
        """Write what waits, then close (the socket sends what it holds first)."""
        if self._connecting is not None and self._loop is asyncio.get_running_loop():
            await asyncio.gather(self._connecting, return_exceptions=True)
        transport = self._transport
        if transport is not None and self._loop is asyncio.get_running_loop():
            if self._outbox and not transport.is_closing():
                self._flush()
            transport.close()
        self._transport = None


def _tls_context(options: redis.Connection) -> ssl.SSLContext | None:
    """The TLS context redis-py would use for this URL (``rediss://`` and its ``ssl_*`` options)."""
    if not isinstance(options, redis.SSLConnection):
        return None
    context: ssl.SSLContext = options.ssl_context.get()
    return context


class _Replies(asyncio.Protocol):
    """Reads what Redis answers, if anything, and drops it: ``+OK`` for AUTH, a count per PUBLISH
    where replies could not be turned off, or an error."""

    def __init__(self, owner: PublishConnection) -> None:
        self._owner = owner
        self._transport: asyncio.BaseTransport | None = None
        self._warned = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._owner.reply_bytes += len(data)
        # Counts are never negative: a "-" starts an error line (NOAUTH, NOPERM, WRONGPASS, ...).
        if b"-" not in data:
            return
        for line in data.split(b"\r\n"):
            if not line.startswith(b"-"):
                continue
            error = line.decode(errors="replace")
            if "client" in error.lower():  # CLIENT REPLY refused (an ACL, a renamed command): answers come
                log.debug("redis publish: replies stay on: %s", error)
            elif not self._warned:  # once a connection: every publish after a refusal is refused too
                self._warned = True
                log.warning("redis publish: Redis answered %s", error)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._owner._lost(self._transport)
