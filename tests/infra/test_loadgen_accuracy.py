"""Acceptance for the harness: against a reference server with a known, injected TTFT
and token gap, the reported figures match; malformed streams count as failures.

Tolerance: no request's TTFT or E2EL may be below what the server injects (minus 1 ms of clock
slack): the harness never under-reports. Above it, each median is compared with the same median
of what the server says it actually kept (its ``/timings``: a busy machine stretches the
server's sleeps, by hundreds of ms in one CI run, and that is not the harness's doing): TTFT
and E2EL may exceed it by at most 40 ms (the request's way in and out on a shared 2-core
machine), ITL and TPOT by 8 ms. A harness that adds delay, or reads chunks late in batches, moves
the medians; one request delayed by the machine (the suite runs beside other processes) moves a
mean but not a median of 12."""

import argparse
import json
import subprocess
import sys
from statistics import median

import aiohttp
import pytest

from tokenbus.infra.devstack.processes import free_port, port_open, wait_until
from tokenbus.infra.loadgen.prompts import BenchPrompt, sharegpt_prompts
from tokenbus.infra.loadgen.serve import ServeConfig, add_arguments, config_from_args, run_serve
from tokenbus.infra.loadgen.sse_client import client_session, stream_chat

TTFT_MS, GAP_MS, TOKENS = 80.0, 20.0, 12


@pytest.fixture(scope="module")
def reference_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenbus.infra.loadgen.reference_server", "--port", str(port),
                             "--ttft-ms", str(TTFT_MS), "--gap-ms", str(GAP_MS)])
    try:
        wait_until(lambda: port_open("127.0.0.1", port), "the reference server", timeout=20)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def config(url: str, model: str = "ok", **overrides) -> ServeConfig:
    fields = dict(base_url=url, model=model, num_prompts=12, max_concurrency=2, output_len=TOKENS,
                  input_len=8, percentiles=(50.0, 99.0), progress=False)
    return ServeConfig(**{**fields, **overrides})


async def kept_timings(url: str) -> list[dict]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/timings") as response:
        return await response.json()


async def test_reported_figures_match_the_injected_timings(reference_url):
    kept_before = len(await kept_timings(reference_url))
    summary, results = await run_serve(config(reference_url, request_rate=40, goodput=["ttft:5000"]))
    server = (await kept_timings(reference_url))[kept_before:][-12:]  # the warm-up's come first
    assert (summary.completed, summary.failed, len(server)) == (12, 0, 12)
    assert summary.total_output_tokens == 12 * TOKENS
    assert all(len(r.itl) == TOKENS - 1 for r in results)
    e2el = TTFT_MS + (TOKENS - 1) * GAP_MS
    assert min(r.ttft for r in results) * 1000 >= TTFT_MS - 1
    assert min(r.latency for r in results) * 1000 >= e2el - 1

    kept_ttft = median(t["ttft_ms"] for t in server)
    kept_gap = median(b - a for t in server for a, b in zip(t["chunks_ms"], t["chunks_ms"][1:]))
    kept_tpot = median((t["chunks_ms"][-1] - t["ttft_ms"]) / (TOKENS - 1) for t in server)
    kept_e2el = median(t["chunks_ms"][-1] for t in server)
    assert summary.ttft_ms["median"] <= kept_ttft + 40, kept_ttft
    assert GAP_MS - 1 <= summary.itl_ms["median"] <= kept_gap + 8, kept_gap
    assert GAP_MS - 1 <= summary.tpot_ms["median"] <= kept_tpot + 8, kept_tpot
    assert summary.e2el_ms["median"] <= kept_e2el + 40, kept_e2el
    assert summary.request_goodput == pytest.approx(summary.request_throughput)


@pytest.mark.parametrize("model", ["malformed-json", "no-done", "error-event", "http-500", "cut"])
async def test_malformed_streams_are_failures_not_crashes(reference_url, model):
    summary, results = await run_serve(config(reference_url, model=model, num_prompts=3, warmup=0))
    assert (summary.completed, summary.failed) == (0, 3)
    assert all(r.error for r in results)


async def test_requests_one_after_another_share_one_connection(reference_url):
    """As OpenAI's and vLLM's clients do: a client that connected for every request (the harness
    once did, leaving each body unread after [DONE]) adds a connect to every time to first token
    and to the server's CPU."""
    opened = 0

    async def counted(*args) -> None:
        nonlocal opened
        opened += 1

    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(counted)
    payload = {"model": "ok", "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with client_session(4) as http:
        http.trace_configs.append(tracing)
        tracing.freeze()
        results = [await stream_chat(http, f"{reference_url}/v1/chat/completions", payload) for _ in range(4)]
    assert all(r.success for r in results), [r.error for r in results]
    assert opened == 1


def bench_serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenbus.infra", "bench", "serve", *flags],
                          capture_output=True, text=True, timeout=60)


def test_a_vllm_command_line_writes_a_vllm_result_file(reference_url, tmp_path):
    """The flags of vLLM's benchmark_serving.py, those that need its tokenizer included."""
    done = bench_serve(
        "--backend", "openai-chat", "--base-url", reference_url, "--endpoint", "/v1/chat/completions",
        "--model", "meta-llama/ok", "--served-model-name", "ok", "--tokenizer", "meta-llama/ok",
        "--trust-remote-code", "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "8",
        "--random-output-len", "4", "--max-concurrency", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "r.json", "--metadata", "run=ci", "--disable-tqdm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout and "P90 TTFT (ms)" in done.stdout
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["completed"] == 4 and document["failed"] == 0 and document["run"] == "ci"
    assert (document["backend"], document["model_id"], document["max_concurrency"]) == ("openai-chat",
                                                                                       "meta-llama/ok", 2)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{s}_{metric}_ms" for s in ("mean", "median", "std", "p50", "p90", "p99")} <= set(document)
    assert document["median_ttft_ms"] >= TTFT_MS - 1
    assert document["total_output_tokens"] == 16 and document["request_throughput"] > 0
    assert "ttfts" not in document  # only with --save-detailed, as in vLLM


def test_the_completions_backend_and_the_default_file_name(reference_url, tmp_path):
    done = bench_serve("--backend", "vllm", "--host", "127.0.0.1", "--port", reference_url.rsplit(":", 1)[1],
                       "--model", "ok", "--num-prompts", "3", "--random-output-len", "5", "--save-result",
                       "--save-detailed", "--result-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = tmp_path.glob("vllm-infqps-ok-*.json")
    document = json.loads(path.read_text())
    assert document["generated_texts"] == ["w0 w1 w2 w3 w4 "] * 3 and len(document["ttfts"]) == 3
    assert set(document) >= {"p99_ttft_ms", "median_tpot_ms", "p99_itl_ms"} and "median_e2el_ms" not in document


def test_failures_are_counted_by_reason(reference_url, tmp_path):
    done = bench_serve("--base-url", reference_url, "--model", "http-500", "--num-prompts", "3", "--num-warmups",
                       "0", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "f.json")
    assert done.returncode == 1
    assert "Failures by reason" in done.stdout and "HTTP 500 injected_failure:" in done.stdout
    document = json.loads((tmp_path / "f.json").read_text())
    assert (document["completed"], document["failed"]) == (0, 3)
    assert document["failure_reasons"] == {"HTTP 500 injected_failure": 3}


def test_bad_flags_are_refused_before_sending(reference_url):
    done = bench_serve("--base-url", reference_url, "--percentile-metrics", "ttft,latency")
    assert done.returncode == 2 and "latency" in done.stdout


def test_sharegpt_file_is_read_as_prompts(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "What is Kafka?"}, {"from": "gpt", "value": "A log, five words here"}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model"}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    ]
    as_json, as_jsonl = tmp_path / "d.json", tmp_path / "d.jsonl"
    as_json.write_text(json.dumps(data))
    as_jsonl.write_text("\n".join(json.dumps(item) for item in data))
    for path in (as_json, as_jsonl):
        prompts = sorted(sharegpt_prompts(path, 10), key=lambda p: p.text)
        assert [(p.text, p.output_len) for p in prompts] == [("Hi", 1), ("What is Kafka?", 5)]


def test_logprobs_are_asked_in_each_api_s_form():
    """vLLM's ``--logprobs N``: a text completion's ``logprobs: N``, a chat's ``logprobs`` and
    ``top_logprobs: N``; not given, neither asks."""
    prompt = BenchPrompt("hello", 1, 8)
    assert prompt.payload("m", backend="vllm", logprobs=2)["logprobs"] == 2
    chat = prompt.payload("m", backend="openai-chat", logprobs=2)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 2)
    assert not {"logprobs", "top_logprobs"} & prompt.payload("m", backend="vllm").keys()


def test_vllm_s_sampling_flags_are_sent_by_their_api_names_and_only_when_given():
    """``--temperature``, ``--top-p``, ``--top-k``, ``--min-p`` and the penalties, as vLLM's
    ``bench serve`` takes them, each become the request field of that name; none given, none sent."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--top-k", "20", "--min-p", "0.05", "--temperature", "0"]))
    assert config.sampling == {"top_k": 20, "min_p": 0.05, "temperature": 0.0}
    body = BenchPrompt("hello", 1, 8).payload("m", backend="openai-chat", sampling=config.sampling)
    assert (body["top_k"], body["min_p"], body["temperature"]) == (20, 0.05, 0.0)
    plain = config_from_args(parser.parse_args([]))
    assert plain.sampling == {}
    assert not {"top_k", "temperature", "top_p"} & BenchPrompt("hello", 1, 8).payload("m", sampling=plain.sampling).keys()
