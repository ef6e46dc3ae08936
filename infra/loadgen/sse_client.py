"""Stream one completion (chat or text) from any OpenAI-compatible server and time it.

Over aiohttp, as vLLM's benchmark client is: the client's own CPU competes with the server's
where both run on one machine, and aiohttp's streaming costs a fraction of httpx's."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from tokenbus.infra.loadgen.results import RequestResult


class MalformedStream(ValueError):
    pass


def _chunk_content(data: str) -> tuple[str, dict[str, Any] | None, str]:
    """The text a chunk adds, its usage if it carries one, and its id."""
    try:
        body = json.loads(data)
    except json.JSONDecodeError:
        raise MalformedStream(f"chunk is not JSON: {data[:60]!r}") from None
    if not isinstance(body, dict):
        raise MalformedStream("chunk is not an object")
    if "error" in body:
        raise MalformedStream(f"server error in stream: {str(body['error'])[:120]}")
    choices = body.get("choices")
    if not isinstance(choices, list):
        raise MalformedStream("chunk has no choices list")
    text = ""
    for choice in choices:
        if not isinstance(choice, dict):
            raise MalformedStream("choice is not an object")
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat completions
            text += delta.get("content") or ""
        elif isinstance(choice.get("text"), str):  # text completions
            text += choice["text"]
        else:
            raise MalformedStream("choice has neither a delta nor text")
    return text, body.get("usage"), str(body.get("id") or "")


def client_session(connections: int = 100, timeout_s: float = 300.0) -> aiohttp.ClientSession:
    """A session for benchmark traffic: up to ``connections`` at once, kept alive between requests."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10))


def http_failure(status: int, body: str) -> str:
    """``HTTP 429 rate_limit_exceeded: message``: the status and, from an OpenAI error body, its
    code, so a summary can count failures by reason."""
    try:
        error = json.loads(body).get("error") or {}
    except (json.JSONDecodeError, AttributeError):
        error = {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    reason = f" {error['code']}" if isinstance(error.get("code"), str) else ""
    message = str(error.get("message") or body)[:200]
    return f"HTTP {status}{reason}: {message}"


async def stream_chat(http: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                      headers: dict[str, str] | None = None) -> RequestResult:
    """POST a streaming request; every failure (HTTP, framing, JSON) is recorded, never raised."""
    result = RequestResult()
    start = time.perf_counter()
    text: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with http.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = http_failure(response.status, (await response.read()).decode(errors="replace"))
                return result
            done = False
            async for raw in response.content:  # one line at a time
                # After [DONE] the body is still read to its end, as OpenAI's client does: a response
                # left unread may close its connection, and the next request would pay a new one.
                line = raw.decode().strip()
                if done or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                piece, chunk_usage, result.response_id = _chunk_content(data)
                usage = chunk_usage or usage
                if not piece:
                    continue
                result.chunk_arrived(time.perf_counter(), start)
                text.append(piece)
            if not done:
                raise MalformedStream("stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: MalformedStream, a line too long
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.text = "".join(text)
    result.output_tokens = int(usage["completion_tokens"]) if usage else result.chunks
    result.prompt_tokens = int(usage["prompt_tokens"]) if usage else 0
    result.cached_tokens = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    result.success = result.chunks > 0
    if not result.success:
        result.error = "MalformedStream: no content"
    return result
