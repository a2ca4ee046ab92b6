"""Operations over a live broker: the operator CLI as a subprocess, the admin API, Prometheus metrics."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import ECQ, free_port, metrics_text, wait_until, write
from tests.mqtt_wire import WireClient, subscribe_packet


def ecq(*args: str, admin: int | None = None) -> subprocess.CompletedProcess:
    extra = ["--admin", f"127.0.0.1:{admin}"] if admin else []
    return subprocess.run([ECQ, *args, *extra], capture_output=True, text=True, timeout=30)


def scrape(broker) -> dict[str, float]:
    """Every sample of /metrics as {name{labels}: value}."""
    samples = {}
    for family in text_string_to_metric_families(metrics_text(broker)):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_status_and_inspect_follow_writes_and_acks(broker, connect):
    empty = ecq("status", "--json", admin=broker.admin_port)
    assert empty.returncode == 0, empty.stderr
    assert json.loads(empty.stdout)["queues"] == 0
    producer = connect(broker.port, "producer")
    for key, value in [("a", "1"), ("b", "2"), ("a", "3"), ("c", "4")]:
        write(producer, "client1", key, value)
    status = json.loads(ecq("status", "--json", admin=broker.admin_port).stdout)
    assert (status["queues"], status["messages"], status["bytes"], status["consumers_online"]) == (1, 3, 3, 0)
    assert status["first_index"]["clientid"] == "client1" and status["first_index"]["seqno"] == 2
    assert status["last_index"]["seqno"] == 4
    before = json.loads(ecq("inspect", "client1", "--json", admin=broker.admin_port).stdout)
    assert (before["acked"], before["last_ack_ts"], before["range"], before["pending"], before["online"]) == (
        0, None, "[2,...,4]", 3, False)
    assert before["pending_bytes"] == 3 and 0 <= before["oldest_pending_age_s"] < 60
    consumer = connect(broker.port, "client1", manual_ack=True)
    consumer.subscribe("$ECQ/client1/#")
    first, second, _third = consumer.expect(3)
    consumer.ack(first)
    consumer.ack(second)

    def inspect_json() -> dict:
        return json.loads(ecq("inspect", "client1", "--json", admin=broker.admin_port).stdout)
    assert wait_until(lambda: inspect_json()["acked"] == 3, 10)  # the two PUBACKs reached the broker
    after = inspect_json()
    assert (after["acked"], after["pending"], after["inflight"], after["online"]) == (3, 1, 1, True)
    assert after["pending_bytes"] == 1
    assert after["last_ack_ts"].endswith("Z")
    human = ecq("inspect", "client1", admin=broker.admin_port)
    assert "queue range: [2,...,4]" in human.stdout and "acked:       3" in human.stdout
    assert "pending:     1 (1 bytes, oldest " in human.stdout
    status_text = ecq("status", admin=broker.admin_port).stdout
    assert "consumers online:  1" in status_text and "client1  acked 3" in status_text


def test_bytes_stored_are_the_payload_bytes_of_the_stored_entries_on_either_backend(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    for clientid, key, value in [("b1", "a", "12345"), ("b1", "a", "123"), ("b1", "b", ""), ("b2", "k", "x" * 40)]:
        write(producer, clientid, key, value)  # b1/a compacted to its 3 bytes; the tombstone b1/b holds none
    expected = (3, 3 + 0 + 40)

    def figures() -> tuple:
        status = json.loads(ecq("status", "--json", admin=broker.admin_port).stdout)
        m = scrape(broker)
        return (status["messages"], status["bytes"]), (m["ecq_stored_messages"], m["ecq_stored_bytes"])
    assert wait_until(lambda: figures() == (expected, expected), 10), figures()  # a cluster hears its notices
    text = ecq("status", admin=broker.admin_port).stdout
    assert "messages stored:   3\n" in text and "bytes stored:      43\n" in text


def test_status_says_in_which_order_it_picked_its_two_index_entries(backend_broker, connect):
    broker = backend_broker()
    producer = connect(broker.port, "producer")
    write(producer, "b-older", "k", "1")
    write(producer, "a-newer", "k", "2")  # first by clientid, yet the newest entry
    status = json.loads(ecq("status", "--json", admin=broker.admin_port).stdout)
    text = ecq("status", admin=broker.admin_port).stdout
    assert "first index entry" not in text and "last index entry" not in text
    if status["index_order"] == "clientid":  # LevelDB: the key order, which says nothing of age
        assert (status["first_index"]["clientid"], status["last_index"]["clientid"]) == ("a-newer", "b-older")
        assert "index entries:     by clientid then seqno (key order, not age)\n  first:           a-newer" in text
    else:
        assert status["index_order"] == "time" and broker.options.get("backend") == "jetstream"
        assert (status["first_index"]["clientid"], status["last_index"]["clientid"]) == ("b-older", "a-newer")
        assert "oldest entry:      b-older seqno" in text and "newest entry:      a-newer seqno" in text


# ESC sequences (clear the screen, set the window title), CR and newline (a faked line), BEL, DEL and a C1 CSI:
# the topic grammar admits them in a clientid and a key
HOSTILE_ID, HOSTILE_KEY = "evil\x1b[2J\r\nfake line\x07\x7f\x9b", "k\x1b]0;title\x07"
SHOWN_ID, SHOWN_KEY = r"evil\x1b[2J\r\nfake line\x07\x7f\x9b", r"k\x1b]0;title\x07"


def test_names_with_control_characters_are_shown_escaped_and_exact_in_json(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, HOSTILE_ID, HOSTILE_KEY, "v")
    for command in (["status"], ["inspect", HOSTILE_ID], ["top"]):
        shown = ecq(*command, admin=broker.admin_port)
        assert shown.returncode == 0, shown.stderr
        assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", shown.stdout), (command, shown.stdout)
        assert SHOWN_ID in shown.stdout, (command, shown.stdout)
        assert not any(line.startswith("fake line") for line in shown.stdout.splitlines())
    assert SHOWN_KEY in ecq("status", admin=broker.admin_port).stdout
    status = json.loads(ecq("status", "--json", admin=broker.admin_port).stdout)
    assert (status["first_index"]["clientid"], status["first_index"]["key"]) == (HOSTILE_ID, HOSTILE_KEY)
    missing = ecq("rewind", HOSTILE_ID + "x", "0", admin=broker.admin_port)
    assert missing.returncode == 1 and SHOWN_ID + "x" in missing.stderr
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", missing.stderr)


def test_a_client_named_with_control_characters_is_logged_escaped(broker):
    client, _ = WireClient.connected(broker.port, HOSTILE_ID)
    client.send(subscribe_packet(1, (f"$ECQ/{HOSTILE_ID}/#", 0)))  # refused and logged: queues are read at QoS 1
    assert client.next() is not None
    assert wait_until(lambda: f"ECQ refused SUBSCRIBE of {SHOWN_ID}" in broker.log(), 10), broker.log()[-2000:]
    log = broker.log()
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", log)
    assert not any(line.startswith("fake line") for line in log.splitlines())


def test_inspect_unknown_queue_exits_1(broker):
    result = ecq("inspect", "nobody", admin=broker.admin_port)
    assert result.returncode == 1 and "no queue" in result.stderr


def test_no_broker_and_no_data_dir_exits_3(tmp_path):
    result = ecq("status", "--data-dir", str(tmp_path / "none"), admin=free_port())
    assert result.returncode == 3 and "no broker answers" in result.stderr


def test_usage_error_exits_2():
    assert ecq("show-config", "everything").returncode == 2
    assert ecq("inspect").returncode == 2


def test_status_and_inspect_read_the_data_dir_when_the_broker_is_down(broker, connect):
    producer = connect(broker.port, "producer")
    write(producer, "off1", "k", "v")
    producer.close()
    assert broker.stop() == 0
    status = ecq("status", "--json", "--data-dir", str(broker.data_dir), admin=broker.admin_port)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["messages"] == 1
    inspect = ecq("inspect", "off1", "--data-dir", str(broker.data_dir), admin=broker.admin_port)
    assert inspect.returncode == 0 and "queue range: [1]" in inspect.stdout


def test_gc_now_reports_what_it_deleted(make_broker, connect):
    broker = make_broker(data_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "gcn", "a", "1")
    write(producer, "gcn", "b", "2")
    time.sleep(1.2)
    result = ecq("gc", "--json", admin=broker.admin_port)
    assert result.returncode == 0 and json.loads(result.stdout) == {"deleted": 2}
    assert ecq("gc", admin=broker.admin_port).stdout.strip() == "GC deleted 0 expired entries"


def test_show_config_origin_and_inuse(make_broker):
    broker = make_broker(data_retention="2h", reader_batch_size=7)
    origin = json.loads(ecq("show-config", "origin", "--json", admin=broker.admin_port).stdout)
    inuse = json.loads(ecq("show-config", "inuse", "--json", admin=broker.admin_port).stdout)
    assert origin["data_retention"] == "2h" and "gc_interval" not in origin
    assert inuse["data_retention"] == 7200.0 and inuse["gc_interval"] == 3600.0 and inuse["reader_batch_size"] == 7
    assert "reader_batch_size: 7" in ecq("show-config", admin=broker.admin_port).stdout


def test_show_config_inuse_shows_the_values_in_effect_as_yaml(make_broker):
    broker = make_broker(writer_pool_size=0, events=False, max_payload_bytes=1000)
    inuse = json.loads(ecq("show-config", "--json", admin=broker.admin_port).stdout)
    assert inuse["writer_pool_size"] == (os.cpu_count() or 1)  # 0 means one agent per CPU
    assert inuse["lake_dir"] == str(broker.data_dir / "lake")
    assert inuse["max_packet_bytes"] == 1000 + 65_539  # None: max_payload_bytes + a PUBLISH's largest header
    assert inuse["node_name"].endswith(f"-{broker.proc.pid}")  # None: <hostname>-<pid>
    text = ecq("show-config", admin=broker.admin_port).stdout
    assert yaml.safe_load(text) == inuse
    assert "None" not in text and "False" not in text and "events: false" in text and "acl_file: null" in text
    assert "max_packet_bytes: null" not in text and "node_name: null" not in text
    assert "writer_pool_size: " in text and "max_packet_bytes: 66539  # default, computed\n" in text
    assert "data_retention: 604800.0  # default\n" in text and "events: false\n" in text  # events: given


def ready_line(broker) -> str:
    """The broker's one "ECQ ready:" log line, logged just after its port accepts (amqtt's post-start event)."""
    assert wait_until(lambda: "ECQ ready:" in broker.log(), 10), broker.log()
    [line] = [line for line in broker.log().splitlines() if "ECQ ready:" in line]
    return line


def test_start_up_log_says_where_everything_is(make_broker):
    broker = make_broker(writer_pool_size=3)
    line = ready_line(broker)
    assert f"MQTT on 127.0.0.1:{broker.port} (listen backlog 1024)" in line
    assert f"admin API http://127.0.0.1:{broker.admin_port}/" in line
    assert f"data_dir {broker.data_dir};" in line and f"lake {broker.data_dir / 'lake'};" in line
    assert "; queues in LevelDB;" in line and line.endswith("3 writer agents")


def test_a_cluster_node_says_where_its_queues_are_at_start_up(broker_process, jetstream_options):
    broker = broker_process(**jetstream_options, node_name="node-7").start()
    line = ready_line(broker)
    assert (f"queues on JetStream at {', '.join(jetstream_options['nats_servers'])} (namespace "
            f"{jetstream_options['jetstream_namespace']}, 2 shards, 3 replicas; node node-7)") in line


def test_version():
    result = subprocess.run([ECQ, "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == f"ecq {importlib.metadata.version('ecq')}"


def test_admin_token_is_required_when_set(make_broker):
    broker = make_broker(admin_token="s3cret")
    refused = ecq("status", admin=broker.admin_port)
    assert refused.returncode == 3 and "bearer token" in refused.stderr
    assert ecq("status", "--token", "s3cret", admin=broker.admin_port).returncode == 0


def ecq_env(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`ecq ARGS` with ``env`` added to the environment, and no ECQ_ADMIN or ECQ_ADMIN_TOKEN of the caller's."""
    base = {k: v for k, v in os.environ.items() if k not in ("ECQ_ADMIN", "ECQ_ADMIN_TOKEN")}
    return subprocess.run([ECQ, *args], capture_output=True, text=True, timeout=30, env={**base, **env})


def test_the_cli_finds_the_admin_api_in_the_broker_config_then_the_environment_then_the_flag(make_broker):
    port = free_port()
    broker = make_broker(admin_bind=f"0.0.0.0:{port}", admin_token="s3cret")  # a wildcard bind: called on loopback
    config = str(broker.config_path)
    from_config = ecq_env("status", "--json", "-c", config)  # admin_bind and admin_token from the config
    assert from_config.returncode == 0, from_config.stderr
    assert json.loads(from_config.stdout)["queues"] == 0
    from_env = ecq_env("gc", ECQ_ADMIN=f"127.0.0.1:{port}", ECQ_ADMIN_TOKEN="s3cret")
    assert from_env.returncode == 0, from_env.stderr
    nowhere = f"127.0.0.1:{free_port()}"
    env_over_config = ecq_env("gc", "-c", config, ECQ_ADMIN=nowhere)  # the token still comes from the config
    assert env_over_config.returncode == 3 and f"no broker answers at {nowhere}" in env_over_config.stderr
    flag_over_env = ecq_env("gc", "--admin", f"127.0.0.1:{port}", "-c", config, ECQ_ADMIN=nowhere)
    assert flag_over_env.returncode == 0, flag_over_env.stderr
    wrong_token = ecq_env("gc", "-c", config, ECQ_ADMIN_TOKEN="wrong")
    assert wrong_token.returncode == 3 and "bearer token" in wrong_token.stderr


@pytest.mark.parametrize("config, error", [
    (None, "cannot read broker config {path}: [Errno 2] No such file or directory"),
    ("plugins: [unclosed", "cannot read broker config {path}:"),
    ({"plugins": {"ecq.broker.plugin.EcqPlugin": {"admin_bnd": "127.0.0.1:1"}}},
     "invalid ecq.broker.plugin.EcqPlugin option: unknown option admin_bnd: did you mean admin_bind?"),
    ({"plugins": {"ecq.broker.plugin.EcqPlugin": {"admin_bind": None}}}, "turns the admin API off"),
])
def test_a_broker_config_that_does_not_tell_where_the_admin_api_is_is_one_line_and_exit_2(tmp_path, config, error):
    path = tmp_path / "broker.yaml"
    if config is not None:
        path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    result = ecq_env("status", "-c", str(path), "--data-dir", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert error.format(path=path) in result.stderr and result.stderr.count("\n") == 1


def test_admin_refuses_non_loopback_bind_without_token(tmp_path):
    result = subprocess.run([ECQ, "broker", "--bind", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path),
                             "--admin-bind", f"0.0.0.0:{free_port()}"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "set admin_token" in result.stderr


def test_metrics_count_what_happened(broker, connect):
    producer = connect(broker.port, "producer")
    for key, value in [("a", "1"), ("a", "2"), ("b", "3")]:
        write(producer, "m1", key, value)
    producer.publish("$ECQ/m1/no-w", "refused")
    consumer = connect(broker.port, "m1")
    consumer.subscribe("$ECQ/m1/#")
    consumer.expect(2)
    assert wait_until(lambda: scrape(broker)["ecq_acks_total"] == 2, 10)  # paho's PUBACKs reached the broker
    m = scrape(broker)
    assert m["ecq_writes_accepted_total"] == 3
    assert m["ecq_writes_refused_total{reason=not_a_write}"] == 1
    assert m["ecq_compactions_total"] == 1
    assert m["ecq_deliveries_total"] == 2 and m["ecq_redeliveries_total"] == 0
    assert m["ecq_acks_total"] == 2
    assert (m["ecq_queues"], m["ecq_stored_messages"], m["ecq_stored_bytes"]) == (1, 2, 2)
    assert m["ecq_consumers_online"] == 1 and m["ecq_inflight"] == 0
    assert m["ecq_append_latency_seconds_count"] == 3
    assert m["ecq_delivery_latency_seconds_count"] == 2


def test_metrics_count_redeliveries_and_gc(make_broker, connect):
    broker = make_broker(data_retention="1s", gc_interval="1h")
    producer = connect(broker.port, "producer")
    write(producer, "m2", "k", "v")
    first = connect(broker.port, "m2", manual_ack=True)
    first.subscribe("$ECQ/m2/#")
    first.expect(1)
    first.close()
    second = connect(broker.port, "m2")
    second.subscribe("$ECQ/m2/#")
    assert second.expect(1)[0].payload == b"v"
    second.close()
    write(producer, "m3", "other", "x")  # a queue nobody reads (m2 may still be connected a moment)
    time.sleep(1.2)  # both entries are now older than data_retention (acked entries stay stored until GC)
    assert ecq("gc", admin=broker.admin_port).returncode == 0
    m = scrape(broker)
    assert m["ecq_deliveries_total"] == 1 and m["ecq_redeliveries_total"] == 1
    assert m["ecq_gc_runs_total"] == 1 and m["ecq_gc_deleted_rows_total"] == 2
    assert m["ecq_stored_messages"] == 0 and m["ecq_stored_bytes"] == 0


@pytest.mark.parametrize("path", ["/api/v1/health", "/api/v1/status"])
def test_admin_api_answers_json(broker, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.admin_port}{path}", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        json.load(response)


def test_sigterm_during_a_long_gc_pass_stops_promptly_and_keeps_the_rest(tmp_path):
    from ecq.testing import BrokerProcess
    from ecq.store.protocol import Append
    from ecq.store.leveldb import LevelDbStore as Store

    broker = BrokerProcess(tmp_path, data_retention="1s", gc_interval="1h")
    store = Store(broker.queues_dir)  # entries published in 1970: all expired
    for start in range(0, 60_000, 10_000):
        store.commit([Append(f"q{i % 6000}", f"k{i}", b"x", 1000 + i) for i in range(start, start + 10_000)])
    store.close()
    broker.start()
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}/api/v1/gc", method="POST")
        threading.Thread(target=lambda: _ignore_errors(urllib.request.urlopen, request, timeout=60),
                         daemon=True).start()
        time.sleep(0.5)
        started = time.monotonic()
        assert broker.stop(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        broker.kill()
    store = Store(broker.queues_dir)
    try:
        remaining, _ = store.stored_totals()
    finally:
        store.close()
    assert 0 < remaining < 60_000  # the pass was under way and ended with the broker


def _ignore_errors(func, *args, **kwargs):
    try:
        func(*args, **kwargs)
    except Exception:
        pass


@pytest.mark.parametrize("options, expected", [({}, 1024), ({"listen_backlog": 700}, 700)])
def test_mqtt_listener_accept_queue_is_listen_backlog(make_broker, options, expected):
    broker = make_broker(**options)
    listening = subprocess.run(["ss", "-Hltn", f"sport = :{broker.port}"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.split()
    assert listening[0] == "LISTEN" and int(listening[2]) == expected  # Send-Q of a listener is its backlog
