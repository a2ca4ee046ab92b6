"""scripts/pub and scripts/sub against a real broker, as a new user would run them; scripts/setup repairing a
broken venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


# A project scripts/setup can install offline: an in-tree build backend that only describes the package,
# installed with pip's --dry-run (PIP_DRY_RUN), so the test checks the venv handling, not PyPI.
PROBE_PYPROJECT = """\
[build-system]
requires = []
build-backend = "probe_backend"
backend-path = ["."]

[project]
name = "probe"
version = "0"
"""
PROBE_BACKEND = """\
from pathlib import Path


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    info = Path(metadata_directory, "probe-0.dist-info")
    info.mkdir()
    extras = "".join(f"Provides-Extra: {name}\\n" for name in ("test", "pipeline", "bench"))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: probe\\nVersion: 0\\n{extras}")
    return info.name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    raise NotImplementedError("dry runs only")
"""


def java_major() -> int:
    """Major version of `java` on PATH, 0 when there is none."""
    if not shutil.which("java"):
        return 0
    found = re.search(r'version "(?:1\.)?(\d+)', subprocess.run(["java", "-version"], capture_output=True,
                                                              text=True).stderr)
    return int(found.group(1)) if found else 0


def break_by_removing_pip(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)


def break_by_a_failing_python(venv: Path) -> None:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv / "bin" / "python").chmod(0o755)


@pytest.mark.skipif(not all(map(shutil.which, ("mosquitto_pub", "ss", "curl", "chromium", "node", "npm")))
                    or java_major() < 17,
                    reason="scripts/setup would install Debian packages here")
@pytest.mark.parametrize("breakage", [break_by_removing_pip, break_by_a_failing_python])
def test_setup_rebuilds_a_broken_venv_then_does_nothing(tmp_path, breakage):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPTS / "setup", tmp_path / "scripts" / "setup")
    (tmp_path / "pyproject.toml").write_text(PROBE_PYPROJECT)
    (tmp_path / "probe_backend.py").write_text(PROBE_BACKEND)
    shutil.copytree(SCRIPTS.parent / "tests" / "mqttjs", tmp_path / "tests" / "mqttjs",
                    ignore=shutil.ignore_patterns("node_modules"))
    breakage(tmp_path / ".venv")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DRY_RUN": "1", "npm_config_offline": "true",
           "npm_config_dry_run": "true"}
    first = subprocess.run([tmp_path / "scripts" / "setup"], env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "setup: rebuilding .venv: it is broken" in first.stderr
    assert "Would install probe-0" in first.stdout
    assert (tmp_path / ".venv" / "bin" / "pip").exists()
    second = subprocess.run([tmp_path / "scripts" / "setup"], env=env, capture_output=True, text=True, timeout=60)
    assert (second.returncode, second.stdout, second.stderr) == (0, "", "")
