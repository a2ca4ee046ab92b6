"""The test harness's free ports: two pytest-xdist workers never hand out the same port."""

from __future__ import annotations

import pytest

from ecq import testing


@pytest.mark.parametrize("worker, half", [("gw0", 0), ("gw1", 1)])
def test_each_xdist_worker_draws_ports_from_its_own_half_of_the_range(monkeypatch, worker, half):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    middle = (testing.LOWEST_TEST_PORT + testing._ephemeral_low()) // 2
    ports = [testing.free_port_range(3) for _ in range(50)]
    assert all((port >= middle) == bool(half) for port in ports), ports
    assert all(port + 2 < testing._ephemeral_low() for port in ports)


def test_outside_xdist_ports_come_from_the_whole_range(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert testing._worker_ports() == (testing.LOWEST_TEST_PORT, testing._ephemeral_low())
