"""Plugin options and `ecq broker` start-up: bad values stop start-up with a message naming the option."""

from __future__ import annotations

import signal
import subprocess

import pytest
import yaml
from pydantic import ValidationError

from ecq.broker_process import ANONYMOUS_AUTH
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
    ("gc_interval", "0s", "greater than 0"),
    ("write_timeout", True, "must be a duration"),
    ("max_payload_bytes", -5, "greater than or equal to 0"),
    ("retention", "7d", "Extra inputs are not permitted"),
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
            "plugins": {**ANONYMOUS_AUTH, "ecq.plugin.EcqPlugin": options}}


@pytest.mark.parametrize("option, value, expected", [
    ("reader_batch_size", 40, "reader_batch_size: Input should be less than or equal to 31"),
    ("data_retention", "soon", "data_retention: Value error, 'soon' is not a duration"),
    ("gc_intervall", "1h", "gc_intervall: Extra inputs are not permitted"),
])
def test_broker_refuses_to_start_with_a_bad_option(tmp_path, option, value, expected):
    result = run_broker(tmp_path, ecq_config(data_dir=str(tmp_path / "d"), **{option: value}))
    assert result.returncode == 2
    assert expected in result.stderr


def test_broker_refuses_config_without_the_plugin(tmp_path):
    result = run_broker(tmp_path, {"listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:1"}}})
    assert result.returncode == 2 and "does not list ecq.plugin.EcqPlugin" in result.stderr


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
        assert (tmp_path / "d" / "CURRENT").exists()
    finally:
        proc.kill()

