"""Why a client cannot connect is in the broker's log (ecq/broker/amqtt_hooks/authentication.py): a config that
lists no authentication plugin is warned of at start, and each refused CONNECT (MQTT 3.1.1 CONNACK 5, MQTT 5 0x87)
is logged with its reason, at most REFUSAL_LOG_BURST lines per REFUSAL_LOG_INTERVAL_S. Real broker subprocess,
raw CONNECTs over TCP."""

from __future__ import annotations

import time

import mqtt5
import yaml

from ecq.broker.amqtt_hooks.authentication import REFUSAL_LOG_BURST, REFUSAL_LOG_INTERVAL_S
from ecq.testing import ANONYMOUS_AUTH
from tests.harness import lines_let_through, wait_until
from tests.mqtt_wire import CONNACK, WireClient, connect_packet
from tests.test_mqtt5 import v5_packet

NO_PLUGIN = "the broker config lists no authentication plugin"


def started_with_plugins(broker_process, auth_plugins: dict):
    """A broker whose config lists ``auth_plugins`` (name -> options) in place of the anonymous one."""
    broker = broker_process()
    config = yaml.safe_load(broker.config_path.read_text())
    plugins = {name: options for name, options in config["plugins"].items() if name not in ANONYMOUS_AUTH}
    config["plugins"] = {**auth_plugins, **plugins}
    broker.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return broker.start()


def connack_code(port: int, packet: bytes) -> int:
    """The return code (3.1.1) or reason code (MQTT 5) of the CONNACK answering ``packet``."""
    client = WireClient(port)
    client.send(packet)
    answer = client.next()
    assert answer is not None and answer.kind == CONNACK, answer
    code = answer.body[1] if packet[8] == 4 else v5_packet(answer).reason_code  # byte 8: the protocol level
    assert client.until_closed() == []
    return code


def test_no_authentication_plugin_is_warned_of_at_start_and_each_refusal_is_logged(broker_process):
    broker = started_with_plugins(broker_process, {})
    assert wait_until(lambda: "ECQ ready" in broker.log(), 10), broker.log()
    log = broker.log()
    assert f"{NO_PLUGIN}, so every client will be refused" in log
    assert log.index(NO_PLUGIN) < log.index("ECQ ready")

    assert connack_code(broker.port, connect_packet("dev-3")) == 5
    assert connack_code(broker.port, mqtt5.ConnectPacket("dev-5", clean_start=True).write()) == 0x87
    for client_id in ("dev-3", "dev-5"):
        assert wait_until(lambda: f"CONNECT of client {client_id!r} (user None) from 127.0.0.1 refused (CONNACK "
                                  f"0x05, MQTT 5 0x87): {NO_PLUGIN}" in broker.log(), 10), broker.log()[-2000:]

    started = time.monotonic()
    for n in range(3 * REFUSAL_LOG_BURST):  # a client retrying in a loop
        assert connack_code(broker.port, connect_packet(f"loop-{n}")) == 5
    lines = broker.log().count("refused (CONNACK 0x05")
    assert 2 <= lines <= 2 + REFUSAL_LOG_BURST * lines_let_through(time.monotonic() - started,
                                                                     REFUSAL_LOG_INTERVAL_S)


def test_a_refusal_names_the_plugin_that_refused(broker_process):
    broker = started_with_plugins(broker_process, {"amqtt.plugins.authentication.AnonymousAuthPlugin":
                                                   {"allow_anonymous": False}})
    assert connack_code(broker.port, connect_packet("nameless")) == 5
    assert wait_until(lambda: "CONNECT of client 'nameless' (user None) from 127.0.0.1 refused (CONNACK 0x05, "
                              "MQTT 5 0x87): refused by AnonymousAuthPlugin" in broker.log(), 10), broker.log()
    assert NO_PLUGIN not in broker.log()
