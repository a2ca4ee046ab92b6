"""A stand-in for an MQTT connection in queue-engine tests: its publish records each QoS 1 PUBLISH and
returns when the test acks it (the PUBACK), or raises ConnectionError once the test drops the connection."""

from __future__ import annotations

import asyncio


class FakeConnection:
    """Records (topic, payload) sends; :meth:`ack` completes the oldest unacked ones, :meth:`drop` fails them."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self._pending: list[asyncio.Future] = []
        self.open = True

    async def publish(self, topic: str, payload: bytes) -> None:
        if not self.open:
            raise ConnectionError("connection closed")
        future = asyncio.get_running_loop().create_future()
        self.sent.append((topic, payload))
        self._pending.append(future)
        await future

    @property
    def unacked(self) -> int:
        return sum(1 for f in self._pending if not f.done())

    def ack(self, count: int | None = None) -> None:
        """PUBACK the oldest ``count`` unacked sends (all when None)."""
        waiting = [f for f in self._pending if not f.done()]
        for future in waiting[:count]:
            future.set_result(None)

    def drop(self) -> None:
        self.open = False
        for future in self._pending:
            if not future.done():
                future.set_exception(ConnectionError("connection closed"))


async def publish(connection: FakeConnection, topic: str, payload: bytes, seqno: int | None = None,
                  ts_ms: int | None = None, expires_ms: int = 0, dup: bool = False) -> None:
    """The ``publish`` coroutine function the engine and Consumer take (seqno, ts_ms, expires_ms and dup are not
    recorded)."""
    await connection.publish(topic, payload)


async def settle(condition, timeout_s: float = 5.0) -> None:
    """Let the loop run until ``condition()`` is true; fails the test after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)
