"""``python -m tokenbus.stream_processors``: one faust worker running the jobs its settings name."""

from __future__ import annotations

import faust

from tokenbus.stream_processors.app import create_app


def main() -> None:
    app = create_app()
    faust.Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
