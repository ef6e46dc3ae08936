"""A reference OpenAI-compatible streaming server with known timings, to prove the
load generator measures correctly.

It serves ``/v1/chat/completions`` and ``/v1/completions``, waits ``ttft_ms`` before the
first content chunk and ``gap_ms`` between chunks, one word per chunk, ``max_tokens`` words.
The model name picks a failure to inject: ``malformed-json``, ``no-done``, ``error-event``,
``http-500``, ``cut`` (connection dropped mid-stream); any other name streams normally.

``GET /timings`` lists, for the latest ``KEPT_TIMINGS`` streams it finished, the times it
actually kept, in ms from the request's arrival: ``ttft_ms`` (first content chunk) and
``chunks_ms`` (every content chunk). A busy machine stretches its sleeps, so a harness is
judged against these, not against the injected values alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import deque
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

KEPT_TIMINGS = 10_000  # the latest streams' timings; a long benchmark run does not grow it further


def _chunk(model: str, content: str | None, finish: str | None = None, usage: dict | None = None,
           chat: bool = True) -> str:
    if usage:
        choices = []
    elif chat:
        choices = [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": content or "", "finish_reason": finish}]
    body: dict[str, Any] = {"id": "ref", "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": model, "choices": choices}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def reference_app(ttft_ms: float, gap_ms: float) -> Starlette:
    timings: deque[dict[str, Any]] = deque(maxlen=KEPT_TIMINGS)

    async def complete(request: Request) -> Response:
        arrived = time.perf_counter()
        chat = request.url.path.endswith("/chat/completions")
        body = await request.json()
        model, tokens = body.get("model", ""), int(body.get("max_tokens") or 16)
        if model == "http-500":
            return JSONResponse({"error": {"message": "injected", "type": "server_error", "param": None,
                                           "code": "injected_failure"}}, 500)

        async def frames():
            chunks_ms: list[float] = []
            if chat:
                yield _chunk(model, None).replace('"delta": {}', '"delta": {"role": "assistant"}')
            await asyncio.sleep(ttft_ms / 1000)
            for i in range(tokens):
                if i:
                    await asyncio.sleep(gap_ms / 1000)
                if model == "malformed-json" and i == tokens // 2:
                    yield "data: {this is not json\n\n"
                    return
                if model == "error-event" and i == tokens // 2:
                    yield 'data: {"error": {"message": "injected", "type": "server_error"}}\n\n'
                    return
                if model == "cut" and i == tokens // 2:
                    raise RuntimeError("injected connection drop")
                chunks_ms.append((time.perf_counter() - arrived) * 1000)
                yield _chunk(model, f"w{i} ", "length" if i == tokens - 1 else None, chat=chat)
            yield _chunk(model, None, usage={"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3})
            if model != "no-done":
                yield "data: [DONE]\n\n"
            if chunks_ms:
                timings.append({"model": model, "ttft_ms": chunks_ms[0], "chunks_ms": chunks_ms})

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def kept_timings(request: Request) -> Response:
        return JSONResponse(list(timings))

    return Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"]),
                             Route("/timings", kept_timings)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--ttft-ms", type=float, default=50)
    parser.add_argument("--gap-ms", type=float, default=10)
    args = parser.parse_args()
    uvicorn.run(reference_app(args.ttft_ms, args.gap_ms), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
