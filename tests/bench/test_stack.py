"""The benchmarks' own instruments (bench/stack.py): a process's CPU time, read around a call."""

import os
import threading
import time

from bench.stack import cpu_seconds


def busy(seconds: float) -> None:
    ends = time.process_time() + seconds
    while time.process_time() < ends:
        pass


def test_cpu_time_is_every_threads_and_finer_than_a_clock_tick():
    pid = os.getpid()
    before = cpu_seconds(pid)
    busy(0.003)  # under a 10 ms clock tick
    small = cpu_seconds(pid) - before
    assert 0.002 < small < 0.5, small

    done = threading.Event()
    worker = threading.Thread(target=lambda: (busy(0.05), done.wait()))
    worker.start()
    try:
        waited_until = time.monotonic() + 30
        while cpu_seconds(pid) - before < 0.05 and time.monotonic() < waited_until:
            time.sleep(0.01)
        assert cpu_seconds(pid) - before >= 0.05  # the other thread's time counts too
    finally:
        done.set()
        worker.join()
