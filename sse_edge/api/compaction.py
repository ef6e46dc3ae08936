"""``POST /v1/responses/compact``: OpenAI's compaction of a long context into one item.

What is compacted is a request's ``input``, the chain ``previous_response_id`` ends, or both (the
chain first). The model asked for summarizes it in one turn on the bus, admitted and billed as any
turn (its usage is the compacted response's); the answer is every user message, as it was, then a
``compaction`` item holding the summary (protocol/compaction.py), which the client gives back as
the input of its next turn in place of what it compacted. Nothing is stored."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.sse_edge.api.chat import check_model, start_turn, to_bus_request
from tokenbus.sse_edge.api.responses import previous_turns
from tokenbus.sse_edge.errors import ApiError, InvalidRequest
from tokenbus.sse_edge.plumbing.relay import collect_choices
from tokenbus.sse_edge.plumbing.response_relay import Ending
from tokenbus.sse_edge.plumbing.summaries import transcript
from tokenbus.sse_edge.protocol.compaction import INSTRUCTION, CompactRequest, compacted_object
from tokenbus.sse_edge.protocol.responses import bus_messages, parse_input_items
from tokenbus.sse_edge.protocol.validation import body_hash, chat_request_of, json_object, parse_body, read_body
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.responses import new_response_id


async def compact_response(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked = parse_body(json_object(raw), CompactRequest)
    if asked.input is None and asked.previous_response_id is None:
        raise InvalidRequest("Give the 'input' to compact, or the 'previous_response_id' whose turns to compact.",
                             param="input", code="missing_required_parameter")
    items = [] if asked.input is None else parse_input_items(asked.input)
    asked.model = edge.settings.served_model(asked.model)
    check_model(edge, key, asked.model)
    earlier, conversation = await previous_turns(edge, key, None, asked.previous_response_id)
    compacted = [*(m for turn in earlier for m in turn.messages), *bus_messages(asked.instructions, items)]
    try:
        chat = chat_request_of({"model": asked.model, "seed": asked.seed,
                                "max_completion_tokens": edge.settings.history_summary_max_tokens,
                                "messages": [{"role": "system", "content": INSTRUCTION},
                                             {"role": "user", "content": transcript(compacted)}]}, edge.settings)
    except ApiError as exc:  # (the summarizing request is the edge's: what it refuses is the context given)
        exc.param = "input"
        raise
    response_id = new_response_id()
    bus_request = to_bus_request(chat, edge, key, response_id)
    bus_request.conversation_id = conversation  # (a chain's: to the GPU consumer holding its prefix)
    edge.context.check_messages(chat.model, bus_request.messages, chat.token_limit, param="input")
    turn = await start_turn(request, edge, key, [bus_request], include_usage=True, digest=body_hash(raw))
    [choice] = await collect_choices(request, turn.events, turn.choices, turn.hooks)
    ending = Ending.of(choice.final)
    if ending.failure is not None:
        raise ending.failure
    user_texts = [m.content for m in compacted if m.role == "user"]
    body = compacted_object(response_id, int(time.time()), user_texts, choice.text, ending.usage)
    return JSONResponse(body, headers=turn.headers)
