"""Listen on `control` for cancels of requests this worker runs or holds."""

from __future__ import annotations

from collections.abc import Callable

from tokenbus.schemas import AvroCodec, Control, ControlAction
from tokenbus.topics import BusSettings, TopicCatalog, TopicTail


class ControlListener:
    """Every worker reads every control partition, from now on: a cancel must reach whoever runs
    the request; cancels are rare and mostly follow a disconnect grace window of seconds, and
    re-reading a few from before it started is harmless (they name finished requests)."""

    def __init__(self, settings: BusSettings, codec: AvroCodec, on_cancel: Callable[[str, str], None]) -> None:
        self._on_cancel = on_cancel
        self._tail = TopicTail(settings, codec, TopicCatalog(settings).control, Control, self._on_control,
                               "control-listener")

    async def start(self) -> None:
        await self._tail.start()

    async def stop(self) -> None:
        await self._tail.stop()

    def _on_control(self, control: Control) -> None:
        if control.action is ControlAction.CANCEL:
            self._on_cancel(control.request_id, control.reason)
