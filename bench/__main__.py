"""`make bench`: run the benchmark scenarios, write JSON results and PNG plots, print tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from bench import (
    batch,
    broker_scan,
    capacity,
    chat_turn,
    choices,
    codec,
    consumer_throughput,
    edge_costs,
    engine_text,
    gpu,
    group_cancel,
    idle,
    load_sweep,
    logprobs,
    mixed_load,
    moderations,
    peers,
    pipeline_overhead,
    prefix_cache,
    prefix_routing,
    processors,
    responses,
    sampling_cost,
    scale_out,
    service_tiers,
    soak,
    sse_fanout,
    stream_interval,
    tier_fairness,
    tracing,
    truncation,
    turn_profile,
)

RESULTS_DIR = Path(__file__).parent / "results"
SCENARIOS = {
    "pipeline_overhead": pipeline_overhead,
    "load_sweep": load_sweep,
    "sse_fanout": sse_fanout,
    "tier_fairness": tier_fairness,
    "service_tiers": service_tiers,
    "scale_out": scale_out,
    "consumer_throughput": consumer_throughput,
    "engine_text": engine_text,
    "codec": codec,
    "logprobs": logprobs,
    "edge_costs": edge_costs,
    "idle": idle,
    "processors": processors,
    "truncation": truncation,
    "mixed_load": mixed_load,
    "turn_profile": turn_profile,
    "chat_turn": chat_turn,
    "choices": choices,
    "batch": batch,
    "moderations": moderations,
    "group_cancel": group_cancel,
    "responses": responses,
    "tracing": tracing,
    "prefix_routing": prefix_routing,
    "prefix_cache": prefix_cache,
    "sampling_cost": sampling_cost,
    "stream_interval": stream_interval,
    "capacity": capacity,  # the inputs and the check of docs/capacity.md: on request only
    "peers": peers,  # installs LiteLLM's proxy into an environment of its own on the first run
    "soak": soak,  # 10 minutes: run by `make faults`, not by default
    "broker_scan": broker_scan,  # measures the embedded broker, not tokenbus: on request only
    "gpu": gpu,  # needs a CUDA GPU: on request only
}
DEFAULT_SCENARIOS = [name for name in SCENARIOS if name not in ("soak", "broker_scan", "gpu", "capacity")]


def loop_seconds(iterations: int = 5_000_000) -> float:
    """A fixed pure-Python workload, timed: how fast this machine is right now. Figures from runs
    whose loop times differ are not comparable (these shared machines vary several-fold)."""
    started = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return round(time.perf_counter() - started, 3)


def machine() -> dict[str, str | int | float]:
    return {"cpu_count": os.cpu_count() or 0, "platform": platform.platform(), "python": platform.python_version(),
            "loop_5m_s": loop_seconds()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("scenarios", nargs="*", default=DEFAULT_SCENARIOS, help=f"any of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    for name in args.scenarios:
        module = SCENARIOS[name]
        started = time.time()
        speed_before = loop_seconds()
        result = {**module.run(), "machine": {**machine(), "loop_5m_s_before": speed_before},
                  "started_at": started, "wall_s": round(time.time() - started, 1)}
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(result, indent=2))
        plot = getattr(module, "plot", None)
        written = [path] + ([plot(result, args.out)] if plot else [])
        speed = f"5M-step Python loop {speed_before} s before, {result['machine']['loop_5m_s']} s after"
        print(f"\n## {name}  ({result['wall_s']} s; {speed}; {', '.join(str(p) for p in written)})\n", flush=True)
        print(module.table(result), flush=True)
    print(f"\nall scenarios: {time.time() - began:.0f} s")


if __name__ == "__main__":
    main()
