"""ecq.queue.deadlines: SharedDeadline's futures expire on time, one timer per event-loop iteration; DeadlineHeap
keeps one live deadline per key, against a plain dict (hypothesis), with its stale entries bounded."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ecq.queue.deadlines import DeadlineHeap, SharedDeadline


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


keys = st.sampled_from(["a", "b", "c", "d"])
heap_steps = st.lists(st.one_of(st.tuples(st.just("set"), keys, st.integers(0, 20)),
                                st.tuples(st.just("discard"), keys, st.just(0)),
                                st.tuples(st.just("pop_due"), st.just(""), st.integers(0, 20))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(heap_steps)
def test_a_deadline_heap_keeps_one_live_deadline_per_key(steps):
    """Whatever the sets, discards and sweeps, a key is due once, at the last deadline set for it, with its value."""
    heap, model = DeadlineHeap(), {}
    heap.STALE_SLACK = 2
    for kind, key, number in steps:
        if kind == "set":
            heap.set(key, number, f"{key}@{number}")
            model[key] = number
        elif kind == "discard":
            heap.discard(key)
            model.pop(key, None)
        else:
            due = sorted((deadline, key) for key, deadline in model.items() if deadline <= number)
            assert heap.pop_due(number) == [(key, f"{key}@{deadline}") for deadline, key in due]
            for _deadline, key in due:
                del model[key]
        assert len(heap) == len(model) and all(key in heap for key in model)
        assert heap.next_deadline() == min(model.values(), default=None)
        assert heap.entries <= 2 * len(model) + heap.STALE_SLACK


def test_a_deadline_heap_wakes_its_sweeper_only_for_an_earlier_deadline():
    wakes = []
    heap = DeadlineHeap(on_earlier=lambda: wakes.append(1))
    heap.set("late", 10)
    heap.set("later", 20)
    heap.set("early", 5)
    assert len(wakes) == 2 and heap.next_deadline() == 5
