"""Redis PUBLISH that nobody waits for (topics/publish_connection.py), against real redis-server
processes started for each case: one with a password, one on a unix socket, one behind TLS, one
that goes away and comes back; and a server that never reads, for the bound on what waits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as redis

from tests.waiting import wait_for
from tokenbus.infra.devstack.processes import free_port
from tokenbus.topics import publish_connection
from tokenbus.topics.event_loops import loop_factory
from tokenbus.topics.publish_connection import PublishConnection

CHANNEL = "tokenbus:test:publish"


@contextlib.contextmanager
def redis_server(tmp_path: Path, url: str, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    """A redis-server with ``options``, answering at ``url``."""
    server = shutil.which("redis-server")
    assert server, "redis-server is installed with the embedded stack (tokenbus doctor --install)"
    process = subprocess.Popen([server, "--save", "", "--appendonly", "no", "--dir", str(tmp_path), *options],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with contextlib.suppress(sync_redis.RedisError, OSError):
                if sync_redis.Redis.from_url(url, socket_connect_timeout=0.5).ping():
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server {options} did not answer at {url}")
        yield process
    finally:
        process.terminate()
        process.wait(10)


@contextlib.asynccontextmanager
async def subscribed(url: str) -> AsyncIterator[list[bytes]]:
    """What is published on CHANNEL while inside, in order."""
    got: list[bytes] = []
    client = redis.Redis.from_url(url)
    async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
        await pubsub.subscribe(CHANNEL)

        async def read() -> None:
            async for message in pubsub.listen():
                got.append(message["data"])

        reading = asyncio.create_task(read())
        try:
            yield got
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
    await client.aclose()


async def published(url: str, messages: list[bytes], subscriber_url: str | None = None,
                    ) -> tuple[list[bytes], PublishConnection]:
    """Publish ``messages`` in one pass through a PublishConnection to ``url``: what a subscriber
    heard, and the connection (closed)."""
    connection = PublishConnection(url)
    async with subscribed(subscriber_url or url) as got:
        for message in messages:
            connection.publish(CHANNEL, message)
        deadline = time.monotonic() + 3  # a refused publish never comes: the time left is the wait for it
        while len(got) < len(messages) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # nor any more
        await connection.close()
    return got, connection


async def test_publishes_of_one_pass_go_in_one_write_in_order_to_the_stack_redis(bus):
    messages = [b"m%d" % i for i in range(20)] + [b"", bytes(range(256)) * 40]  # empty, binary, 10 KB
    assert bus.doorbell_url
    got, connection = await published(bus.doorbell_url, messages)
    assert got == messages
    assert (connection.writes, connection.dropped) == (1, 0)
    assert connection.reply_bytes == 0  # Redis was asked not to answer, and did not


async def test_where_replies_cannot_be_turned_off_they_are_read_and_dropped(tmp_path, caplog):
    """A managed Redis may refuse the CLIENT commands (here an ACL refuses CLIENT REPLY): Redis
    then answers every PUBLISH, and the connection reads the answers and carries on."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with redis_server(tmp_path, url, "--port", str(port), "--bind", "127.0.0.1"):
        sync_redis.Redis.from_url(url).execute_command("ACL", "SETUSER", "default", "-client|reply")
        with caplog.at_level(logging.DEBUG, logger=publish_connection.__name__):
            got, connection = await published(url, [b"one", b"two", b"three"])
    assert got == [b"one", b"two", b"three"]
    assert connection.reply_bytes > 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("replies stay on" in r.getMessage() for r in caplog.records)


async def test_a_password_in_the_url_is_sent_and_a_wrong_one_is_logged_not_raised(tmp_path, caplog):
    port = free_port()
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    with redis_server(tmp_path, url, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "s3cret"):
        assert (await published(url, [b"one", b"two"]))[0] == [b"one", b"two"]
        with caplog.at_level(logging.WARNING, logger=publish_connection.__name__):
            refused, _ = await published(f"redis://:wrong@127.0.0.1:{port}/0", [b"three"], subscriber_url=url)
    assert refused == []
    assert any("WRONGPASS" in r.getMessage() or "ERR" in r.getMessage() for r in caplog.records)


async def test_a_unix_socket_url(tmp_path):
    socket = tmp_path / "redis.sock"
    url = f"unix://{socket}"
    with redis_server(tmp_path, url, "--port", "0", "--unixsocket", str(socket)):
        assert (await published(url, [b"over", b"a socket"]))[0] == [b"over", b"a socket"]


async def test_a_tls_url_with_its_options_as_redis_py_reads_them(tmp_path):
    import trustme

    authority = trustme.CA()  # a certificate authority of the test's own, and a certificate for 127.0.0.1
    served = authority.issue_cert("127.0.0.1")
    cert, key, ca = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    served.cert_chain_pems[0].write_to_path(str(cert))
    served.private_key_pem.write_to_path(str(key))
    authority.cert_pem.write_to_path(str(ca))
    port = free_port()
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    with redis_server(tmp_path, url, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                      "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                      "--tls-auth-clients", "no"):
        assert (await published(url, [b"sealed"]))[0] == [b"sealed"]


async def test_publishes_while_redis_is_away_are_dropped_and_counted_then_it_reconnects(tmp_path, monkeypatch):
    monkeypatch.setattr(publish_connection, "RECONNECT_S", 0.2)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    connection = PublishConnection(url)
    with redis_server(tmp_path, url, "--port", str(port), "--bind", "127.0.0.1"):
        async with subscribed(url) as got:
            connection.publish(CHANNEL, b"before")
            await wait_for(lambda: got == [b"before"], 5, "the message before")
    for _ in range(50):  # the connection is found gone, and what is published meanwhile dropped
        connection.publish(CHANNEL, b"away")
        await asyncio.sleep(0.02)
    assert connection.dropped > 0
    with redis_server(tmp_path, url, "--port", str(port), "--bind", "127.0.0.1"):
        async with subscribed(url) as got:
            await asyncio.sleep(publish_connection.RECONNECT_S)
            connection.publish(CHANNEL, b"back")
            await wait_for(lambda: got == [b"back"], 5, "the message after")
        await connection.close()


async def test_a_redis_that_does_not_read_gets_a_bounded_buffer_and_the_rest_is_dropped(monkeypatch):
    monkeypatch.setattr(publish_connection, "MAX_UNSENT_BYTES", 256 * 1024)
    held: list[asyncio.StreamWriter] = []

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # the connection stays open, and nothing is read from it

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = PublishConnection(f"redis://127.0.0.1:{port}/0")
    try:
        message = bytes(64 * 1024)
        for _ in range(400):  # 25 MB offered, more than the socket's buffers take
            connection.publish(CHANNEL, message)
            await asyncio.sleep(0)
            if connection.dropped:
                break
        assert connection.dropped > 0
        transport = connection._transport
        assert transport is not None
        assert transport.get_write_buffer_size() <= publish_connection.MAX_UNSENT_BYTES + len(message) + 100
    finally:
        await connection.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_used_from_one_event_loop_then_another_it_connects_again(bus, loop):
    """A process that runs event loops in turn (a benchmark's phases); on uvloop too, as the services run."""
    assert bus.doorbell_url
    connection = PublishConnection(bus.doorbell_url)

    async def publish(message: bytes) -> list[bytes]:
        assert bus.doorbell_url
        async with subscribed(bus.doorbell_url) as got:
            connection.publish(CHANNEL, message)
            await wait_for(lambda: got == [message], 5, "the message")
        # On a connection of this loop: a write on a dead loop's transport may even go out (while
        # its buffer is empty), but nothing reads that connection's replies any more.
        assert connection._transport is not None and connection._loop is asyncio.get_running_loop()
        return got

    for message in (b"first loop", b"second loop"):
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            assert runner.run(publish(message)) == [message]
            if message == b"second loop":
                runner.run(connection.close())
    assert (connection.dropped, connection.reply_bytes) == (0, 0)
