"""The edge's HTTP surface with a plain HTTP client: SSE framing and OpenAI error bodies."""

import json

import httpx
import pytest

from tests.conftest import MODEL
from tokenbus.sse_edge.plumbing.framing import framing_problem

CHAT = "/v1/chat/completions"


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_sse_frames_carry_log_ids_and_end_with_done(edge_url, auth):
    body = {"model": MODEL, "stream": True, "seed": 5, "messages": [{"role": "user", "content": "hi"}]}
    sse = {**auth, "Accept": "text/event-stream"}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30, headers=sse) as http:
        async with http.stream("POST", CHAT, json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = "".join([part async for part in response.aiter_text()])
    events = [block for block in raw.split("\n\n") if block.strip()]
    assert events[-1] == "data: [DONE]"
    ids = []
    for block in events[1:-1]:
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        partition, offset = fields["id"].split("-")
        ids.append((int(partition), int(offset)))
        assert json.loads(fields["data"])["object"] == "chat.completion.chunk"
    assert "id" not in dict(line.split(": ", 1) for line in events[0].splitlines())
    assert len({p for p, _ in ids}) == 1
    offsets = [o for _, o in ids]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


@pytest.mark.parametrize(
    ("payload", "status", "param", "code"),
    [
        (b"{not json", 400, None, "invalid_json"),
        (b"[1, 2]", 400, None, "invalid_json"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages", "missing_required_parameter"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages", "invalid_value"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(), 400,
         "messages[0].content", "invalid_type"),
        (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400,
         "messages[0].role", "invalid_value"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), 400, "n",
         "invalid_value"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 129}).encode(), 400, "n",
         "too_many_choices"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2,
                     "metadata": {"conversation_id": "c1"}}).encode(), 400, "n", "invalid_value"),
        (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model",
         "model_not_found"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                     "prompt_cache_key": "k" * 65}).encode(), 400, "prompt_cache_key", "string_above_max_length"),
    ],
)
async def test_bad_requests_get_openai_error_bodies(edge_url, auth, payload, status, param, code):
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers=auth) as http:
        response = await http.post(CHAT, content=payload, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = error_of(response)
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"]


async def test_a_value_over_its_length_limit_is_refused_in_openais_words(edge_url, auth):
    """OpenAI's message and code for a string or an array over its limit, on chat and Responses."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "prompt_cache_key": "k" * 70}
    turn = {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers=auth) as http:
        long_key, many_tools = await http.post(CHAT, json=chat), await http.post("/v1/responses", json=turn)
    assert error_of(long_key) == {
        "message": "Invalid 'prompt_cache_key': string too long. Expected a string with maximum length 64, but got "
                   "a string with length 70 instead.",
        "type": "invalid_request_error", "param": "prompt_cache_key", "code": "string_above_max_length"}
    assert error_of(many_tools)["code"] == "array_above_max_length"
    assert error_of(many_tools)["message"].startswith("Invalid 'tools': array too long. Expected an array with "
                                                      "maximum length 128, but got an array with length 129")


async def test_oversized_body_is_refused(edge_url, auth):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_100_000}]}
    async with httpx.AsyncClient(base_url=edge_url, timeout=10, headers=auth) as http:
        response = await http.post(CHAT, json=big)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


async def test_unknown_path_and_method_use_the_error_format(edge_url):
    async with httpx.AsyncClient(base_url=edge_url, timeout=10) as http:
        missing = await http.get("/v1/nothing")
        wrong_method = await http.put(CHAT)  # (GET lists stored completions)
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    assert wrong_method.status_code == 405 and error_of(wrong_method)["code"] == "method_not_allowed"


async def test_healthz(edge_url):
    async with httpx.AsyncClient(base_url=edge_url, timeout=10) as http:
        response = await http.get("/healthz")
    assert response.status_code == 200 and response.json()["status"] == "ok"


@pytest.mark.parametrize(("headers", "problem"), [
    ([(b"content-length", b"3"), (b"transfer-encoding", b"chunked")], "both"),
    ([(b"content-length", b"3"), (b"content-length", b"4")], "more than once"),
    ([(b"transfer-encoding", b"gzip, chunked")], "other than chunked"),
    ([(b"content-length", b"3")], None),
    ([(b"transfer-encoding", b"Chunked")], None),
])
def test_framing_problems_are_named(headers, problem):
    found = framing_problem(headers)
    assert (found is None) if problem is None else (problem in found)

