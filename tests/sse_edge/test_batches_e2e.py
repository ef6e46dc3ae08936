"""OpenAI's Files and Batch APIs through the real embedded stack, with the official openai
client: a batch file's requests run on the bus at the batch tier, the batches processor keeps
each one's outcome, and the output file holds exactly what the engine answers each line, in line
order; bad files fail whole, naming their lines; a cancelled batch ends with what was answered;
no tenant sees another's files or batches."""

import json
import time
import uuid

import httpx
import openai
import pytest

from tests.conftest import MODEL, SLOW_MODEL, UNSERVED_MODEL
from tests.expected import expected_output
from tests.stream_processors.helpers import eventually
from tokenbus.stores.batches import IN_PROGRESS, Batch, BatchStore, new_batch_id
from tokenbus.stores.keys import parse_key_id
from tokenbus.stores.redis_client import redis_client

pytestmark = pytest.mark.stack


def client_of(edge_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture
async def tenant_key(stack):
    return await stack.create_key(f"batch-{uuid.uuid4().hex[:6]}", "interactive")


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, content: str, seed: int, model: str = MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "seed": seed,
                     "max_tokens": 30, **body}}


async def ended(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60.0):
    async def check():
        batch = await client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    return await eventually(check, timeout=timeout)


def lines_of(content: bytes) -> list[dict]:
    return [json.loads(line) for line in content.decode().splitlines()]


async def test_a_batch_s_output_is_the_engine_s_answer_to_each_line_in_line_order(edge_url, tenant_key):
    client = client_of(edge_url, tenant_key)
    asked = [("rivers", "name three rivers", 11), ("seas", "name two seas", 12), ("lakes", "name a lake", 13)]
    uploaded = await client.files.create(file=("nightly.jsonl", jsonl([chat_line(*a) for a in asked])),
                                         purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.filename == "nightly.jsonl" and uploaded.bytes > 0
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 3 and batch.metadata == {"job": "nightly"}

    done = await ended(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None and done.model == MODEL
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    assert done.in_progress_at <= done.finalizing_at <= done.completed_at
    output = lines_of((await client.files.content(done.output_file_id)).content)
    assert [line["custom_id"] for line in output] == ["rivers", "seas", "lakes"]
    for line, (_, content, seed) in zip(output, asked, strict=True):
        want = await expected_output([{"role": "user", "content": content}], seed=seed, max_tokens=30)
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == (
            want.text, want.finish_reason)
        assert body["usage"]["completion_tokens"] == want.completion_tokens
        assert line["response"]["request_id"] == body["id"] == f"{batch.id}-{output.index(line)}"
    bodies = [line["response"]["body"] for line in output]
    assert done.usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert done.usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == [batch.id]

    async def billed():  # at the batch tier (the key's own is interactive), every line once
        async with httpx.AsyncClient(timeout=30) as http:
            usage = await http.get(f"{edge_url}/v1/usage", params={"bucket": "day"},
                                   headers={"Authorization": f"Bearer {tenant_key}"})
        rows = usage.json()["data"] if usage.status_code == 200 else []
        return rows if sum(r["requests"] for r in rows) == 3 else None

    rows = await eventually(billed)
    assert {r["tier"] for r in rows} == {"batch"}
    assert sum(r["completion_tokens"] for r in rows) == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    files = {f.id: f.purpose for f in (await client.files.list()).data}
    assert files == {uploaded.id: "batch", done.output_file_id: "batch_output"}


async def test_a_batch_whose_edge_stopped_publishing_it_is_published_by_the_next_edge_asked(stack, edge_url,
                                                                                               tenant_key):
    """As an edge killed before it published a batch's first window leaves it: stored, in
    progress, nothing published, its published count a minute old. The next edge asked about it
    takes the publishing over, and the batch completes with every line answered."""
    client = client_of(edge_url, tenant_key)
    asked = [("a", "name a river", 21), ("b", "name a sea", 22), ("c", "name a lake", 23)]
    uploaded = await client.files.create(file=("resumed.jsonl", jsonl([chat_line(*a) for a in asked])), purpose="batch")
    async with httpx.AsyncClient(timeout=30) as http:
        tenant = (await http.get(f"{edge_url}/v1/keys/self", headers={"Authorization": f"Bearer {tenant_key}"})).json()
    redis = redis_client(stack.settings.redis_url)
    batches = BatchStore(redis, stack.settings.redis_prefix)
    then = int(time.time()) - 120
    stopped = Batch(new_batch_id(), tenant["tenant"], "/v1/chat/completions", uploaded.id, "24h", IN_PROGRESS, then,
                    then + 86_400, total=3, model=MODEL, key_id=parse_key_id(tenant_key), published=0,
                    published_at_ms=then * 1000, times={IN_PROGRESS: then})
    await batches.create(stopped)
    done = await ended(client, stopped.id)
    await redis.aclose()
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    output = lines_of((await client.files.content(done.output_file_id)).content)
    assert [line["custom_id"] for line in output] == ["a", "b", "c"]
    for line, (_, content, seed) in zip(output, asked, strict=True):
        want = await expected_output([{"role": "user", "content": content}], seed=seed, max_tokens=30)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == want.text


async def test_a_text_completion_batch_answers_in_text_completion_shapes(edge_url, tenant_key):
    client = client_of(edge_url, tenant_key)
    prompts = ["Once upon a time the bus carried", "The consumer read the partition"]
    lines = [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": prompt, "seed": 5, "max_tokens": 20}} for i, prompt in enumerate(prompts)]
    uploaded = await client.files.create(file=("prompts.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    done = await ended(client, batch.id)
    output = lines_of((await client.files.content(done.output_file_id)).content)
    for line, prompt in zip(output, prompts, strict=True):
        want = await expected_output([{"role": "user", "content": prompt}], seed=5, max_tokens=20, text_prompt=True)
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == want.text


async def test_a_file_with_bad_lines_fails_whole_and_names_them(edge_url, tenant_key):
    client = client_of(edge_url, tenant_key)
    lines = [
        json.dumps(chat_line("ok", "fine", 1)),
        "{not json",
        json.dumps({**chat_line("wrong-url", "x", 1), "url": "/v1/embeddings"}),
        json.dumps(chat_line("ok", "the same custom_id again", 2)),
        json.dumps(chat_line("streamed", "x", 1, stream=True)),
        json.dumps(chat_line("nobody", "x", 1, model="no-such-model")),
        json.dumps(chat_line("too-hot", "x", 1, temperature=7)),
        json.dumps(chat_line("echoed", "x", 1, echo=True)),
    ]
    uploaded = await client.files.create(file=("bad.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.request_counts.total == 0
    errors = {e.line: (e.code, e.param) for e in batch.errors.data}
    assert set(errors) == {2, 3, 4, 5, 6, 7, 8}
    assert errors[3] == ("invalid_url", "url") and errors[4] == ("duplicate_custom_id", "custom_id")
    assert errors[5] == ("invalid_value", "body.stream") and errors[6][0] == "model_not_found"
    assert errors[7][1] == "temperature" and errors[8] == ("invalid_value", "body.echo")
    assert (await client.batches.retrieve(batch.id)).status == "failed"

    with pytest.raises(openai.NotFoundError) as missing:
        await client.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/chat/completions",
                                    completion_window="24h")
    assert missing.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="1h")  # the one window is 24h
    assert refused.value.body["param"] == "completion_window"


async def test_a_cancelled_batch_ends_with_what_was_answered_and_the_rest_cancelled(edge_url, tenant_key):
    client = client_of(edge_url, tenant_key)
    # Long answers (250 tokens at 50/s): most lines are still waiting or running when it is cancelled.
    lines = [chat_line(f"slow-{i}", f"tell a long story {i}", i, model=SLOW_MODEL, max_tokens=250) for i in range(8)]
    uploaded = await client.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    assert batch.status == "in_progress", batch.errors
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await ended(client, batch.id)
    assert done.status == "cancelled" and done.cancelling_at is not None and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == 8 and counts.completed + counts.failed == 8 and counts.failed >= 1
    errors = lines_of((await client.files.content(done.error_file_id)).content)
    assert len(errors) == counts.failed
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert {line["custom_id"] for line in errors} <= {f"slow-{i}" for i in range(8)}
    with pytest.raises(openai.ConflictError):
        await client.batches.cancel(batch.id)  # ended: nothing to cancel


async def test_no_tenant_sees_another_s_files_or_batches(stack, edge_url, tenant_key):
    owner = client_of(edge_url, tenant_key)
    stranger = client_of(edge_url, await stack.create_key(f"stranger-{uuid.uuid4().hex[:6]}", "standard"))
    uploaded = await owner.files.create(file=("mine.jsonl", jsonl([chat_line("a", "x", 1, model=UNSERVED_MODEL)])),
                                        purpose="batch")
    batch = await owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")
    for call in (lambda: stranger.files.retrieve(uploaded.id), lambda: stranger.files.content(uploaded.id),
                 lambda: stranger.files.delete(uploaded.id), lambda: stranger.batches.retrieve(batch.id),
                 lambda: stranger.batches.cancel(batch.id),
                 lambda: stranger.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert (await stranger.files.list()).data == [] and (await stranger.batches.list()).data == []
    assert (await owner.batches.retrieve(batch.id)).status == "in_progress"  # nobody serves that model
    deleted = await owner.files.delete(uploaded.id)
    assert deleted.deleted and [f.id for f in (await owner.files.list()).data] == []


async def test_uploads_that_are_not_a_batch_file_get_clear_errors(edge_url, tenant_key):
    auth = {"Authorization": f"Bearer {tenant_key}"}
    async with httpx.AsyncClient(base_url=f"{edge_url}/v1", headers=auth, timeout=30) as http:
        wrong_purpose = await http.post("/files", data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", b"{}")})
        no_file = await http.post("/files", data={"purpose": "batch"}, files={"other": ("a.jsonl", b"{}")})
        not_a_form = await http.post("/files", json={"purpose": "batch"})
        unknown = await http.get("/files/file-" + "f" * 24)
        bad_limit = await http.get("/batches", params={"limit": "0"})
    assert (wrong_purpose.status_code, wrong_purpose.json()["error"]["code"]) == (400, "invalid_purpose")
    assert (no_file.status_code, no_file.json()["error"]["param"]) == (400, "file")
    assert (not_a_form.status_code, not_a_form.json()["error"]["code"]) == (400, "invalid_content_type")
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "file_not_found")
    assert (bad_limit.status_code, bad_limit.json()["error"]["param"]) == (400, "limit")


async def test_files_and_batches_page_with_after_cursors(edge_url, tenant_key):
    client = client_of(edge_url, tenant_key)
    made = [(await client.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose="batch")).id for i in range(3)]
    first = await client.files.list(limit=2)
    assert [f.id for f in first.data] == made[:0:-1] and first.has_more  # newest first
    rest = await client.files.list(limit=2, after=first.data[-1].id)
    assert [f.id for f in rest.data] == made[:1] and not rest.has_more
    oldest_first = await client.files.list(order="asc")
    assert [f.id for f in oldest_first.data] == made
    every = [f.id async for f in client.files.list(limit=1)]  # the client's auto-paging follows the cursor
    assert every == made[::-1]
    async with httpx.AsyncClient(timeout=30) as http:
        unknown = await http.get(f"{edge_url}/v1/files", params={"after": "file-" + "0" * 24},
                                 headers={"Authorization": f"Bearer {tenant_key}"})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (400, "invalid_cursor")
