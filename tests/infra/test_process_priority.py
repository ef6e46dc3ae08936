"""The embedded stack runs its stream processors at a lower priority than the request path: on one
machine they share its cores, and nothing they do is on a token's way to its client."""

import os
import sys
import time

from tokenbus.infra.devstack.processes import ManagedProcess


def niceness(pid: int, thread: int | None = None) -> int:
    """A process's (or one of its threads') niceness, from /proc: the 19th field of its stat line."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat"
    with open(path) as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])


def test_a_child_started_nicer_runs_all_its_threads_nicer(tmp_path):
    """The niceness is set before exec, so the threads the child starts later inherit it too."""
    script = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    child = ManagedProcess("sleeper", [sys.executable, "-c", script], tmp_path / "sleeper.log", nice=7)
    child.start()
    try:
        assert child.pid is not None
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) == 2
        mine = os.nice(0)
        assert [niceness(child.pid, int(t)) for t in threads] == [min(mine + 7, 19)] * 2
    finally:
        child.stop()


def test_the_stack_runs_its_processors_nicer_than_the_request_path(stack):
    mine = os.nice(0)
    wanted = stack.settings.processors_nice
    assert wanted > 0  # the default
    assert niceness(stack.processes["processors"].pid) == min(mine + wanted, 19)
    for service in ("edge", "broker", f"gpu-consumer-{stack.settings.models[0]}"):
        assert niceness(stack.processes[service].pid) == mine, service
