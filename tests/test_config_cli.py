"""Plugin options and `ecq broker` start-up: bad values stop start-up with a message naming the option."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from ecq.testing import ANONYMOUS_AUTH
from ecq.config import EcqSettings, parse_duration
from tests.harness import ECQ, Client, free_port, port_open, wait_until


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("5s", 5), ("10m", 600), ("1h", 3600), ("7d", 604800),
                                           (3, 3.0), ("2.5s", 2.5), ("42", 42)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_defaults_follow_the_spec():
    s = EcqSettings()
    assert (s.writer_pool_size, s.data_retention, s.gc_interval, s.reader_batch_size, s.write_timeout,
            s.read_timeout, s.max_payload_bytes) == (0, 7 * 86400, 3600, 5, 5, 5, 1024 * 1024)
    assert s.effective_pool_size() >= 1


@pytest.mark.parametrize("option, value, rule", [
    ("reader_batch_size", 0, "greater than or equal to 1"),
    ("reader_batch_size", 32, "less than or equal to 31"),
    ("writer_pool_size", 10241, "less than or equal to 10240"),
    ("writer_pool_size", -1, "greater than or equal to 0"),
    ("data_retention", "7 weeks", "not a duration"),
    ("gc_interval", "0s", "must be a duration from 100ms to 10 years"),
    ("write_timeout", True, "must be a duration"),
    ("max_payload_bytes", -5, "greater than or equal to 0"),
    ("retention", "7d", "Extra inputs are not permitted"),
    ("backend", "redis", "Input should be 'leveldb' or 'jetstream'"),
    ("nats_servers", ["http://127.0.0.1:4222"], "is not a NATS URL"),
    ("nats_servers", ["nats://127.0.0.1"], "is not HOST:PORT"),
    ("nats_servers", [], "at least 1 item"),
    ("jetstream_shards", 0, "greater than or equal to 1"),
    ("jetstream_replicas", 6, "less than or equal to 5"),
    ("jetstream_namespace", "ECQ.prod", "should match pattern"),
    ("node_name", "node 1", "should match pattern"),
    ("receive_maximum", 0, "greater than or equal to 1"),
    ("receive_maximum", 65536, "less than or equal to 65535"),
    ("topic_alias_maximum", -1, "greater than or equal to 0"),
])
def test_bad_option_names_option_and_rule(option, value, rule):
    with pytest.raises(ValidationError) as info:
        EcqSettings(**{option: value})
    assert option in str(info.value) and rule in str(info.value)


def run_broker(tmp_path, config: dict | str, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "broker.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return subprocess.run([ECQ, "broker", "-c", str(path), *extra], capture_output=True, text=True, timeout=30)


def ecq_config(**options) -> dict:
    return {"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{free_port()}"}},
            "plugins": {**ANONYMOUS_AUTH, "ecq.broker.plugin.EcqPlugin": options}}


@pytest.mark.parametrize("option, value, expected", [
    ("reader_batch_size", 40, "reader_batch_size: Input should be less than or equal to 31"),
    ("data_retention", "soon", "data_retention: Value error, 'soon' is not a duration"),
    ("gc_intervall", "1h", "option: unknown option gc_intervall: did you mean gc_interval?"),
    ("data_retension", "7d", "option: unknown option data_retension: did you mean data_retention?"),
    ("colour", "red", "option: unknown option colour\n"),  # nothing close: no guess
])
def test_broker_refuses_to_start_with_a_bad_option(tmp_path, option, value, expected):
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d"), **{option: value}))
    assert result.returncode == 2
    assert expected in result.stderr
    assert result.stderr.count("\n") == 4  # usage, hint, blank line, the one line of the error


def test_broker_refuses_config_without_the_plugin(tmp_path):
    result = run_broker(tmp_path, {"listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:1"}}})
    assert result.returncode == 2 and "does not list ecq.broker.plugin.EcqPlugin" in result.stderr


def test_broker_names_the_new_path_of_a_config_with_the_old_plugin_path(tmp_path):
    config = ecq_config(data_dir=str(tmp_path / "d"))
    config["plugins"]["ecq.plugin.EcqPlugin"] = config["plugins"].pop("ecq.broker.plugin.EcqPlugin")
    result = run_broker(tmp_path, config)
    assert result.returncode == 2
    assert "ecq.plugin.EcqPlugin is now ecq.broker.plugin.EcqPlugin" in result.stderr


def test_broker_refuses_unparsable_yaml(tmp_path):
    result = run_broker(tmp_path, "plugins: [unclosed")
    assert result.returncode == 2 and "cannot read broker config" in result.stderr


def test_broker_refuses_a_data_dir_in_use(make_broker, tmp_path):
    running = make_broker()
    result = run_broker(tmp_path / "..", ecq_config(data_dir=str(running.data_dir)))
    assert result.returncode == 1
    assert "another broker" in result.stderr


def test_default_config_with_bind_and_data_dir_and_sigint(tmp_path):
    port = free_port()
    proc = subprocess.Popen([ECQ, "broker", "--bind", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d")],
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert wait_until(lambda: port_open(port), 20)
        client = Client(port, "cfg1")
        client.publish("$ECQ/w/cfg1/k", "v")
        assert client.subscribe("$ECQ/cfg1/#") == 1
        assert client.expect(1)[0].payload == b"v"
        client.close()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 0
        assert "store closed" in stderr
        assert (tmp_path / "d" / "queues" / "CURRENT").exists()
    finally:
        proc.kill()



# --- values that would break the broker are refused at start-up --------------------------------

def refused(result: subprocess.CompletedProcess, code: int, *expected: str) -> None:
    assert result.returncode == code, result.stderr
    for text in expected:
        assert text in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("yaml_options, expected", [
    ("heartbeat_interval: .inf", "heartbeat_interval: Value error, must be a duration from 10ms to 10 years, not inf s"),
    ("read_timeout: .nan", "read_timeout: Value error, must be a duration from 10ms to 10 years, not nan s"),
    ("heartbeat_interval: 1.0e-7", "heartbeat_interval: Value error, must be a duration from 10ms to 10 years"),
    ("write_timeout: 0.001", "write_timeout: Value error, must be a duration from 10ms to 10 years"),
    ("gc_interval: 4000d", "gc_interval: Value error, must be a duration from 100ms to 10 years"),
    ("data_retention: 100ms", "data_retention: Value error, must be a duration from 1s to 10 years"),
    ("reader_batch_size: true", "reader_batch_size: Input should be a valid integer"),
    ("writer_pool_size: '4'", "writer_pool_size: Input should be a valid integer"),
    ("max_payload_bytes: 1.5", "max_payload_bytes: Input should be a valid integer"),
    ("sync_writes: 1", "sync_writes: Input should be a valid boolean"),
])
def test_broker_refuses_absurd_values(tmp_path, yaml_options, expected):
    config = yaml.safe_dump(ecq_config(data_dir=str(tmp_path / "d"))) + ""
    config = config.replace("ecq.broker.plugin.EcqPlugin:\n", f"ecq.broker.plugin.EcqPlugin:\n    {yaml_options}\n")
    refused(run_broker(tmp_path, config), 2, expected)


@pytest.mark.parametrize("bind", ["nonsense", ":99999", "127.0.0.1:", ":31911", "127.0.0.1:0", "[]:1883"])
def test_bind_option_must_be_host_and_port(tmp_path, bind):
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d")), "--bind", bind)
    refused(result, 2, f"Invalid value for '--bind': {bind!r} is not HOST:PORT with a host and a port from 1 to 65535")


@pytest.mark.parametrize("bind", [":1883", "127.0.0.1:", "localhost:70000", 1883])
def test_listener_bind_must_be_host_and_port(tmp_path, bind):
    config = ecq_config(data_dir=str(tmp_path / "d"))
    config["listeners"]["default"]["bind"] = bind
    refused(run_broker(tmp_path, config), 2, "listeners.default.bind:", "is not HOST:PORT")


@pytest.mark.parametrize("key, named", [("timeout-disconnect-delay", "'timeout-disconnect-delay' (did you mean "
                                                                    "timeout_disconnect_delay?)"),
                                        ("listners", "'listners' (did you mean listeners?)")])
def test_unknown_top_level_keys_are_refused(tmp_path, key, named):
    config = ecq_config(data_dir=str(tmp_path / "d"))
    config[key] = 2
    refused(run_broker(tmp_path, config), 2, f"unknown key(s) {named}", "amqtt accepts auth, listeners, plugins")


def test_unknown_listener_key_is_refused(tmp_path):
    config = ecq_config(data_dir=str(tmp_path / "d"))
    config["listeners"]["default"]["max_conections"] = 5
    refused(run_broker(tmp_path, config), 2,
            "listeners.default: unknown key(s) 'max_conections' (did you mean max_connections?)")


def test_the_operator_cli_loads_no_amqtt():
    """ecq.cli holds the commands; starting the broker (amqtt) lives in ecq.broker.server, imported by `ecq broker`
    alone, so that `ecq status` and the rest start without loading the broker."""
    code = "import sys, ecq.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'amqtt'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only tmpfs (unmounted at teardown)."""
    path = tmp_path / "ro"
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs (needs root): {result.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_unusable_data_dir_is_named(tmp_path, read_only_dir):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(run_broker(tmp_path, ecq_config(data_dir=str(a_file))), 2, f"data_dir {a_file}: exists and is not a directory")
    refused(run_broker(tmp_path, ecq_config(data_dir=str(a_file / "sub"))), 2,
            f"data_dir {a_file / 'sub'}: cannot create it: Not a directory")
    refused(run_broker(tmp_path, ecq_config(data_dir=str(read_only_dir))), 2, f"data_dir {read_only_dir}: not writable")


def listening_socket() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_mqtt_port_in_use_is_one_line_and_exit_1(tmp_path):
    sock, port = listening_socket()
    with sock:
        result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d"), admin_bind=""), "--bind", f"127.0.0.1:{port}")
    refused(result, 1, f"broker failed to start: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port})")
    assert result.stderr.count("ERROR") == 1


def test_admin_port_in_use_is_fatal(tmp_path):
    """A broker running without its API would let `ecq status` report on whichever broker holds the port."""
    sock, admin_port = listening_socket()
    mqtt_port = free_port()
    with sock:
        result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d"), admin_bind=f"127.0.0.1:{admin_port}"),
                            "--bind", f"127.0.0.1:{mqtt_port}")
    refused(result, 1, f"broker failed to start: cannot serve the admin API on 127.0.0.1:{admin_port}: "
                       "error while attempting to bind")
    assert "broker running" not in result.stderr and "Listener 'default' bind" not in result.stderr


def test_a_cluster_broker_that_cannot_reach_nats_refuses_to_start_naming_the_servers(tmp_path):
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d"), admin_bind="", backend="jetstream",
                                             nats_servers=[url]))
    assert result.returncode == 1
    assert f"broker failed to start: cannot reach NATS at {url}" in result.stderr


def test_more_replicas_than_nats_servers_are_refused_at_start_up(tmp_path, jetstream_options):
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d"), admin_bind="",
                                             **{**jetstream_options, "jetstream_replicas": 5}))
    assert result.returncode == 1
    assert "jetstream_replicas 5 needs as many NATS servers" in result.stderr


def test_a_cluster_broker_with_another_shard_count_than_the_streams_refuses_to_start(tmp_path, broker_process,
                                                                                       jetstream_options):
    broker_process(**jetstream_options).start().stop()  # creates the namespace's 2 shard streams
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d2"), admin_bind="",
                                             **{**jetstream_options, "jetstream_shards": 3}))
    assert result.returncode == 1
    assert "JetStream holds 2 ECQ shard streams" in result.stderr and "jetstream_shards is 3" in result.stderr


# --- IPv6 binds ----------------------------------------------------------------------------------------

def ipv6_loopback_works() -> bool:
    """True when this machine can listen on the IPv6 loopback ``::1``."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback_works(), reason="no IPv6 loopback (::1) on this machine")


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return sock.getsockname()[1]


def write_and_consume_over_ipv6(port: int, clientid: str) -> bytes:
    """One ECQ write and its delivery through paho connected to [::1]:``port``; returns the payload delivered."""
    import queue as queue_module

    import paho.mqtt.client as mqtt
    received: queue_module.Queue[bytes] = queue_module.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=clientid, protocol=mqtt.MQTTv311)
    client.on_message = lambda _c, _u, message: received.put(message.payload)
    client.connect("::1", port, keepalive=30)
    client.loop_start()
    try:
        client.publish(f"$ECQ/w/{clientid}/k", b"over ipv6", qos=1).wait_for_publish(10)
        client.subscribe(f"$ECQ/{clientid}/#", qos=1)
        return received.get(timeout=10)
    finally:
        client.loop_stop()
        client.disconnect()


def health_over_ipv6(admin_port: int) -> dict:
    import json
    import urllib.request
    with urllib.request.urlopen(f"http://[::1]:{admin_port}/api/v1/health", timeout=10) as response:
        return json.load(response)


@needs_ipv6
@pytest.mark.parametrize("where", ["--bind", "listener bind"])
def test_a_bracketed_ipv6_bind_serves_mqtt_and_the_admin_api(tmp_path, where):
    port, admin_port = free_port_v6(), free_port_v6()
    config = ecq_config(data_dir=str(tmp_path / "d"), admin_bind=f"[::1]:{admin_port}")
    extra: tuple[str, ...] = ()
    if where == "--bind":
        extra = ("--bind", f"[::1]:{port}", "--admin-bind", f"[::1]:{admin_port}")
    else:
        config["listeners"]["default"]["bind"] = f"[::1]:{port}"
    path = tmp_path / "broker.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([ECQ, "broker", "-c", str(path), *extra], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        def listening() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                socket.create_connection(("::1", port), timeout=0.2).close()
                return True
            except OSError:
                return False
        assert wait_until(listening, 20)
        assert write_and_consume_over_ipv6(port, "v6") == b"over ipv6"
        assert health_over_ipv6(admin_port) == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 0, stderr
        assert f"ECQ ready: MQTT on [::1]:{port} " in stderr
        assert f"admin API http://[::1]:{admin_port}/" in stderr
    finally:
        proc.kill()


@pytest.mark.parametrize("bind", ["::1:1883", "[::1:1883", "[localhost]:1883"])
def test_an_ipv6_bind_needs_its_brackets(tmp_path, bind):
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d")), "--bind", bind)
    refused(result, 2, f"{bind!r} is not HOST:PORT", "an IPv6 address in brackets: [::1]:1883")
