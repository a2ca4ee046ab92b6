"""Run a helper script under the project's .venv, which scripts/setup gives what the script needs on its first run."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
# a module each scripts/setup role brings, to tell whether an interpreter has what the role installs
ROLE_MODULES = {"broker": "ecq", "cluster": "nats", "pipeline": "pyspark", "bench": "aiomqtt", "test": "pytest"}
_SET_UP = "ECQ_SCRIPT_SET_UP"  # set once this script ran scripts/setup: a second run would not help


def ensure_venv(*roles: str) -> None:
    """exec the calling script with .venv/bin/python unless already running inside that venv; first, when the
    interpreter that would run it lacks what ``roles`` (scripts/setup roles, ``broker`` when none) install, run
    ``scripts/setup ROLES``, which says what it installs. Started by another interpreter that has it all (a test's)
    while there is no .venv, the script runs where it is. Exits with setup's code when setup fails."""
    roles = roles or ("broker",)
    python = VENV / "bin" / "python"
    inside = Path(sys.prefix).resolve() == VENV.resolve()
    if not inside and python.exists():
        os.execv(python, [str(python), *sys.argv])
    missing = [role for role in roles if importlib.util.find_spec(ROLE_MODULES[role]) is None]
    if not missing:
        return
    if os.environ.get(_SET_UP):
        sys.exit(f"{sys.argv[0]}: scripts/setup {' '.join(roles)} ran, yet .venv lacks what "
                 f"{', '.join(missing)} needs")
    status = subprocess.call([str(ROOT / "scripts" / "setup"), *roles])
    if status != 0:
        sys.exit(status)
    os.environ[_SET_UP] = "1"
    os.execv(python, [str(python), *sys.argv])
