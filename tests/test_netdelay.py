"""The delay proxy of the netdelay bench scenario (issue 24, point 9): a real proxy process between real sockets
on loopback delays each direction by its delay and keeps the byte order under pipelining."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from benchlib.delayproxy import ProxyProcess  # noqa: E402
from ecq.testing import free_port  # noqa: E402

DELAY_MS = 5.0


@pytest.fixture
def echo_port():
    """A TCP echo server on loopback (one connection); its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            while data := connection.recv(65536):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the proxy closed the connection"
        data += chunk
    return data


@pytest.mark.timeout(30)
def test_the_proxy_delays_each_way_and_keeps_the_order(echo_port):
    listen = free_port()
    proxy = ProxyProcess([(listen, echo_port)], DELAY_MS).start()
    try:
        client = socket.create_connection(("127.0.0.1", listen), timeout=10)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        round_trips = []
        for i in range(20):
            started = time.perf_counter()
            client.sendall(b"%04d" % i)
            assert read_exactly(client, 4) == b"%04d" % i
            round_trips.append((time.perf_counter() - started) * 1000)
        assert min(round_trips) >= 2 * DELAY_MS, f"round trips {min(round_trips):.2f} ms: not delayed both ways"
        pipelined = b"".join(b"%06d" % i for i in range(50_000))
        client.sendall(pipelined)
        assert read_exactly(client, len(pipelined)) == pipelined, "bytes reordered"
        client.close()
    finally:
        proxy.stop()
