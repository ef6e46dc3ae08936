"""The mailbox an engine hands a sequence's steps through: in order, a waiting reader woken by
the next put, one reader at a time, a cancelled read losing nothing, and what waits readable
without waiting (a reader that fell behind takes it all at once)."""

import asyncio
import contextlib
import gc
import weakref

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


async def test_forwarding_hands_on_what_waits_then_each_put_until_the_last():
    box: Mailbox[int] = Mailbox()
    box.put(1)
    taken: list[int] = []

    def take(item: int) -> bool:
        taken.append(item)
        return item == 3

    done = box.forward(take)
    assert taken == [1] and not done.done() and len(box) == 0
    box.put(2)
    assert taken == [1, 2]  # at the put, no task in between
    box.put(3)
    await asyncio.wait_for(done, 5)
    box.put(4)  # after the last: dropped
    assert taken == [1, 2, 3] and len(box) == 0


async def test_a_forward_that_raises_fails_its_future_and_takes_nothing_more():
    box: Mailbox[int] = Mailbox()
    taken: list[int] = []

    def take(item: int) -> bool:
        taken.append(item)
        if item == 2:
            raise ValueError("the reader's own problem")
        return False

    done = box.forward(take)
    for item in (1, 2, 3):
        box.put(item)  # the putter (an engine's step loop) never sees the reader's error
    with pytest.raises(ValueError, match="reader's own problem"):
        await done
    assert taken == [1, 2]


async def test_a_cancelled_forward_drops_what_comes_after_and_one_reader_holds():
    box: Mailbox[int] = Mailbox()
    taken: list[int] = []
    done = box.forward(lambda item: taken.append(item) or False)
    with pytest.raises(RuntimeError, match="one reader"):
        await box.get()
    with pytest.raises(RuntimeError, match="one reader"):
        box.forward(lambda item: False)
    done.cancel()  # its reader's task was cancelled
    box.put(1)
    assert taken == [] and len(box) == 0


@pytest.mark.parametrize("ending", ["last", "cancelled"])
async def test_a_finished_forward_lets_go_of_its_taker(ending):
    """A taker holds its reader, which holds whoever holds the mailbox: kept after the forward is
    done, that is a cycle per request that only the garbage collector frees (in pauses of tens of
    milliseconds on a busy GPU consumer). Here it must go by reference counting alone. (A taker
    that raised is held by its error's traceback, as any failure's frames are: that cycle, rare,
    is the collector's.)"""
    class Reader:
        def take(self, item: int) -> bool:
            return True

    box: Mailbox[int] = Mailbox()
    reader = Reader()
    gone = weakref.ref(reader)
    gc.disable()
    try:
        done = box.forward(reader.take)
        del reader
        if ending == "cancelled":
            done.cancel()
        else:
            box.put(1)
        with contextlib.suppress(asyncio.CancelledError):
            await done
        await asyncio.sleep(0)  # the future's done callbacks run on the loop
        assert gone() is None
    finally:
        gc.enable()
