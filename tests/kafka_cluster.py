"""A second Kafka-protocol implementation for the bus tests: librdkafka's mock cluster.

The embedded broker (tansu) is one node with quirks of its own (topics/clients.py); the mock
cluster that ships inside the `confluent-kafka` wheel is several brokers on loopback, with
partition leaders spread over them, consumer groups with a coordinator, the idempotent producer
and `acks=all`. Behaviour that holds only on tansu shows up when a test runs on both.

It is test-grade, not Kafka: it answers no CreateTopics (topics are created through its C API,
here over a pipe to the process that holds it), ignores topic configs, holds every fetch for its
whole wait, has no time index, and its group coordinator refuses a follower that syncs after
the leader — docs/architecture.md ("A second Kafka in the tests") says what tokenbus does about
each.

`python -m tests.kafka_cluster BROKERS` runs one: it prints its bootstrap servers, then reads
commands on stdin (`topic NAME PARTITIONS REPLICAS`, `down BROKER`, `up BROKER`), answering
each with `ok` or `error N`. It ends when stdin closes.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from tokenbus.topics.catalog import TopicSpec


class MockKafkaCluster:
    """A mock cluster in a process of its own (its brokers run on librdkafka's threads)."""

    def __init__(self, brokers: int = 3) -> None:
        self.brokers = brokers
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.kafka_cluster", str(brokers)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).parent.parent)
        assert self._process.stdout is not None
        self.bootstrap_servers = self._process.stdout.readline().strip()
        if not self.bootstrap_servers:
            raise RuntimeError(f"the mock cluster did not start (exit {self._process.wait(5)})")

    def create_topics(self, specs: list[TopicSpec]) -> None:
        for spec in specs:
            self._command(f"topic {spec.name} {spec.partitions} {min(spec.replicas, self.brokers)}")

    def broker_down(self, broker_id: int) -> None:
        """The broker stops answering: its connections close and its partitions have no leader."""
        self._command(f"down {broker_id}")

    def broker_up(self, broker_id: int) -> None:
        self._command(f"up {broker_id}")

    def _command(self, line: str) -> None:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"mock cluster: {line!r} answered {answer!r}")

    def close(self) -> None:
        if self._process.stdin:
            self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> MockKafkaCluster:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka the `confluent-kafka` wheel bundles (the mock cluster is part of it)."""
    import confluent_kafka

    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    lib = ctypes.CDLL(str(next(libs.glob("librdkafka*.so*"))))
    handle, text, number = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32
    lib.rd_kafka_conf_new.restype = handle
    lib.rd_kafka_new.restype = handle
    lib.rd_kafka_new.argtypes = [ctypes.c_int, handle, text, ctypes.c_size_t]
    lib.rd_kafka_mock_cluster_new.restype = handle
    lib.rd_kafka_mock_cluster_new.argtypes = [handle, ctypes.c_int]
    lib.rd_kafka_mock_cluster_bootstraps.restype = text
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [handle]
    lib.rd_kafka_mock_topic_create.argtypes = [handle, text, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_mock_broker_set_down.argtypes = [handle, number]
    lib.rd_kafka_mock_broker_set_up.argtypes = [handle, number]
    return lib


def serve(brokers: int) -> None:
    lib = _librdkafka()
    error = ctypes.create_string_buffer(512)
    client = lib.rd_kafka_new(0, lib.rd_kafka_conf_new(), error, len(error))  # the cluster's owner
    if not client:
        raise SystemExit(f"rd_kafka_new: {error.value.decode()}")
    cluster = lib.rd_kafka_mock_cluster_new(client, brokers)
    print(lib.rd_kafka_mock_cluster_bootstraps(cluster).decode(), flush=True)
    for line in sys.stdin:
        match line.split():
            case ["topic", name, partitions, replicas]:
                code = lib.rd_kafka_mock_topic_create(cluster, name.encode(), int(partitions), int(replicas))
            case ["down", broker]:
                code = lib.rd_kafka_mock_broker_set_down(cluster, int(broker))
            case ["up", broker]:
                code = lib.rd_kafka_mock_broker_set_up(cluster, int(broker))
            case _:
                code = -1
        print("ok" if code == 0 else f"error {code}", flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
