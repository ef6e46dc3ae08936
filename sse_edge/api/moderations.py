"""``POST /v1/moderations``: OpenAI's moderation endpoint, answered with the edge's moderation
policy (``TOKENBUS_MODERATION_POLICY_FILE``), the one every prompt on the bus is reviewed with:
a client can ask beforehand what the pipeline would do with a text. Each input is scanned as a
prompt (the input stage) and decided for the key's tier; ``flagged`` when that decision is not
``allow``, and ``action`` says which (an addition OpenAI's shape does not have). Nothing is
published, stored or logged; a call counts against the key's and tenant's requests per minute."""

from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenbus.moderation import INPUT
from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.sse_edge.protocol.moderations import INPUTS_MAX, ModerationRequest, result_body
from tokenbus.sse_edge.protocol.validation import json_object, parse_body, read_body
from tokenbus.sse_edge.state import EdgeState


async def moderations(request: Request) -> Response:
    edge: EdgeState = request.app.state.edge
    key = await edge.auth.authenticate(request.headers.get("authorization"))
    raw = await read_body(request, edge.settings.max_body_bytes, edge.settings.body_timeout_s)
    asked = parse_body(json_object(raw), ModerationRequest)
    texts = asked.texts
    if not 1 <= len(texts) <= INPUTS_MAX:
        raise InvalidRequest(f"Ask about 1 to {INPUTS_MAX} texts at once.", param="input", code="invalid_value")
    if sum(len(text) for text in texts) > edge.settings.max_prompt_chars:
        raise InvalidRequest(f"The input is longer than {edge.settings.max_prompt_chars} characters.", param="input",
                             code="string_above_max_length")
    headers = await edge.admission.admit_call(key)
    policy = edge.policy
    results = [result_body(policy, policy.decide(policy.scan(text, INPUT), key.tier, INPUT)) for text in texts]
    return JSONResponse({"id": f"modr-{secrets.token_hex(12)}", "model": asked.model or policy.name,
                         "results": results}, headers=headers)
