"""What a device costs in memory (issue 32): amqtt's session state machine and queues replaced by small objects
(ecq.broker.amqtt_hooks.session_memory) that behave as the ones they replace, and the memory a persistent consumer
and its offline session take in a real broker (this process's, traced; sockets on loopback)."""

from __future__ import annotations

import asyncio
import sys
import tracemalloc
from pathlib import Path

import pytest
from amqtt.session import Session
from transitions import MachineError

from ecq.broker.amqtt_hooks.session_memory import SessionState, SmallQueue
from tests.harness import RawClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from benchlib.heapprobe import DISCONNECT, BrokerThread, open_devices, settle, warm_up  # noqa: E402


def test_session_state_runs_amqtts_transitions_and_their_callbacks():
    session = Session()
    state = SessionState(session)
    assert (state.state, state.is_new()) == ("new", True)
    state.connect()
    assert state.is_connected() and session.last_connect_time is not None and session.last_disconnect_time is None
    with pytest.raises(MachineError):
        state.connect()  # what Broker._handle_client_session takes for a takeover
    assert state.state == "connected"
    state.disconnect()
    assert state.is_disconnected() and session.last_disconnect_time is not None
    state.disconnect()  # disconnected -> disconnected, as amqtt's Machine allows
    state.connect()
    assert state.state == "connected" and session.last_disconnect_time is None
    fresh = SessionState(Session())
    fresh.disconnect()  # new -> disconnected: amqtt's create_offline_session
    assert fresh.state == "disconnected"


def test_small_queue_is_a_fifo_whose_get_waits_and_survives_cancellation():
    async def scenario():
        queue = SmallQueue()
        assert (queue.qsize(), queue.empty(), queue.full()) == (0, True, False)
        with pytest.raises(asyncio.QueueEmpty):
            queue.get_nowait()
        first = asyncio.ensure_future(queue.get())
        second = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        queue.put_nowait("a")
        first.cancel()  # woken by "a", then cancelled: "a" must go to the other getter
        assert await asyncio.wait_for(second, 5) == "a"
        await queue.put("b")
        queue.put_nowait("c")
        assert (queue.qsize(), queue.get_nowait(), await queue.get(), queue.empty()) == (2, "b", "c", True)
        watcher, woken_elsewhere = (asyncio.get_running_loop().create_future() for _ in range(2))
        woken_elsewhere.set_result(None)  # the message loop's future, already resolved by another queue
        queue.wake_on_put(woken_elsewhere)
        queue.wake_on_put(watcher)
        queue.put_nowait("d")
        assert watcher.done() and queue.get_nowait() == "d"  # a watcher is woken, the item stays queued
        queue.wake_on_put(watcher)
        queue.forget(watcher)
        queue.put_nowait("e")  # nobody to wake
        assert queue.qsize() == 1
    asyncio.run(scenario())
    with pytest.raises(ValueError):
        SmallQueue(maxsize=10)


def test_a_takeover_and_a_reconnect_keep_a_persistent_session_and_its_queued_message(broker, connect):
    """The state object's MachineError makes the takeover, its connect from ``disconnected`` the resume; the
    session's queue keeps an ordinary QoS 1 message published while it was offline (MQTT 3.1.1 sections 3.1.2.4,
    3.1.4)."""
    first = RawClient(broker.port, "sm1", clean_session=False)
    assert first.subscribe(b"plain/sm1", qos=1) == (0x90, b"\x00\x01\x01")
    second = RawClient(broker.port, "sm1", clean_session=False)
    try:
        with pytest.raises(ConnectionError):
            first.ping()  # closed by the takeover
        assert second.ping()
        second.send_raw(DISCONNECT)
        second.read_until_closed()
        connect(broker.port, "pub").publish("plain/sm1", b"while offline", qos=1)
        third = RawClient(broker.port, "sm1", clean_session=False)
        try:
            topic, _, payload = third.receive_publish()
            assert (topic, payload) == (b"plain/sm1", b"while offline")
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def broker_heap() -> int:
    """Bytes traced, less those of the test's own side (pytest's log capture, the devices' sockets)."""
    others = [tracemalloc.Filter(False, pattern) for pattern in ("*/logging/*", "*/_pytest/*", "*/heapprobe.py",
                                                                   __file__, "*/socket.py")]
    return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(others).statistics("filename"))


def test_a_persistent_consumer_holds_a_few_tasks_not_nine(tmp_path):
    """Tasks per connected consumer, 200 persistent consumers subscribed to ``$ECQ/<cid>/#`` (amqtt's message loop kept
    four waiter tasks each: 7 in all; the loop of one future: 3). Their traced heap, connected and then offline, is
    printed: memory is measured by ``scripts/bench --scenario fleet`` and ``benchlib.heapprobe``, not asserted here
    (docs/benchmarks.md)."""
    devices = 200
    broker = BrokerThread(str(tmp_path))
    warm_up(broker)
    tracemalloc.start(1)
    try:
        settle()
        before, tasks_before = broker_heap(), broker.call(lambda: len(asyncio.all_tasks()))
        sockets = open_devices(broker.port, "mem", devices, persistent=True)
        settle()
        online_kib = (broker_heap() - before) / devices / 1024
        tasks = (broker.call(lambda: len(asyncio.all_tasks())) - tasks_before) / devices
        for sock in sockets:
            sock.sendall(DISCONNECT)
            sock.close()
        sessions = broker.broker._sessions
        broker.wait_until(lambda: all(s.transitions.state == "disconnected" for s, _ in sessions.values()), timeout=60)
        broker.wait_until(lambda: len(asyncio.all_tasks()) <= tasks_before, timeout=60)  # connections torn down
        settle()
        offline_kib = (broker_heap() - before) / devices / 1024
    finally:
        tracemalloc.stop()
        broker.stop()
    print(f"{online_kib:.1f} KiB and {tasks:.1f} tasks per connected consumer, {offline_kib:.1f} KiB offline")
    assert tasks <= 4, f"{tasks:.1f} tasks per connected consumer"
