"""Abusive HTTP on the edge, over raw sockets where an HTTP client would refuse to send it:
header injection, request smuggling, a body that never finishes, and a client that stops
reading. None may break framing, leak into a response, or hold up anyone else."""

from __future__ import annotations

import asyncio
import json
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import MODEL
from tokenbus.infra.devstack.processes import free_port
from tokenbus.infra.devstack.stack import EmbeddedStack

CHAT = "/v1/chat/completions"


async def raw_exchange(edge_url: str, request: bytes, read_timeout: float = 10.0) -> bytes:
    """Send ``request`` as is and return everything the server answers before it closes."""
    url = urlsplit(edge_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(request)
        await writer.drain()
        chunks = []
        while chunk := await asyncio.wait_for(reader.read(65536), read_timeout):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


def chat_body(content: str) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()


def post(api_key: str, body: bytes, *headers: bytes) -> bytes:
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: edge", f"Authorization: Bearer {api_key}".encode(),
             b"Content-Type: application/json", f"Content-Length: {len(body)}".encode(), *headers,
             b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def status_and_headers(response: bytes) -> tuple[int, list[bytes]]:
    head = response.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    return int(head[0].split()[1]), [line.lower() for line in head[1:]]


async def still_serves(edge_url: str, auth: dict[str, str]) -> str:
    async with httpx.AsyncClient(base_url=edge_url, headers=auth, timeout=30) as http:
        response = await http.post(CHAT, content=chat_body("after the abuse"))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("injected", "expected_status"), [
    (b"Idempotency-Key: a\rX-Injected: yes", 400),   # bare CR
    (b"Idempotency-Key: a\x00X-Injected: yes", 400),  # NUL
    (b"X-Note: a\r\n X-Injected: yes", 400),          # obsolete folding: refused (h11 joined it to X-Note)
    (b"X-Injected : yes", 400),                       # space before the colon
])
async def test_header_injection_is_refused_and_never_reaches_a_response(edge_url, auth, api_key, injected,
                                                                         expected_status):
    response = await raw_exchange(edge_url, post(api_key, chat_body("inject"), injected))
    status, headers = status_and_headers(response)
    assert status == expected_status
    assert not any(line.startswith(b"x-injected") for line in headers)
    assert response.count(b"HTTP/1.1 ") == 1
    assert await still_serves(edge_url, auth)


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: edge\r\n\r\n"


@pytest.mark.parametrize("framing", [
    lambda body: [f"Content-Length: {len(body)}".encode(), b"Transfer-Encoding: chunked"],  # CL.TE
    lambda body: [b"Transfer-Encoding: chunked", f"Content-Length: {len(body)}".encode()],  # TE.CL
    lambda body: [b"Content-Length: 5", f"Content-Length: {len(body)}".encode()],  # CL.CL
])
async def test_a_smuggled_second_request_is_not_served(edge_url, auth, api_key, framing):
    """A body that can be framed two ways gets 400 and a closed connection (the exchange reads to
    the end): the bytes after the first body never run as a request. Without the edge's guard,
    uvicorn answered CL.TE with the chat's 400 and then the smuggled GET with a 401."""
    body = b"0\r\n\r\n" + SMUGGLED
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\n"
               + f"Authorization: Bearer {api_key}\r\n".encode()
               + b"\r\n".join(framing(body)) + b"\r\nContent-Type: application/json\r\n\r\n" + body)
    response = await raw_exchange(edge_url, request, read_timeout=5)
    status, _ = status_and_headers(response)
    assert status == 400 and response.count(b"HTTP/1.1 ") == 1
    assert await still_serves(edge_url, auth)


async def test_a_body_that_never_finishes_holds_up_no_one(edge_url, auth, api_key):
    """A client announces a body and sends half of it, then stalls; other clients are served
    meanwhile, and closing the stalled connection leaves nothing behind."""
    url = urlsplit(edge_url)
    body = chat_body("never finished")
    request = post(api_key, body)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(request[: len(request) - len(body) // 2])
    await writer.drain()
    try:
        answers = await asyncio.gather(*(still_serves(edge_url, auth) for _ in range(4)))
        assert all(answers)
        assert not reader.at_eof()  # the stalled request is still waiting, not failed by the others
    finally:
        writer.close()
    assert await still_serves(edge_url, auth)


async def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(stack: EmbeddedStack, auth,
                                                                                       api_key):
    """With ``TOKENBUS_EDGE_BODY_TIMEOUT_S`` the stalled client of the test above is answered
    and let go instead of holding its connection; the edge serves the next request."""
    name, port = f"edge-body-{uuid.uuid4().hex[:4]}", free_port()
    stack.start_edge(name, port, reply_partitions="4", env={"TOKENBUS_EDGE_BODY_TIMEOUT_S": "1"})
    edge_url = f"http://127.0.0.1:{port}"
    try:
        body = chat_body("never finished")
        request = post(api_key, body)
        response = await raw_exchange(edge_url, request[: len(request) - len(body) // 2], read_timeout=10)
        status, headers = status_and_headers(response)
        assert status == 408 and b"connection: close" in headers
        assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        assert await still_serves(edge_url, auth)
    finally:
        stack.processes[name].stop()


async def test_a_client_that_stops_reading_still_gets_every_token(edge_url, auth):
    """One client pauses after its first event while others stream; when it reads again its
    text is exactly what an eager reader of the same request (same seed) gets."""
    payload = {"model": MODEL, "stream": True, "seed": 4242, "max_tokens": 40,
               "messages": [{"role": "user", "content": "read me slowly"}]}

    async def text_of(pause_after_first: asyncio.Event | None) -> str:
        parts = []
        async with httpx.AsyncClient(base_url=edge_url, headers=auth, timeout=60) as http:
            async with http.stream("POST", CHAT, json=payload) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    delta = json.loads(line[6:])["choices"]
                    parts.append(delta[0]["delta"].get("content") or "" if delta else "")
                    if pause_after_first is not None and len(parts) == 1:
                        await pause_after_first.wait()
        return "".join(parts)

    others_done = asyncio.Event()
    slow = asyncio.create_task(text_of(others_done))
    eager = await asyncio.gather(*(text_of(None) for _ in range(3)))
    assert not slow.done()  # the paused reader held up none of the eager ones
    others_done.set()
    assert await slow == eager[0] and len(set(eager)) == 1 and eager[0]
