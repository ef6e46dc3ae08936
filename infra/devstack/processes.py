"""Child processes of the embedded stack: one log file each, stopped as a group.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the
supervisor, which stops children in order) and asks the kernel to send it SIGTERM
if the supervisor dies, so even a killed supervisor leaves no orphans. A child may
start at a lower scheduling priority (``nice``); every thread it starts inherits it.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: `tokenbus down` still stops everything


def _before_exec(nice: int) -> Callable[[], None]:
    """What the child does between fork and exec: die with its parent, and lower its priority."""
    def prepare() -> None:
        _die_with_parent()
        if nice:
            os.nice(nice)

    return prepare


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    nice: int = 0  # added to the child's niceness: a lower priority when the machine's cores are busy
    popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_before_exec(self.nice),
            )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            assert self.popen is not None
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 8.0) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class StartupError(RuntimeError):
    pass


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


LISTEN_PORTS_FROM = 20000
_handed_out: set[int] = set()


def _ephemeral_low(default: int = 32768) -> int:
    """Where the kernel's range for outgoing connections' local ports begins."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(host: str = "127.0.0.1") -> int:
    """A port a service can listen on. A port is free only until something binds it: one the
    kernel hands out for ``bind(0)`` comes from the range it also gives outgoing connections,
    which the clients of a test session or a benchmark open by the hundred while a stack's
    services start. So the port is drawn from below that range, and never one this process
    handed out before."""
    low, high = LISTEN_PORTS_FROM, _ephemeral_low() - 1
    for _ in range(100):
        with socket.socket() as sock:
            try:
                sock.bind((host, random.randint(low, high) if high > low else 0))
            except OSError:  # in use
                continue
            port: int = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port on {host}")


def wait_until(check, what: str, process: ManagedProcess | None = None, timeout: float = 60.0) -> None:
    """Poll ``check()`` until true; fail fast if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if process is not None and not process.alive():
            raise StartupError(f"{process.name} exited while waiting for {what}:\n{process.log_tail()}")
        time.sleep(0.05)
    tail = process.log_tail() if process else ""
    raise StartupError(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")


def serves(url: str, pid: int | None) -> bool:
    """Whether the process ``pid`` answers 200 at ``url`` (a service's health body names its pid).
    A port found free when a stack was planned may be taken by another server by the time its
    service starts, and a check that any server passes would hand the caller someone else's."""
    try:
        response = httpx.get(url, timeout=1.0)
        return response.status_code == 200 and response.json().get("pid") == pid
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
