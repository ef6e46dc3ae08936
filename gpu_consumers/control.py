"""Listen on `control` for cancels of requests this worker runs or holds."""

from __future__ import annotations

from collections.abc import Callable

from tokenbus.schemas import AvroCodec, Control, ControlAction
from tokenbus.topics import BusSettings, TopicCatalog, TopicTail


class ControlListener:
    """Every worker reads every control partition: a cancel must reach whoever runs the request.
    It reads what the topic holds first (its retention: an hour), before the worker fetches any
    request, so that a worker that joins after a cancel (scaled up under a batch's backlog, say)
    does not run what was cancelled, a batch's queued requests above all; cancels of finished
    requests read so are remembered and never matched, which is harmless. Then it reads on live."""

    def __init__(self, settings: BusSettings, codec: AvroCodec, on_cancel: Callable[[str, str], None]) -> None:
        self._on_cancel = on_cancel
        self._tail = TopicTail(settings, codec, TopicCatalog(settings).control, Control, self._on_control,
                               "control-listener", catch_up=True)

    async def start(self) -> None:
        await self._tail.start()

    async def stop(self) -> None:
        await self._tail.stop()

    def _on_control(self, control: Control) -> None:
        if control.action is ControlAction.CANCEL:
            self._on_cancel(control.request_id, control.reason)
