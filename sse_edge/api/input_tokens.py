"""``POST /v1/responses/input_tokens``: the input tokens a Responses turn would be prompted with,
counted without running it (OpenAI's input token count).

What is counted is what the turn would send: its instructions, input and tools, after the turns
of the conversation object or the chain it continues (with ``truncation: "auto"``, only those that
fit the model's context window, as the turn would keep them). Counted as the edge counts a prompt
against the context window: with the model's tokenizer where the edge has it
(``TOKENBUS_EDGE_TOKENIZERS``), each message's and tool's text plus a few tokens for the template
around it; otherwise by the estimate (about four characters a token). That is a figure to plan
with (whether a turn fits, when to compact); a response's ``usage`` is the engine's exact count.
Nothing is published, stored or billed."""

from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.schemas import ToolSpec
from tokenbus.sse_edge.api.chat import check_model
from tokenbus.sse_edge.api.responses import previous_turns
from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.sse_edge.plumbing.history import History
from tokenbus.sse_edge.protocol.responses import InputTokensRequest, bus_messages, function_tools, parse_input_items
from tokenbus.sse_edge.protocol.validation import json_object, parse_body, read_body
from tokenbus.sse_edge.state import EdgeState


async def count_input_tokens(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked = parse_body(json_object(raw), InputTokensRequest)
    items = [] if asked.input is None else parse_input_items(asked.input)
    tools = [ToolSpec.of(t.name, t.description, t.parameters) for t in function_tools(asked.tools)]
    asked.model = edge.settings.served_model(asked.model)
    check_model(edge, key, asked.model)
    earlier, _ = await previous_turns(edge, key, asked.conversation_id, asked.previous_response_id)
    own = bus_messages(asked.instructions, items)
    prompt = [*own, *(m for turn in earlier for m in turn.messages)]
    if earlier and asked.truncation == "auto" and edge.context.limits(asked.model):
        with contextlib.suppress(InvalidRequest):  # (its own input does not fit: everything is counted)
            prompt, _ = edge.context.with_history(asked.model, own, History(earlier), None)
    tokens = edge.context.count(asked.model, prompt) + edge.context.count_texts(asked.model, [t.text for t in tools])
    return JSONResponse({"object": "response.input_tokens", "input_tokens": tokens})
