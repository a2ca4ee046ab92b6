"""Shared fixtures: a fresh broker process per test and clients that are always closed."""

from __future__ import annotations

import pytest

from tests.harness import BrokerProcess, Client


@pytest.fixture
def make_broker(tmp_path):
    """Factory: make_broker(**plugin_options) -> started BrokerProcess; every one is killed at teardown."""
    started: list[BrokerProcess] = []

    def factory(**options) -> BrokerProcess:
        broker = BrokerProcess(tmp_path, **options).start()
        started.append(broker)
        return broker

    yield factory
    for broker in started:
        broker.kill()


@pytest.fixture
def broker(make_broker) -> BrokerProcess:
    """A broker with default ECQ options on a free loopback port and an empty data dir."""
    return make_broker()


@pytest.fixture
def connect():
    """Factory: connect(port, client_id, **kw) -> Client; all are closed at teardown."""
    clients: list[Client] = []

    def factory(port: int, client_id: str = "", **kwargs) -> Client:
        client = Client(port, client_id, **kwargs)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        try:
            client.close()
        except Exception:
            pass
