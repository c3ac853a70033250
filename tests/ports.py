"""Test helper: TCP ports for launched jobs, out of the kernel's ephemeral range and apart per pytest-xdist worker.

    from ports import free_port, launcher_port_range
    master = f"127.0.0.1:{free_port()}"
    env["PORT_RANGE"] = launcher_port_range()   # Paddle's launcher picks its workers' ports in there

Why: Paddle's launcher picks each worker's port at random in PORT_RANGE (35100-64000 unless set), checks it
with a bind, and the worker binds it seconds later. That default range overlaps the kernel's ephemeral range
(32768-60999 on Linux), where every gloo connection of every other job on the machine takes its local port, so a
worker's TCP store could find its port taken and abort (libuv's `uv__finish_close` assertion). Here every port
comes from above the ephemeral range, each xdist worker owns its own slice of it, and each launch gets its own
block inside that slice, handed out in turn: two launches of one test never draw the same port.
"""
from __future__ import annotations

import itertools
import os
import socket

_LOW, _HIGH = 61000, 65500   # above net.ipv4.ip_local_port_range's default upper bound (60999)
_BLOCK = 16                  # ports per launcher: its master, its workers' endpoints, spares for a restart


def _ephemeral_high() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 60999


def _slice() -> tuple[int, int]:
    """[lo, hi) of this xdist worker's ports ("gw3" of 4 workers gets the fourth quarter)."""
    low = max(_LOW, _ephemeral_high() + 1)
    if low + 1024 > _HIGH:  # a host whose ephemeral range reaches the top: share it, the bind checks still hold
        low = _LOW
    name, count = os.environ.get("PYTEST_XDIST_WORKER", "gw0"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    size = (_HIGH - low) // max(count, 1)
    return low + index * size, low + (index + 1) * size


_LO, _HI = _slice()
_blocks = itertools.cycle(range(_LO, _HI - _BLOCK + 1, _BLOCK))


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def worker_port_range() -> str:
    """This xdist worker's whole slice, as PORT_RANGE."""
    return f"{_LO}:{_HI - 1}"


def launcher_port_range() -> str:
    """The next block of this worker's slice, as Paddle's launcher reads PORT_RANGE ("first:last", inclusive)."""
    start = next(_blocks)
    return f"{start}:{start + _BLOCK - 1}"


def free_port() -> int:
    """A port of the next block that binds now (a master endpoint, an HTTP server); blocks are used in turn."""
    for _ in range((_HI - _LO) // _BLOCK):
        start = next(_blocks)
        for port in range(start, start + _BLOCK):
            if _bindable(port):
                return port
    raise RuntimeError(f"no free TCP port in {_LO}-{_HI - 1}")
