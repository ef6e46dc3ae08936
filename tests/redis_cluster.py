"""A real Redis Cluster for the tests of what the edge keeps in Redis: three primaries of the
machine's redis-server (`make test` installs it), each on a loopback port of its own, joined with
`redis-cli --cluster create`, so that keys fall on different shards as on a production cluster."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from tokenbus.infra.devstack.processes import free_port


class RedisCluster:
    def __init__(self, root: Path, primaries: int = 3) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert server and cli, "redis-server and redis-cli are installed by `make test` (Debian's redis-server)"
        self.ports = [free_port() for _ in range(primaries)]
        self._cli = cli
        self._processes = []
        for port in self.ports:
            folder = root / str(port)
            folder.mkdir(parents=True)
            # The cluster bus port is named too: by default it is the port + 10000, which lands in
            # the range outgoing connections take their ports from, and a node whose bus port is
            # taken does not start.
            self._processes.append(subprocess.Popen(
                [server, "--port", str(port), "--cluster-port", str(free_port()), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--save", "",
                 "--appendonly", "no"],
                cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    @property
    def url(self) -> str:
        """One node's address: a cluster client finds the others."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def __enter__(self) -> RedisCluster:
        try:
            self._wait(lambda node: node.ping())
            subprocess.run([self._cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            self._wait(lambda node: node.cluster("info")["cluster_state"] == "ok")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            process.wait(10)

    def _wait(self, ready: object, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for port in self.ports:
            node = redis.Redis(port=port, decode_responses=True, socket_timeout=1)
            while True:
                try:
                    if ready(node):  # type: ignore[operator]
                        break
                except (redis.RedisError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis cluster node {port} not ready")
                time.sleep(0.05)
