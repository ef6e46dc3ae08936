"""The peers scenario's parts that decide what it reports (the run itself is a benchmark):
a proxy's worker processes are counted with it, and a LiteLLM that cannot be installed is a
stated skip, not a crash or a table of zeros."""

import subprocess
import sys
import time

from bench import peers


def test_a_target_counts_the_children_of_its_processes():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time;"
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
                               "time.sleep(30)"])
    try:
        target = peers.Target("proxy", "http://127.0.0.1:1", "m", None, [parent.pid])
        deadline = time.monotonic() + 10
        while len(target.all_pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = target.all_pids()
        assert pids[0] == parent.pid and len(pids) == 2
        assert target.rss_mib() > 0
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()


def test_a_litellm_that_cannot_be_installed_is_a_stated_skip(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "LITELLM_ENV", tmp_path / "env")
    monkeypatch.setattr(peers, "LITELLM_VERSION", "0.0.0-does-not-exist")
    result = peers.run()
    assert "rows" not in result and "0.0.0-does-not-exist" in result["skipped"]
    assert peers.table(result).startswith("skipped: LiteLLM 0.0.0-does-not-exist could not be installed")
