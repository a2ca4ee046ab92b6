"""ecq.queue.deadlines.SharedDeadline: futures expire on time, one timer per event-loop iteration."""

import asyncio

import pytest

from ecq.queue.deadlines import SharedDeadline


async def test_shared_deadline_fails_only_futures_still_pending():
    deadline = SharedDeadline(0.05, "test read")
    loop = asyncio.get_running_loop()
    slow, quick = deadline.watch(loop.create_future()), deadline.watch(loop.create_future())
    quick.set_result("in time")
    with pytest.raises(TimeoutError, match="test read took longer than 0.05 s"):
        await asyncio.wait_for(slow, 5)
    assert quick.result() == "in time"


async def test_shared_deadline_arms_one_timer_per_loop_iteration(monkeypatch):
    loop = asyncio.get_running_loop()
    armed = []
    original = loop.call_later
    monkeypatch.setattr(loop, "call_later", lambda *a: armed.append(a) or original(*a))
    deadline = SharedDeadline(5, "test read")
    futures = [deadline.watch(loop.create_future()) for _ in range(100)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(armed) == 1
    for future in futures:
        future.set_result(None)
