"""How a service process's garbage collector runs. A busy service allocates a few container
objects for every token event (the event, its dict for Avro, futures), and enough of them live
for a while (a request's events until its completion, deliveries until acknowledged) that
CPython's default young-generation threshold of 700 allocations makes it collect every few dozen
events and promote much of what it scans. At 51,200 token events/s offered, a GPU consumer
spent ~17 % more CPU per token with the default than with this module's (BENCHMARKS.md §6).

So a service collects less often: ``tune_collector`` freezes what start-up made (modules,
settings, the app: never garbage, and otherwise scanned by every full collection) and raises the
young generation's threshold. Reference cycles are still collected, just in larger, rarer passes.

Those passes scan every live object of the generations they collect, so what a request holds
should be freed by reference counting when it ends, not left in a cycle for them: a GPU consumer
whose every request was (its engine mailbox held the publisher that held the request) paused up to
130 ms in them (BENCHMARKS.md §6; tests/gpu_consumers/test_worker.py checks that it no longer is).
"""

from __future__ import annotations

import gc

PYTHON_DEFAULT = 700
GC_THRESHOLD = 10_000  # a service's `gc_threshold` setting


def tune_collector(young_threshold: int) -> None:
    """Call once start-up is done. ``young_threshold``: allocations between young collections
    (``PYTHON_DEFAULT`` leaves the collector as Python sets it, nothing frozen)."""
    if young_threshold == PYTHON_DEFAULT:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
