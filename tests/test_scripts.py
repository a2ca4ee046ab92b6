"""scripts/pub and scripts/sub against a real broker, as a new user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=60)


def test_pub_then_sub_prints_the_newest_value_of_each_key_once(broker):
    port = str(broker.port)
    assert run("pub", "--port", port).returncode == 0
    result = run("pub", "--port", port, "--rounds", "2")
    assert result.returncode == 0 and result.stdout.count("stored $ECQ/w/client2/") == 8
    first = run("sub", "2", "--port", port, "--idle", "1.5")
    lines = first.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        "cfg/net/apn", "cfg/telemetry/interval", "cmd/reboot", "entitlement/navigation"]
    assert all('"rev": 2' in line for line in lines)
    second = run("sub", "2", "--port", port, "--idle", "1.5")
    assert second.stdout == ""


def test_pub_reports_an_unreachable_broker():
    from tests.harness import free_port
    result = run("pub", "--port", str(free_port()))
    assert result.returncode == 3 and "cannot connect" in result.stderr
