"""The broker without the optional extras (pyproject.toml): ``pipeline`` (PySpark, matplotlib), ``bench`` (aiomqtt).

An extra is "missing" here through a directory put first on PYTHONPATH holding a package of that name whose
import raises ModuleNotFoundError, as Python does for a package that is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ECQ

EXTRAS = ("pyspark", "matplotlib", "aiomqtt")


def without(tmp_path: Path, *packages: str) -> dict[str, str]:
    """Environment for a subprocess in which importing any of ``packages`` fails."""
    missing = tmp_path / "missing"
    for name in packages:
        (missing / name).mkdir(parents=True)
        (missing / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r}'!r}, name={name!r})\n")
    path = [str(missing), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_broker_modules_import_none_of_the_extras(tmp_path):
    code = ("import sys, ecq.cli, ecq.broker.plugin, ecq.events, ecq.ops.admin, ecq.store.protocol\n"
            f"print(sorted(set({EXTRAS!r}) & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], env=without(tmp_path, *EXTRAS),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_ecq_works_without_the_extras(tmp_path):
    env = without(tmp_path, *EXTRAS)
    for args in (["--help"], ["broker", "--help"], ["pipeline", "--help"]):
        result = subprocess.run([ECQ, *args], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (args, result.stderr)


@pytest.mark.parametrize("command, package", [("report", "pyspark"), ("report", "matplotlib"), ("load", "pyspark")])
def test_pipeline_without_its_extra_says_what_to_install(tmp_path, package, command):
    lake = tmp_path / "lake"
    lake.mkdir()
    args = {"report": ["--lake", str(lake)],
            "load": ["--input", str(lake), "--format", "json", "--broker", "127.0.0.1:1"]}[command]
    result = subprocess.run([ECQ, "pipeline", command, *args], env=without(tmp_path, package),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "pip install 'ecq[pipeline]', or scripts/setup pipeline in a checkout" in result.stderr
    assert f"No module named '{package}'" in result.stderr
    assert "Traceback" not in result.stderr
