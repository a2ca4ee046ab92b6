"""Load processes, each spawned with a pipe of its own: started, listed, asked to exit, killed. The base of
:class:`benchlib.loadgen.LoadPool` and :class:`benchlib.fleetload.FleetLoad`, which say what each process runs."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

EXIT_GRACE_S = 10.0  # a process asked to exit is killed after this
KILL_WAIT_S = 5.0    # and waited for this long after its kill


class ProcessPool:
    """``size`` processes (multiprocessing, spawn), each reading commands from its end of a pipe; ``None`` asks it
    to exit."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.Process] = []
        self._conns: list[Any] = []

    def _spawn(self, target: Callable[..., None], args: Callable[[int, Any], tuple], name: str) -> None:
        """Start the ``size`` processes: process ``n`` runs ``target(*args(n, its end of the pipe))``, named
        ``<name>-<n>``."""
        for n in range(self.size):
            parent_end, child_end = self._ctx.Pipe()
            proc = self._ctx.Process(target=target, args=args(n, child_end), name=f"{name}-{n}", daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent_end)

    @property
    def pids(self) -> list[int]:
        """Process ids of the load processes."""
        return [proc.pid for proc in self._procs]

    def close(self) -> None:
        """Ask the processes to exit; kill those that do not within 10 s."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(EXIT_GRACE_S)
        self._kill()

    def _kill(self) -> None:
        """Kill the processes still running and forget them all."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(KILL_WAIT_S)
        self._procs, self._conns = [], []
