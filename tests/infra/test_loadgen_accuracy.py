"""Acceptance for the harness: against a reference server with a known, injected TTFT
and token gap, the reported figures match; malformed streams count as failures.

Tolerance: no request's TTFT or E2EL may be below what the server injects (minus 1 ms of clock
slack): the harness never under-reports. Above it, the medians may exceed the injected values
by at most 40 ms for TTFT (request handling on a shared 2-core machine), 8 ms for ITL and TPOT
(each of the server's sleeps can overshoot on a busy machine), and for E2EL by what those add up
to (40 ms + 8 ms per gap). A harness that adds delay moves the medians; one request delayed by
the machine (the suite runs beside other processes) moves a mean but not a median of 12."""

import json
import subprocess
import sys

import pytest

from tokenbus.infra.devstack.processes import free_port, port_open, wait_until
from tokenbus.infra.loadgen.prompts import sharegpt_prompts
from tokenbus.infra.loadgen.serve import ServeConfig, run_serve

TTFT_MS, GAP_MS, TOKENS = 80.0, 20.0, 12


@pytest.fixture(scope="module")
def reference_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenbus.infra.loadgen.reference_server", "--port", str(port),
                             "--ttft-ms", str(TTFT_MS), "--gap-ms", str(GAP_MS)])
    try:
        wait_until(lambda: port_open("127.0.0.1", port), "the reference server", timeout=20)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


def config(url: str, model: str = "ok", **overrides) -> ServeConfig:
    fields = dict(base_url=url, model=model, num_prompts=12, max_concurrency=2, output_len=TOKENS,
                  input_len=8, percentiles=(50.0, 99.0), progress=False)
    return ServeConfig(**{**fields, **overrides})


async def test_reported_figures_match_the_injected_timings(reference_url):
    summary, results = await run_serve(config(reference_url, request_rate=40, goodput=["ttft:5000"]))
    assert (summary.completed, summary.failed) == (12, 0)
    assert summary.total_output_tokens == 12 * TOKENS
    assert all(len(r.itl) == TOKENS - 1 for r in results)
    e2el = TTFT_MS + (TOKENS - 1) * GAP_MS
    assert min(r.ttft for r in results) * 1000 >= TTFT_MS - 1
    assert min(r.latency for r in results) * 1000 >= e2el - 1
    assert summary.ttft_ms["median"] <= TTFT_MS + 40
    assert GAP_MS - 1 <= summary.itl_ms["median"] <= GAP_MS + 8
    assert GAP_MS - 1 <= summary.tpot_ms["median"] <= GAP_MS + 8
    assert summary.e2el_ms["median"] <= e2el + 40 + (TOKENS - 1) * 8
    assert summary.request_goodput == pytest.approx(summary.request_throughput)


@pytest.mark.parametrize("model", ["malformed-json", "no-done", "error-event", "http-500", "cut"])
async def test_malformed_streams_are_failures_not_crashes(reference_url, model):
    summary, results = await run_serve(config(reference_url, model=model, num_prompts=3, warmup=0))
    assert (summary.completed, summary.failed) == (0, 3)
    assert all(r.error for r in results)


def test_cli_writes_a_result_file(reference_url, tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "tokenbus.infra", "bench", "serve", "--base-url", reference_url, "--model", "ok",
         "--num-prompts", "4", "--random-output-len", "4", "--percentiles", "50,90,99", "--result-file", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "P90 TTFT (ms)" in done.stdout
    document = json.loads(out.read_text())
    assert document["completed"] == 4 and set(document["ttft_ms"]) >= {"mean", "median", "p50", "p90", "p99"}


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
