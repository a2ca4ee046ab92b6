"""The ACL file in a live broker: deny on publish and subscribe, ECQ ownership, reload."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.harness import ECQ, free_port, wait_until

RULES = """
% test rules: first match decides
{deny, {clientid, "blocked"}, publish, ["plain/#"]}.
{allow, {username, "backend"}, publish, ["$ECQ/w/#"]}.
{deny, all, publish, ["$ECQ/w/#"]}.
{deny, {clientid, {re, "^guest-"}}, subscribe, ["sensors/#"]}.
{allow, {'and', [{clientid, {re, "^dev"}}, {ipaddr, "127.0.0.0/8"}]}, subscribe, ["devices/${clientid}/#"]}.
{deny, all, subscribe, ["devices/#"]}.
{allow, all, subscribe, ["$ECQ/#"]}.
{allow, all}.
"""


@pytest.fixture
def make_broker(backend_broker):
    """Every test with a live broker runs on each storage backend (LevelDB, JetStream)."""
    return backend_broker


def acl_broker(make_broker, tmp_path, rules: str = RULES, **options):
    path = tmp_path / "acl.conf"
    path.write_text(rules)
    return make_broker(acl_file=str(path), **options), path


def test_denied_publish_is_dropped_and_the_client_kept(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path)
    listener = connect(broker.port, "listener")
    listener.subscribe("plain/#")
    blocked = connect(broker.port, "blocked")
    blocked.publish("plain/x", "dropped")
    blocked.publish("other/x", "fine")
    assert listener.quiet(1.0) == []
    assert not blocked.disconnected.is_set()
    connect(broker.port, "someone").publish("plain/x", "routed")
    assert listener.expect(1)[0].payload == b"routed"


def test_acl_decides_who_may_write_to_ecq_queues(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path)
    connect(broker.port, "stranger").publish("$ECQ/w/acl1/k", "from-stranger")
    connect(broker.port, "writer", username="backend").publish("$ECQ/w/acl1/k", "from-backend")
    assert "reason acl_denied" in broker.log()
    consumer = connect(broker.port, "acl1")
    consumer.subscribe("$ECQ/acl1/#")
    assert [m.payload for m in consumer.expect(1)] == [b"from-backend"]
    assert consumer.quiet(1.0) == []


def test_denied_subscribe_gets_a_suback_failure(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path)
    assert connect(broker.port, "guest-7").subscribe("sensors/#") == 0x80
    assert connect(broker.port, "member").subscribe("sensors/#") == 1


def test_placeholder_and_and_ipaddr_rules(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path)
    device = connect(broker.port, "dev42")
    assert device.subscribe("devices/dev42/cmd") == 1
    assert device.subscribe("devices/dev43/cmd") == 0x80
    assert connect(broker.port, "laptop").subscribe("devices/laptop/cmd") == 0x80


def test_ecq_ownership_holds_whatever_the_file_says(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path)  # the file allows everyone to subscribe to $ECQ/#
    assert connect(broker.port, "intruder").subscribe("$ECQ/victim/#") == 0x80
    assert connect(broker.port, "victim").subscribe("$ECQ/victim/#") == 1


def test_nomatch_default_can_be_deny(make_broker, connect, tmp_path):
    broker, _ = acl_broker(make_broker, tmp_path, rules='{allow, all, subscribe, ["ok/#"]}.\n',
                           acl_nomatch="deny")
    client = connect(broker.port, "c")
    assert client.subscribe("ok/x") == 1
    assert client.subscribe("other/x") == 0x80


def test_parse_error_stops_startup_with_file_and_line(tmp_path):
    path = tmp_path / "bad.conf"
    path.write_text('{allow, all, subscribe, ["a/#"]}.\n\n{allow, {clientid, "x"}, fly, ["a"]}.\n')
    result = subprocess.run([ECQ, "broker", "--bind", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "d"),
                             "--acl", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{path}:3:" in result.stderr


def test_sighup_reloads_and_a_bad_reload_keeps_the_old_rules(make_broker, connect, tmp_path):
    broker, path = acl_broker(make_broker, tmp_path, rules="{allow, all}.\n")
    assert connect(broker.port, "r1").subscribe("secret/x") == 1
    path.write_text('{deny, all, subscribe, ["secret/#"]}.\n{allow, all}.\n')
    broker.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: "ACL reloaded" in broker.log(), 5)
    assert connect(broker.port, "r2").subscribe("secret/x") == 0x80
    path.write_text("{allow, all\n")
    broker.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: "ACL reload failed, keeping the old rules" in broker.log(), 5)
    assert f"{path}:" in broker.log()
    assert connect(broker.port, "r3").subscribe("secret/x") == 0x80


def test_admin_reload(make_broker, connect, tmp_path):
    broker, path = acl_broker(make_broker, tmp_path, rules="{allow, all}.\n")
    path.write_text('{deny, all, subscribe, ["x/#"]}.\n{allow, all}.\n')
    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}/api/v1/acl/reload", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response) == {"reloaded": True, "rules": 2}
    assert connect(broker.port, "a1").subscribe("x/y") == 0x80
    path.write_text("garbage")
    try:
        urllib.request.urlopen(request, timeout=10)
        raise AssertionError("a bad file must be refused")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and f"{path}:1:" in json.load(exc)["error"]
    time.sleep(0.1)
    assert connect(broker.port, "a2").subscribe("x/y") == 0x80


def test_a_username_with_a_slash_cannot_write_into_another_users_queue(make_broker, connect, tmp_path):
    rules = '{allow, all, publish, ["$ECQ/w/${username}/#"]}.\n{deny, all, publish, ["$ECQ/w/#"]}.\n{allow, all}.\n'
    broker, _ = acl_broker(make_broker, tmp_path, rules=rules)
    connect(broker.port, "intruder", username="alice/x").publish("$ECQ/w/alice/x/k", "forged")
    connect(broker.port, "owner", username="alice").publish("$ECQ/w/alice/control", "control")
    consumer = connect(broker.port, "alice")
    consumer.subscribe("$ECQ/alice/#")
    assert [(m.topic, m.payload) for m in consumer.expect(1)] == [("$ECQ/alice/control", b"control")]
    assert consumer.quiet(1.0) == []
    assert "reason acl_denied" in broker.log()
