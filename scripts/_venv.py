"""Re-run a helper script under the project's .venv (created by scripts/setup) when started elsewhere."""

import os
import sys
from pathlib import Path

VENV = Path(__file__).resolve().parent.parent / ".venv"


def ensure_venv() -> None:
    """exec the calling script with .venv/bin/python unless already running inside that venv."""
    python = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() != VENV.resolve() and python.exists():
        os.execv(python, [str(python), *sys.argv])
