"""ecq.queue.lean_event.LeanEvent behaves as asyncio.Event wherever ECQ uses one."""

import asyncio

import pytest

from ecq.queue.lean_event import LeanEvent


@pytest.mark.parametrize("make", [asyncio.Event, LeanEvent], ids=["asyncio", "lean"])
async def test_a_lean_event_wakes_waiters_as_an_asyncio_event_does(make):
    event = make()
    assert not event.is_set()
    waiters = [asyncio.create_task(event.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    event.set()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 1) == [True, True, True]
    assert event.is_set() and await asyncio.wait_for(event.wait(), 1) is True  # set: returns at once
    event.clear()
    late = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    assert not late.done()
    event.set()
    event.set()  # a second set changes nothing
    assert await asyncio.wait_for(late, 1) is True


@pytest.mark.parametrize("make", [asyncio.Event, LeanEvent], ids=["asyncio", "lean"])
async def test_a_cancelled_waiter_leaves_the_others_waiting(make):
    event = make()
    cancelled, waiting = asyncio.create_task(event.wait()), asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not waiting.done()
    event.set()
    assert await asyncio.wait_for(waiting, 1) is True


async def test_a_lean_event_holds_no_list_of_waiters_while_none_waits():
    event = LeanEvent()
    waiter = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    assert event._waiters
    event.set()
    await waiter
    assert event._waiters is None
