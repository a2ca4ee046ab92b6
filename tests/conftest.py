"""Shared fixtures: a fresh broker process per test and clients that are always closed."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
import yaml

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
def broker_with_plugin(broker_process, monkeypatch):
    """Factory: broker_with_plugin(plugin_path, **plugin_options) -> a started BrokerProcess that also loads the
    test-only amqtt plugin ``plugin_path`` (a class in a module under tests/, e.g. tests.census_plugin)."""
    repo = str(Path(__file__).resolve().parent.parent)  # the broker process imports the plugin's module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))

    def factory(plugin_path: str, **options) -> BrokerProcess:
        broker = broker_process(**options)
        config = yaml.safe_load(broker.config_path.read_text())
        config["plugins"][plugin_path] = {}
        broker.config_path.write_text(yaml.safe_dump(config))
        return broker.start()

    return factory


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory):
    """A 3-server NATS JetStream cluster on loopback, shared by the tests of a session (each test keeps to a
    namespace of its own: see jetstream_options); stopped at the end."""
    from ecq.testing.nats import LocalNatsCluster
    cluster = LocalNatsCluster(tmp_path_factory.mktemp("nats")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def jetstream_options(nats_cluster):
    """Plugin options putting a broker on the session's NATS cluster, in a namespace of this test's own (so
    that tests share no queue), with 2 shards (fewer streams to create); its streams are deleted afterwards."""
    namespace = f"T{uuid.uuid4().hex[:12]}"
    yield {"backend": "jetstream", "nats_servers": nats_cluster.urls, "jetstream_namespace": namespace,
           "jetstream_shards": 2}
    asyncio.run(_delete_streams(nats_cluster.urls, namespace))


async def _delete_streams(urls: list[str], namespace: str) -> None:
    import nats
    client = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=2)
    try:
        js = client.jetstream(timeout=10)
        for info in await js.streams_info():
            if info.config.name.startswith((f"{namespace}_", f"KV_{namespace}_")):  # KV: ecq.broker.cluster_state
                await js.delete_stream(info.config.name)
    finally:
        await client.close()


@pytest.fixture
def cluster_nodes(tmp_path, request):
    """Factory: cluster_nodes(count=2, nats=None, lake_dir=None, **options) -> ``count`` ECQ brokers (not started)
    on one NATS cluster in one namespace: the session's ``nats_cluster`` in this test's namespace (see
    jetstream_options) unless ``nats`` (a LocalNatsCluster of the test's own) is given. Node i (1, 2, ... across
    every call of the test) has workdir ``tmp_path/node-<i>`` and node_name ``node-<i>``; ``lake_dir``, when
    given, is shared by the nodes. Every node is killed at teardown."""
    made: list[BrokerProcess] = []

    def factory(count: int = 2, nats=None, lake_dir=None, **options) -> list[BrokerProcess]:
        if nats is None:
            base = request.getfixturevalue("jetstream_options")
        else:
            base = {"backend": "jetstream", "nats_servers": nats.urls, "jetstream_namespace": "ECQT",
                    "jetstream_shards": 2}
        if lake_dir is not None:
            options["lake_dir"] = str(lake_dir)
        nodes = []
        for _ in range(count):
            name = f"node-{len(made) + 1}"
            workdir = tmp_path / name
            workdir.mkdir()
            node = BrokerProcess(workdir, **base, node_name=name, **options)
            made.append(node)
            nodes.append(node)
        return nodes

    yield factory
    for node in made:
        node.kill()


@pytest.fixture(params=["leveldb", "jetstream"])
def backend_broker(request, broker_process):
    """Factory like make_broker, once per storage backend: the embedded LevelDB, and JetStream on the session's
    3-server NATS cluster."""
    extra = request.getfixturevalue("jetstream_options") if request.param == "jetstream" else {}
    return lambda **options: broker_process(**extra, **options).start()


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
