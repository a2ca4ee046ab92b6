"""A private network namespace for the fleet scenario: its own loopback and its own ports, so that
tens of thousands of connections neither meet other processes' sockets nor run out of ephemeral ports
(clients bind to several loopback source addresses, see :func:`source_addresses`).

The calling thread enters the namespace (setns(2)); processes it starts afterwards (brokers, load
processes) are born inside it, and its own sockets (admin API calls, readiness probes) open inside it too.
Needs root (``ip netns add``) and iproute2.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLONE_NEWNET = 0x40000000   # <sched.h>: the namespace type setns(2) is asked to join
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _ip(*argv: str) -> None:
    """Run ``ip ARGV``; raises RuntimeError with its stderr when it fails."""
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip() or f'exit code {done.returncode}'}")


def remove_stale(prefix: str) -> list[str]:
    """Delete the namespaces ``<prefix><pid>`` whose creating process ``pid`` is gone (a run killed with kill -9
    could not clean up), ending the processes still inside them (its brokers and load processes: ``ip netns
    pids``) first; returns the names deleted."""
    removed = []
    for path in sorted(Path("/run/netns").glob(f"{prefix}*")):
        owner = path.name[len(prefix):]
        if not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        left = subprocess.run(["ip", "netns", "pids", path.name], capture_output=True, text=True, timeout=30)
        for pid in left.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", path.name)
        removed.append(path.name)
    return removed


@contextmanager
def private_netns(name: str) -> Iterator[str]:
    """Create network namespace ``name`` (``ip netns add``), bring its loopback up, move the calling thread
    into it; on the way out move back and delete it, also when the body raised. Yields ``name``.

    Raises RuntimeError when ``ip`` fails (not root, no iproute2) and OSError when setns(2) fails.
    Processes started inside and still running when it is deleted keep the namespace alive until they exit.
    """
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield name
            finally:
                _setns(home)
        finally:
            os.close(home)
    finally:
        _ip("netns", "del", name)


def source_addresses(count: int) -> tuple[str, ...]:
    """``count`` loopback source addresses 127.0.0.2, 127.0.0.3, ... (all of 127/8 is on ``lo``): each has its
    own ~28,000 ephemeral ports (net.ipv4.ip_local_port_range), so 20,000 clients and the connections of
    earlier phases still in TIME_WAIT never run out. At most 253."""
    if not 1 <= count <= 253:
        raise ValueError(f"{count} source addresses: choose 1..253")
    return tuple(f"127.0.0.{2 + i}" for i in range(count))
