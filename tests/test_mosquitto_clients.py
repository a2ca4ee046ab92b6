"""Delivery, compaction, refused writes and ownership with Debian's mosquitto_pub / mosquitto_sub as the clients."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from tests.harness import wait_until

def mosquitto_pub(port: int, topic: str, message: str, qos: int = 1) -> None:
    subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-q", str(qos), "-t", topic, "-m", message],
                   check=True, timeout=10)


class MosquittoSub:
    """mosquitto_sub in the background (line-buffered through stdbuf); -d shows the SUBACK; ``persistent``: ``-c``,
    a persistent session (CleanSession 0)."""

    def __init__(self, port: int, client_id: str, topic: str, qos: int = 1, persistent: bool = False) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["stdbuf", "-oL", "mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-i", client_id,
             "-q", str(qos), "-t", topic, "-d", "-F", "MSG %t %p q%q", *(["-c"] if persistent else [])],
            stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        assert wait_until(lambda: any("received SUBACK" in line for line in self.lines), 10), self.lines

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def messages(self) -> list[str]:
        return [line[4:] for line in self.lines if line.startswith("MSG ")]

    def wait_messages(self, count: int, timeout: float = 10.0) -> list[str]:
        wait_until(lambda: len(self.messages()) >= count, timeout)
        return self.messages()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


@pytest.fixture
def mosquitto_sub():
    subs: list[MosquittoSub] = []

    def factory(*args, **kwargs) -> MosquittoSub:
        subs.append(MosquittoSub(*args, **kwargs))
        return subs[-1]

    yield factory
    for sub in subs:
        sub.close()


def test_p14_realtime(broker, mosquitto_sub):
    sub = mosquitto_sub(broker.port, "mq1", "$ECQ/mq1/#")
    mosquitto_pub(broker.port, "$ECQ/w/mq1/cfg/apn", "internet")
    assert sub.wait_messages(1) == ["$ECQ/mq1/cfg/apn internet q1"]


def test_p14_reactive_and_compaction(broker, mosquitto_sub):
    for topic, message in [("a", "a1"), ("b", "b1"), ("a", "a2"), ("c/d", "cd1"), ("b", "b2")]:
        mosquitto_pub(broker.port, f"$ECQ/w/mq2/{topic}", message)
    sub = mosquitto_sub(broker.port, "mq2", "$ECQ/mq2/#")
    assert sub.wait_messages(3) == ["$ECQ/mq2/a a2 q1", "$ECQ/mq2/c/d cd1 q1", "$ECQ/mq2/b b2 q1"]
    time.sleep(1.0)
    assert len(sub.messages()) == 3


def test_p14_publish_without_w_is_refused(broker, mosquitto_sub):
    sub = mosquitto_sub(broker.port, "mq3", "$ECQ/mq3/#")
    plain = mosquitto_sub(broker.port, "mq3-plain", "plain/#")
    mosquitto_pub(broker.port, "$ECQ/mq3/k", "sneaky")
    mosquitto_pub(broker.port, "plain/x", "routed")
    assert plain.wait_messages(1) == ["plain/x routed q1"]
    time.sleep(1.0)
    assert sub.messages() == []
    assert "reason not_a_write" in broker.log()


def test_p14_foreign_queue_subscription_is_refused(broker):
    mosquitto_pub(broker.port, "$ECQ/w/mq4/k", "secret")
    result = subprocess.run(["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-i", "intruder", "-q", "1",
                             "-t", "$ECQ/mq4/#", "-W", "2", "-v"], capture_output=True, text=True, timeout=10)
    assert "secret" not in result.stdout
    assert "denied" in result.stderr
