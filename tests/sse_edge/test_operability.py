"""Readiness, metrics, the OpenAPI spec with a bounded schemathesis run, admission control,
and validation of what tokenbus does not serve."""

import asyncio
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import MODEL, UNSERVED_MODEL

CHAT = "/v1/chat/completions"


async def test_readyz_checks_broker_and_redis(edge_url):
    async with httpx.AsyncClient(base_url=edge_url, timeout=10) as http:
        body = (await http.get("/readyz")).json()
    assert body == {"status": "ready", "broker": True, "redis": True}


async def test_metrics_expose_latency_and_stream_counts(edge_url, auth):
    async with httpx.AsyncClient(base_url=edge_url, timeout=30, headers=auth) as http:
        streamed = await http.post(CHAT, json={"model": MODEL, "stream": True,
                                               "messages": [{"role": "user", "content": "m"}]})
        await http.post(CHAT, content=b"{broken")
        text = (await http.get("/metrics")).text
    for name in ("tokenbus:edge_time_to_first_token_seconds_bucket", "tokenbus:edge_inter_token_latency_seconds_bucket",
                 "tokenbus:e2e_request_latency_seconds_bucket", "tokenbus:open_streams",
                 'tokenbus:http_responses_total{status="400"}', 'tokenbus:http_responses_total{status="200"}'):
        assert name in text
    # The relay observed the stream it wrote: a first token, a gap before each later content chunk, an end.
    chunks = [line for line in streamed.text.splitlines() if '"content":"' in line and '"role"' not in line]
    counts = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name.endswith("_count")}
    assert counts["tokenbus:edge_time_to_first_token_seconds_count"] >= 1
    assert counts["tokenbus:edge_inter_token_latency_seconds_count"] >= len(chunks) - 1 >= 1
    assert counts["tokenbus:e2e_request_latency_seconds_count"] >= 1


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
         "response_format.json_schema.schema", "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"max_tokens": 100_000}, "max_tokens", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"top_k": -2}, "top_k", "invalid_value"),
        ({"min_p": 1.5}, "min_p", "invalid_value"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "invalid_value"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]", "invalid_value"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "invalid_value"),
        ({"bad_words": [" "]}, "bad_words[0]", "invalid_value"),
        ({"bad_words": ["no"] * 129}, "bad_words", "array_above_max_length"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"length_penalty": 0.5}, "length_penalty", "unsupported_parameter"),
        ({"guided_json": "{not json"}, "guided_json", "invalid_value"),
        ({"guided_regex": "[a-z"}, "guided_regex", "invalid_value"),
        ({"guided_choice": []}, "guided_choice", "invalid_value"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "invalid_value"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "invalid_value"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "invalid_value"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", "unsupported_parameter"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "unsupported_parameter"),
        ({"structured_outputs": {"json": {"type": 7}}}, "structured_outputs.json", "invalid_value"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json",
         "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}] * 300}, "messages", "too_many_messages"),
    ],
)
async def test_what_tokenbus_does_not_serve_is_refused_naming_the_param(edge_url, auth, extra, param, code):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers=auth) as http:
        response = await http.post(CHAT, json=body)
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code)


async def test_vllm_s_sampling_extensions_at_their_neutral_values_are_served(edge_url, auth):
    """What vLLM's clients send when they set nothing (``top_k: -1``, ``repetition_penalty: 1``, ...)
    asks for nothing tokenbus's engines lack."""
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "use_beam_search": False,
               "stop_token_ids": [], "include_stop_str_in_output": False, "guided_json": None}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **neutral}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30, headers=auth) as http:
        response = await http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


async def fill_until(http: httpx.AsyncClient, body: dict, done) -> httpx.Response:
    """Send ``body`` (streams left unread: their requests stay queued) until a response is ``done``."""
    for _ in range(60):
        async with http.stream("POST", CHAT, json=body) as response:
            if done(response):
                await response.aread()
                return response
        await asyncio.sleep(0.2)
    pytest.fail("the queue never filled")


async def test_a_deep_queue_is_refused_with_503_and_retry_after(stack, edge_url):
    """Nobody serves UNSERVED_MODEL, so its batch queue only grows; the stack allows 3. This key
    forbids fallback, so it gets no other model."""
    key = await stack.create_key("queued", "batch", fallback=False)
    body = {"model": UNSERVED_MODEL, "stream": True, "messages": [{"role": "user", "content": "wait"}]}
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers={"Authorization": f"Bearer {key}"}) as http:
        refused = await fill_until(http, body, lambda r: r.status_code == 503)
    assert refused.json()["error"]["code"] == "overloaded" and int(refused.headers["retry-after"]) >= 1


async def test_a_full_queue_falls_back_to_the_smaller_model_which_serves_and_bills_it(stack, edge_url):
    """TOKENBUS_EDGE_FALLBACK sends UNSERVED_MODEL's requests to MODEL once its batch queue is full."""
    key = await stack.create_key("fallen-back", "batch")
    body = {"model": UNSERVED_MODEL, "stream": True, "messages": [{"role": "user", "content": "anyone?"}]}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as http:
        served = await fill_until(http, body, lambda r: r.headers.get("x-tokenbus-fallback-from") == UNSERVED_MODEL)
        assert served.status_code == 200 and served.headers["x-tokenbus-model"] == MODEL
        chunks = [json.loads(line[6:]) for line in served.text.splitlines() if line.startswith("data: {")]
        assert chunks and {c["model"] for c in chunks} == {MODEL}
        assert served.text.rstrip().endswith("data: [DONE]")

        plain = await http.post(CHAT, json={**body, "stream": False})
        assert plain.json()["model"] == MODEL and plain.headers["x-tokenbus-fallback-from"] == UNSERVED_MODEL

        for _ in range(100):  # billed under the model that served it, once the billing batch is written
            rows = (await http.get("/v1/usage")).json()["data"]
            if sum(r.get("requests", 0) for r in rows) >= 2:
                break
            await asyncio.sleep(0.2)
    assert rows and {r["model"] for r in rows} == {MODEL}


async def test_under_load_a_tier_sheds_requests_with_tools(stack, edge_url):
    """The stack sheds tools on the interactive tier from a queue depth of 2 (TOKENBUS_EDGE_SHED_TOOLS_AT);
    requests without tools still go in."""
    key = await stack.create_key("shedding", "interactive", fallback=False)
    body = {"model": UNSERVED_MODEL, "stream": True, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    plain = {k: v for k, v in body.items() if k != "tools"}
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers={"Authorization": f"Bearer {key}"}) as http:
        shed = await fill_until(http, body, lambda r: r.status_code == 503)
        async with http.stream("POST", CHAT, json=plain) as without_tools:
            assert without_tools.status_code == 200
    error = shed.json()["error"]
    assert error["code"] == "tools_shed_under_load" and "without them" in error["message"]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


def test_api_never_fails_or_breaks_its_schema(edge_url, auth):
    """Bounded schemathesis run over every operation in /openapi.json: no 5xx, and every response
    is one the spec describes. (Driven through hypothesis directly: schemathesis' pytest plugin
    does not run under pytest 9.)"""
    schema = schemathesis.openapi.from_url(f"{edge_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models",
                                             "/readyz"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, suppress_health_check=list(HealthCheck), database=None)
        def run(case):
            case.call_and_validate(headers=auth, timeout=30, checks=CHECKS)

        run()
