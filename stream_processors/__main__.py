"""``python -m tokenbus.stream_processors``: one faust worker running the jobs its settings name."""

from __future__ import annotations

import faust
import mode.loop

from tokenbus.stream_processors.app import create_app
from tokenbus.stream_processors.settings import ProcessorSettings
from tokenbus.topics import tracing
from tokenbus.topics.collector import tune_collector
from tokenbus.topics.event_loops import wants_uvloop


def main() -> None:
    settings = ProcessorSettings()
    if wants_uvloop(settings.loop):
        mode.loop.use("uvloop")  # before faust makes its loops (its consumer thread makes its own)
    tracing.configure("tokenbus-processors", settings.bus.otlp_endpoint)
    app = create_app(settings)
    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    # faust's progress spinner sets the root logger to DEBUG (its handler spins on every record),
    # so every library's debug line was built and then dropped: aiokafka's, one per partition per
    # fetch, cost the processors about a third of their CPU while traffic flowed.
    worker.spinner = None
    tune_collector(settings.gc_threshold)
    worker.execute_from_commandline()


if __name__ == "__main__":
    main()
