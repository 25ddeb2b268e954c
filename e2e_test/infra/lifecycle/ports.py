"""Loopback port allocation that does not collide across pytest-xdist workers.

Ports come from 20000-32767, below Linux's ephemeral range (32768+), where engines open their
own random listeners. Each xdist worker (gw0, gw1, ...) scans its own slice of that range, and
a process never hands the same port out twice.
"""

from __future__ import annotations

import os
import random
import socket
import threading

LOW, HIGH = 20000, 32767
SLICE = 1500
_lock = threading.Lock()
_handed_out: set[int] = set()


def _slice() -> tuple[int, int]:
    wid = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    try:
        n = int(wid.lstrip("gw"))
    except ValueError:
        n = 0
    slots = (HIGH - LOW) // SLICE
    lo = LOW + (n % slots) * SLICE
    return lo, lo + SLICE


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def allocate(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """n free ports on `host` (the address the servers will bind; a node's own address on a
    multi-node launcher, asked on that node)."""
    lo, hi = _slice()
    out: list[int] = []
    with _lock:
        start = random.randrange(lo, hi)
        for i in range(hi - lo):
            p = lo + (start - lo + i) % (hi - lo)
            if p in _handed_out or not is_free(p, host):
                continue
            _handed_out.add(p)
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError(f"no free port left on {host} in {lo}-{hi}")


def allocate_block(k: int) -> int:
    """Base of k consecutive free ports (for servers that bind base..base+k-1)."""
    lo, hi = _slice()
    with _lock:
        start = random.randrange(lo, hi - k)
        for i in range(hi - lo - k):
            base = lo + (start - lo + i) % (hi - lo - k)
            span = range(base, base + k)
            if any(p in _handed_out for p in span) or not all(is_free(p) for p in span):
                continue
            _handed_out.update(span)
            return base
    raise RuntimeError(f"no block of {k} free loopback ports in {lo}-{hi}")
