"""The mailbox an engine hands a sequence's steps through: in order, a waiting reader woken by
the next put, one reader at a time, a cancelled read losing nothing, and what waits readable
without waiting (a reader that fell behind takes it all at once)."""

import asyncio

import pytest

from tokenbus.gpu_consumers.engines.mailbox import Mailbox


async def test_items_come_out_in_order_and_a_waiting_reader_wakes():
    box: Mailbox[int] = Mailbox()
    box.put(1)
    box.put(2)
    assert [await box.get(), await box.get()] == [1, 2]
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0.01)
    assert not reader.done()
    box.put(3)
    assert await asyncio.wait_for(reader, 5) == 3
    assert len(box) == 0


async def test_one_reader_at_a_time():
    box: Mailbox[int] = Mailbox()
    first = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one reader"):
        await box.get()
    box.put(7)
    assert await first == 7


async def test_a_cancelled_read_loses_nothing():
    box: Mailbox[str] = Mailbox()
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    reader.cancel()
    box.put("kept")  # put after the cancel, before the reader task has run its cancellation
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert await asyncio.wait_for(box.get(), 5) == "kept"


def test_what_waits_can_be_looked_at_and_taken_without_waiting():
    box: Mailbox[int] = Mailbox()
    with pytest.raises(IndexError):
        box.take()
    box.put(1)
    box.put(2)
    assert box.first() == 1 and len(box) == 2
    assert [box.take(), box.take()] == [1, 2]
    assert len(box) == 0
