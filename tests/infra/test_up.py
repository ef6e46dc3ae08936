"""`tokenbus up` as a newcomer runs it: ready banner, a streamed completion, Ctrl-C, no orphans."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import MODEL, SIM_ENV
from tokenbus.infra.devstack.processes import free_port


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent has not reaped it yet
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 90) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return "".join(seen)
    pytest.fail(f"`tokenbus up` never printed {needle!r}:\n{''.join(seen)}")


def up_env(run_root, edge_port: int) -> dict[str, str]:
    """`tokenbus up` on free ports, with its run directory in the test's tmp dir."""
    return {
        **os.environ,
        "TOKENBUS_STACK_RUN_ROOT": str(run_root),
        "TOKENBUS_STACK_BROKER_PORT": str(free_port()),
        "TOKENBUS_STACK_EDGE_PORT": str(edge_port),
        "TOKENBUS_STACK_WORKER_PORT": str(free_port()),
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def up_process(tmp_path):
    edge_port = free_port()
    env = {**up_env(tmp_path / "run", edge_port), **SIM_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "tokenbus.infra", "up"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    yield proc, edge_port, tmp_path / "run"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_up_streams_and_ctrl_c_leaves_nothing_running(up_process):
    proc, edge_port, run_root = up_process
    banner = wait_for_line(proc, "Ctrl-C")
    assert f"http://127.0.0.1:{edge_port}/v1" in banner and "curl -N" in banner

    key = re.search(r"API key\s+(\S+)", banner).group(1)
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Hello!"}]}
    with httpx.stream("POST", f"http://127.0.0.1:{edge_port}/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        text = response.read().decode()
    assert response.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    console = re.search(r"console\s+(\S+)", banner).group(1)
    assert console == f"http://127.0.0.1:{edge_port}/console/" and httpx.get(console, timeout=10).status_code == 200

    pids = [int(pid) for pid in json.loads((run_root / "current" / "pids.json").read_text()).values()]
    assert len(pids) >= 3 and all(process_exists(pid) for pid in pids)

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(process_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if process_exists(pid)] == []
    for name in ("broker", "edge"):
        assert (run_root / "current" / f"{name}.log").exists()
