"""Shared fixtures: a fresh broker process per test and clients that are always closed."""

from __future__ import annotations

import pytest

from tests.harness import BrokerProcess, Client


@pytest.fixture
def broker_process(tmp_path):
    """Factory: broker_process(**options) -> BrokerProcess in ``tmp_path``, not started (its config and data dir
    can be prepared first); every one is killed at teardown, whoever started it."""
    made: list[BrokerProcess] = []

    def factory(**options) -> BrokerProcess:
        broker = BrokerProcess(tmp_path, **options)
        made.append(broker)
        return broker

    yield factory
    for broker in made:
        broker.kill()


@pytest.fixture
def make_broker(broker_process):
    """Factory: make_broker(**plugin_options) -> started BrokerProcess; every one is killed at teardown."""
    return lambda **options: broker_process(**options).start()


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
