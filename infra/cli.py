"""The ``tokenbus`` command."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time

from tokenbus.infra.admin.keys import add_key_commands
from tokenbus.infra.admin.trace import add_trace_command
from tokenbus.infra.admin.usage import add_arguments as add_usage_arguments
from tokenbus.infra.admin.usage import cmd_usage
from tokenbus.infra.devstack.banner import ready_banner
from tokenbus.infra.devstack.broker import BrokerNotFound, broker_binary
from tokenbus.infra.devstack.processes import StartupError
from tokenbus.infra.devstack.redis_server import install_redis_server, redis_answers
from tokenbus.infra.devstack.stack import EmbeddedStack, StackSettings, stop_recorded
from tokenbus.infra.loadgen.serve import add_arguments as add_serve_arguments
from tokenbus.topics import BusSettings, TopicCatalog, ensure_topics, make_codec


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


SMOLLM2 = "SmolLM2-135M-Instruct"


def cmd_up(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("engine", args.engine), ("edge_port", args.port)) if v is not None}
    if args.engine == "hf" and "TOKENBUS_STACK_MODELS" not in os.environ:
        overrides["models"] = [SMOLLM2]
    stack = EmbeddedStack(StackSettings(**overrides))
    # SIGTERM (e.g. from `kill`) stops the stack the same way Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        print("starting the embedded stack ...", flush=True)
        stack.start()
        print(ready_banner(stack), flush=True)
        while all(p.alive() for p in stack.processes.values()):
            time.sleep(0.5)
        dead = [name for name, p in stack.processes.items() if not p.alive()]
        print(f"stopping: {', '.join(dead)} exited; see {stack.run_dir}/", file=sys.stderr)
        return 1
    except StartupError as exc:
        print(f"tokenbus up failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()
        print("stopped.", flush=True)


def cmd_down(args: argparse.Namespace) -> int:
    stopped = stop_recorded(StackSettings().run_root)
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing to stop")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check (and with --install, fix) what the embedded stack needs beyond Python packages."""
    ok = True
    try:
        print(f"broker   {broker_binary()}")
    except BrokerNotFound as exc:
        print(f"broker   MISSING: {exc}")
        ok = False
    url = StackSettings().redis_url
    if redis_answers(url):
        print(f"redis    answering at {url}")
    elif shutil.which("redis-server"):
        print("redis    redis-server installed (started by `tokenbus up`)")
    elif args.install:
        print("redis    installing redis-server with apt-get ...")
        install_redis_server()
    else:
        print("redis    MISSING: no Redis answers and redis-server is not installed (`tokenbus doctor --install`)")
        ok = False
    return 0 if ok else 1


def cmd_topics(args: argparse.Namespace) -> int:
    bus = BusSettings()
    created = asyncio.run(ensure_topics(bus.bootstrap_servers, TopicCatalog(bus).all_topics()))
    print(f"created: {', '.join(created)}" if created else "all topics exist")
    if bus.schema_registry_url:  # the deployment step that registers them, for services that only look ids up
        codec = make_codec(bus.model_copy(update={"schema_registry_auto_register": True}))
        for subject, schema_id in codec.register_schemas().items():  # known by now: nothing asked again
            print(f"schema {subject}: id {schema_id} in {bus.schema_registry_url}")
    return 0


def cmd_edge(args: argparse.Namespace) -> int:
    from tokenbus.sse_edge.server import main

    main()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenbus.gpu_consumers.server import main

    main()
    return 0


def cmd_processors(args: argparse.Namespace) -> int:
    from tokenbus.stream_processors.__main__ import main

    main()
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tokenbus.infra.loadgen.serve import cmd_serve

    return cmd_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenbus", description="OpenAI-compatible LLM serving on Kafka.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start the embedded stack and wait (Ctrl-C stops it)")
    up.add_argument("--engine", help="simulated (default), hf (serves SmolLM2-135M-Instruct) or trtllm")
    up.add_argument("--port", type=int, help="edge port (default 8700)")
    up.set_defaults(run=cmd_up)
    commands.add_parser("down", help="stop the stack a `tokenbus up` started").set_defaults(run=cmd_down)
    doctor = commands.add_parser("doctor", help="check the broker binary and Redis")
    doctor.add_argument("--install", action="store_true", help="install what is missing (apt-get)")
    doctor.set_defaults(run=cmd_doctor)
    add_key_commands(commands)
    commands.add_parser("topics", help="create missing topics on TOKENBUS_BOOTSTRAP_SERVERS (and register the "
                        "schemas in TOKENBUS_SCHEMA_REGISTRY_URL)").set_defaults(run=cmd_topics)
    commands.add_parser("edge", help="run one SSE edge process (TOKENBUS_EDGE_*)").set_defaults(run=cmd_edge)
    commands.add_parser("worker", help="run one GPU consumer process (TOKENBUS_WORKER_*)").set_defaults(run=cmd_worker)
    commands.add_parser("processors", help="run one stream-processor worker (TOKENBUS_PROC_*)").set_defaults(
        run=cmd_processors)
    usage = commands.add_parser("usage", help="usage and cost per tenant, model and tier (ClickHouse)")
    add_usage_arguments(usage)
    usage.set_defaults(run=cmd_usage)
    add_trace_command(commands)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    serve = bench.add_parser("serve", help="load-test any OpenAI-compatible streaming endpoint")
    add_serve_arguments(serve)
    serve.set_defaults(run=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.run(args))
