"""`make bench`: run the benchmark scenarios, write JSON results and print short tables."""

from __future__ import annotations

import argparse
import json
import platform
import os
import time
from pathlib import Path

from bench import pipeline_overhead

RESULTS_DIR = Path(__file__).parent / "results"
SCENARIOS = {"pipeline_overhead": pipeline_overhead}


def machine() -> dict[str, str | int]:
    return {"cpu_count": os.cpu_count() or 0, "platform": platform.platform(), "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS), help=f"any of {', '.join(SCENARIOS)}")
    args = parser.parse_args()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios:
        module = SCENARIOS[name]
        started = time.time()
        result = {**module.run(), "machine": machine(), "started_at": started, "wall_s": round(time.time() - started, 1)}
        path = RESULTS_DIR / f"{name}.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"\n## {name}  ({result['wall_s']} s, {path})\n")
        print(module.table(result))


if __name__ == "__main__":
    main()
