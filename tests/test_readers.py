"""ecq.queue.readers.BatchedReader: results, errors, one thread hop per event-loop iteration, shutdown."""

import asyncio
import threading

import pytest

from ecq.queue.readers import BatchedReader


@pytest.fixture
def reader():
    batched = BatchedReader(threads=4)
    yield batched
    batched.shutdown()


async def test_reads_asked_in_one_iteration_run_in_one_thread_hop(reader):
    threads = []

    def square(n):
        threads.append(threading.get_ident())
        return n * n

    results = await asyncio.gather(*(reader.read(square, n) for n in range(100)))
    assert results == [n * n for n in range(100)]
    assert len(set(threads)) == 1 and threading.get_ident() not in threads


async def test_reads_in_later_iterations_are_new_batches(reader):
    first = await reader.read(threading.get_ident)
    second = await reader.read(lambda: 42)
    assert first != threading.get_ident() and second == 42


async def test_an_error_reaches_only_the_read_that_raised(reader):
    def fail():
        raise OSError("disk gone")

    outcomes = await asyncio.gather(reader.read(fail), reader.read(lambda: "ok"), return_exceptions=True)
    assert isinstance(outcomes[0], OSError) and str(outcomes[0]) == "disk gone"
    assert outcomes[1] == "ok"


async def test_a_read_given_up_by_its_caller_does_not_disturb_the_others(reader):
    release = threading.Event()

    def slow():
        release.wait(5)
        return "slow"

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(slow), 0.05)
    release.set()
    assert await asyncio.wait_for(reader.read(lambda: "next"), 5) == "next"


async def test_reads_after_shutdown_raise(reader):
    reader.shutdown()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(reader.read(lambda: 1), 5)

