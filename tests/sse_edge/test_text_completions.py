"""Text completions (OpenAI's legacy ``/v1/completions``) through the real embedded stack, with the
official openai package and vLLM's benchmark command line: the prompt is continued as it is (the
stack's simulated engine counts its words alone, no chat template), in ``text_completion`` shapes."""

import asyncio
import json
import subprocess
import sys
import uuid

import httpx
import openai
import pytest

from tests.conftest import MODEL, SLOW_MODEL
from tests.expected import expected_output
from tests.gpu_consumers.tiny_model import build_tiny_model
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY
from tokenbus.infra.devstack.processes import free_port

PROMPT = "Once upon a time the bus carried"


@pytest.fixture
def client(edge_url, api_key):
    return openai.AsyncOpenAI(base_url=f"{edge_url}/v1", api_key=api_key, max_retries=0, timeout=60)


async def expected(prompt: str, seed: int, max_tokens: int | None = None):
    return await expected_output([{"role": "user", "content": prompt}], seed=seed, max_tokens=max_tokens,
                                 text_prompt=True)


async def transcript(http: httpx.AsyncClient, request_id: str, auth: dict[str, str]) -> list[dict]:
    """The turn's stored messages, once the assistant's is there (the transcript writer is a
    stream processor: a moment behind the stream)."""
    for _ in range(100):
        rows = (await http.get(f"/v1/conversations/{request_id}/messages", headers=auth)).json().get("data", [])
        if any(r["role"] == "assistant" for r in rows):
            return rows
        await asyncio.sleep(0.1)
    return rows


async def stream_one(client, i: int) -> list:
    stream = await client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", seed=i, max_tokens=40, stream=True,
                                             stream_options={"include_usage": True})
    return [chunk async for chunk in stream]


async def test_streamed_and_plain_text_completions_are_exact(client):
    streamed = await asyncio.gather(*(stream_one(client, i) for i in range(4)))
    plain = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=[f"{PROMPT} {i}"], seed=i,
                                                             max_tokens=40) for i in range(4)))
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"{PROMPT} 0"}],
                                                seed=0, max_tokens=40)
    for i, (chunks, completion) in enumerate(zip(streamed, plain)):
        want = await expected(f"{PROMPT} {i}", seed=i, max_tokens=40)
        assert {c.object for c in chunks} == {"text_completion"} and len({c.id for c in chunks}) == 1
        assert chunks[0].id.startswith("cmpl-")
        pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert pieces == want.pieces  # no role chunk before them, nothing lost or repeated
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            [want.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens
        assert chunks[-1].usage.prompt_tokens == want.prompt_tokens == len(f"{PROMPT} {i}".split())
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        assert completion.choices[0].text == want.text and completion.choices[0].finish_reason == want.finish_reason
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == \
            (want.prompt_tokens, want.completion_tokens)
    assert chat.usage.prompt_tokens > plain[0].usage.prompt_tokens  # the chat template's markup


async def test_max_tokens_defaults_to_sixteen_as_openai_s(client):
    completion = await client.completions.create(model=MODEL, prompt=PROMPT, seed=31)
    want = await expected(PROMPT, seed=31, max_tokens=16)
    assert completion.choices[0].text == want.text and completion.usage.completion_tokens == want.completion_tokens
    assert want.completion_tokens == 16 and completion.choices[0].finish_reason == "length"


async def test_stop_sequences_end_the_text_before_them(client):
    full = await client.completions.create(model=MODEL, prompt=PROMPT, seed=32, max_tokens=60)
    words = full.choices[0].text.split()
    stop = words[len(words) // 2]
    cut = await client.completions.create(model=MODEL, prompt=PROMPT, seed=32, max_tokens=60, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.choices[0].text.startswith(cut.choices[0].text)
    # vLLM's include_stop_str_in_output: the stop that ended it stays, streamed or not.
    kept = await client.completions.create(model=MODEL, prompt=PROMPT, seed=32, max_tokens=60, stop=[stop],
                                           extra_body={"include_stop_str_in_output": True})
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, seed=32, max_tokens=60, stop=[stop],
                                             stream=True, extra_body={"include_stop_str_in_output": True})
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert kept.choices[0].text == streamed == cut.choices[0].text + stop and kept.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"prompt": [1, 2, 3]}, "prompt", "unsupported_value"),  # this edge has no tokenizer to read them with
    ({"prompt": [[1, 2], [3]]}, "prompt", "unsupported_value"),
    ({"prompt": ["one", ""]}, "prompt", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": [[]]}, "prompt", "invalid_value"),
    ({"prompt": [5, -1]}, "prompt", "invalid_value"),
    ({"prompt": [2**31]}, "prompt", "invalid_value"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", "invalid_value"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens", "invalid_value"),  # the default max_tokens is 16
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"prompt": "x", "best_of": 2}, "best_of", "invalid_value"),
    ({"prompt": "x", "n": 129}, "n", "too_many_choices"),
    ({"prompt": ["x"] * 65, "n": 2}, "prompt", "too_many_choices"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens", "invalid_value"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({}, "prompt", "missing_required_parameter"),
])
async def test_what_is_not_served_is_a_bad_request_naming_the_param(edge_url, auth, body, param, code):
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        response = await http.post("/v1/completions", json={"model": MODEL, **body}, headers=auth)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


async def test_a_prompt_longer_than_the_model_s_context_window_is_refused(client):
    """The stack gives SLOW_MODEL a window of 300 tokens."""
    with pytest.raises(openai.BadRequestError) as exc:
        await client.completions.create(model=SLOW_MODEL, prompt="word " * 400, max_tokens=8)
    assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "prompt")
    assert "in the prompt" in exc.value.message


async def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as exc:
        await client.completions.create(model="no-such-model", prompt=PROMPT)
    assert exc.value.code == "model_not_found"


async def test_a_text_stream_is_read_again_in_its_own_shapes_and_kept_in_the_transcript(edge_url, auth):
    body = {"model": MODEL, "prompt": PROMPT, "seed": 33, "max_tokens": 12, "stream": True}

    def data(text: str) -> list[str]:
        return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]

    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        first = await http.post("/v1/completions", json=body, headers=auth)
        frames = data(first.text)
        chunks = [json.loads(f) for f in frames[:-1]]
        request_id = chunks[0]["id"]
        again = await http.get(f"/v1/chat/completions/{request_id}/stream", headers=auth)
        # A data-only client counts the chunks it has: with no role chunk, live and read again alike.
        after_two = await http.get(f"/v1/chat/completions/{request_id}/stream?after_chunks=2", headers=auth)
        rows = await transcript(http, request_id, auth)
    assert frames[-1] == "[DONE]" and all(c["object"] == "text_completion" for c in chunks)
    assert all("delta" not in c["choices"][0] for c in chunks)  # no role chunk, no deltas: text only
    assert data(again.text) == frames and data(after_two.text) == frames[2:]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert [(r["role"], r["content"]) for r in rows] == [("user", PROMPT), ("assistant", text)]


async def test_an_echoed_stream_is_read_again_with_its_prompt_and_the_transcript_keeps_it_once(edge_url, auth):
    """The echo travels on the stream's first event, so a stream read again (at any edge) gives it
    back as it was sent live; the transcript and the usage hold the completion alone."""
    body = {"model": MODEL, "prompt": PROMPT, "seed": 34, "max_tokens": 6, "stream": True, "echo": True, "logprobs": 0}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        first = await http.post("/v1/completions", json=body, headers=auth)
        frames = [line for line in first.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
        again = await http.get(f"/v1/chat/completions/{chunks[0]['id']}/stream", headers=auth)
        rows = await transcript(http, chunks[0]["id"], auth)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT) and text.startswith(PROMPT)
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert [line for line in again.text.splitlines() if line.startswith("data: ")] == frames
    assert [(r["role"], r["content"]) for r in rows] == [("user", PROMPT), ("assistant", text[len(PROMPT):])]


async def test_a_retry_with_the_same_idempotency_key_gets_the_same_text_completion(edge_url, auth):
    body = {"model": MODEL, "prompt": PROMPT, "seed": 34, "max_tokens": 8}
    headers = {**auth, "Idempotency-Key": f"text-{id(body)}"}
    async with httpx.AsyncClient(base_url=edge_url, timeout=30) as http:
        first = (await http.post("/v1/completions", json=body, headers=headers)).json()
        retried = (await http.post("/v1/completions", json=body, headers=headers)).json()
    assert retried["id"] == first["id"] and retried["object"] == "text_completion"
    assert retried["choices"][0]["text"] == first["choices"][0]["text"] == (await expected(PROMPT, 34, 8)).text


def test_vllm_s_benchmark_command_line_runs_against_the_edge(stack, edge_url, api_key, tmp_path):
    """``--backend vllm`` (vLLM's default) posts to ``/v1/completions``."""
    done = subprocess.run(
        [sys.executable, "-m", "tokenbus.infra", "bench", "serve", "--backend", "vllm", "--base-url", edge_url,
         "--model", MODEL, "--api-key", api_key, "--dataset-name", "random", "--num-prompts", "8",
         "--random-input-len", "16", "--random-output-len", "6", "--ignore-eos", "--logprobs", "2", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["completed"] == 8 and document["failed"] == 0
    assert document["total_input_tokens"] > 0 and document["total_output_tokens"] > 0


async def test_ignore_eos_runs_chat_and_text_completions_to_max_tokens(client):
    """vLLM's ``ignore_eos`` reaches the engine: an output ends at ``max_tokens``, not at its natural
    end (the stack's simulated engine ends each output after 4 to 40 tokens, its end token)."""
    natural = await expected(PROMPT, seed=36, max_tokens=60)
    assert natural.finish_reason == "stop" and natural.completion_tokens < 60
    text = await client.completions.create(model=MODEL, prompt=PROMPT, seed=36, max_tokens=60,
                                           extra_body={"ignore_eos": True})
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, seed=36, max_tokens=60)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], seed=36,
                                                max_tokens=60, extra_body={"ignore_eos": True})
    assert (text.usage.completion_tokens, text.choices[0].finish_reason) == (60, "length")
    assert text.choices[0].text.startswith(natural.text)  # the same draws, on past where it would have ended
    assert plain.usage.completion_tokens == natural.completion_tokens
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (60, "length")


async def test_a_prompt_of_token_ids_is_read_with_the_edge_s_tokenizer_and_served_as_they_are(stack, api_key,
                                                                                             tmp_path):
    """An edge with the model's tokenizer (``TOKENBUS_EDGE_TOKENIZERS``) reads a prompt of token ids
    (a list of them, or a list of one such list) as text, for moderation, the transcript and an echo,
    and publishes the ids as they are: the stack's simulated engine counts them as its prompt
    (where it counts a text prompt's words) and names each by its place in its vocabulary. The first
    request is lm-evaluation-harness's for a loglikelihood: ids, echo, one likeliest, one token."""
    from tokenizers import Tokenizer

    path = build_tiny_model(tmp_path) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    ids = tokenizer.encode("Once upon a time the bus carried every token").ids
    name, port = f"edge-token-ids-{uuid.uuid4().hex[:4]}", free_port()
    stack.start_edge(name, port, reply_partitions="3", env={"TOKENBUS_EDGE_TOKENIZERS": f"{MODEL}:{path}"})
    try:
        edge = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=60)
        scored = await edge.completions.create(model=MODEL, prompt=[ids], max_tokens=1, logprobs=1, echo=True,
                                               temperature=0, seed=35)
        plain = await edge.completions.create(model=MODEL, prompt=ids, max_tokens=3, seed=36)
        with pytest.raises(openai.BadRequestError) as outside:
            await edge.completions.create(model=MODEL, prompt=[ids[0], tokenizer.get_vocab_size()], max_tokens=1)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            rows = await transcript(http, plain.id, {"Authorization": f"Bearer {api_key}"})
    finally:
        stack.processes[name].stop()
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert scored.usage.prompt_tokens == plain.usage.prompt_tokens == len(ids) != len(text.split())
    assert scored.choices[0].text.startswith(text)
    listed = scored.choices[0].logprobs
    assert listed.tokens[:len(ids)] == [" " + VOCABULARY[i] if i < len(VOCABULARY) else f"<{i}>" for i in ids]
    assert listed.token_logprobs[0] is None and len(listed.tokens) == len(ids) + 1
    assert [(r["role"], r["content"]) for r in rows] == [("user", text), ("assistant", plain.choices[0].text)]
    assert (outside.value.code, outside.value.param) == ("invalid_value", "prompt")


async def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens_for_chat_and_text(client):
    """vLLM's ``truncate_prompt_tokens`` reaches the engine: it keeps the prompt's last tokens (the
    stack's simulated engine counts a word a token, a few more a chat message), so the usage counts
    those alone; a cut below 1 is refused naming it."""
    words = "the bus carries every token to the edge " * 4
    text = await client.completions.create(model=MODEL, prompt=words, max_tokens=2, extra_body={"truncate_prompt_tokens": 6})
    whole = await client.completions.create(model=MODEL, prompt=words, max_tokens=2)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=2,
                                                extra_body={"truncate_prompt_tokens": 7})
    assert (text.usage.prompt_tokens, chat.usage.prompt_tokens) == (6, 7) and whole.usage.prompt_tokens == 32
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt=words, extra_body={"truncate_prompt_tokens": 0})
    assert refused.value.param == "truncate_prompt_tokens"
