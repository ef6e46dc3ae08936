"""The edge, the GPU consumers and the processors run on uvloop (installed with tokenbus; `auto` takes it), and
`asyncio` keeps asyncio's own loop where a deployment asks for it."""

import asyncio
from pathlib import Path

from tokenbus.topics.event_loops import loop_factory


def loaded_uvloop(pid: int) -> bool:
    """Whether the process has uvloop's compiled loop mapped: it imported uvloop."""
    return any("uvloop/loop." in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_the_stacks_services_run_on_uvloop(stack):
    services = {name: process.pid for name, process in stack.processes.items()
                if name in ("edge", "processors") or name.startswith("gpu-consumer")}
    assert {"edge", "processors"} <= services.keys() and len(services) > 2
    assert {name: loaded_uvloop(pid) for name, pid in services.items()} == {name: True for name in services}


def test_a_service_takes_uvloop_unless_asked_for_asyncios_loop():
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        assert type(runner.get_loop()).__module__.startswith("uvloop")
