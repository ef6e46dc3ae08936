"""ProcessorContext: a record whose processing has begun is processed to its end even when its
agent is cancelled (faust stops agents by cancelling them and acks the event in hand)."""

import asyncio

import pytest

from tokenbus.schemas import AvroCodec, Completion
from tokenbus.stream_processors.context import ProcessorContext, run_to_end
from tokenbus.stream_processors.settings import ProcessorSettings


class Message:
    """What the context reads of a consumer record."""

    def __init__(self, value: bytes) -> None:
        self.topic, self.partition, self.offset, self.value, self.headers = "completions", 0, 7, value, []


async def test_a_record_begun_is_handled_to_its_end_when_its_agent_is_cancelled():
    ctx = ProcessorContext(ProcessorSettings())
    completion = Completion("req-1", "m", "standard", "text", "stop", 1, 1, 0, 0, 0, tenant="t")
    handling, written = asyncio.Event(), []

    async def handle(record: Completion, message: Message) -> None:
        handling.set()
        await asyncio.sleep(0.2)  # a store write in flight
        written.append(record.request_id)

    agent = asyncio.create_task(ctx.process("write-transcripts", Message(AvroCodec().encode(completion)), Completion, handle))
    await handling.wait()
    agent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await agent
    assert written == ["req-1"]  # finished before the cancellation took effect


async def test_run_to_end_passes_on_what_the_work_returns_or_raises():
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fail() -> None:
        raise ValueError("store refused")

    assert await run_to_end(answer()) == 42
    with pytest.raises(ValueError, match="store refused"):
        await run_to_end(fail())
