"""Signals: SIGINT/SIGTERM tear every live cluster down (within 30 s); a second SIGINT kills
every process tree at once. Installed by the pytest plugin and the CLI."""

from __future__ import annotations

import signal
import sys
import threading

from .cluster import Cluster

_state = {"installed": False, "count": 0}


def _live() -> list[Cluster]:
    with Cluster.live_lock:
        return list(Cluster.live)


def teardown_all(strict: bool = False) -> None:
    for c in _live():
        try:
            c.stop(verify_strict=strict)
        except Exception as e:  # keep going: every cluster must be stopped
            print(f"e2e: teardown of {c.name} failed: {e}", file=sys.stderr)


def kill_all() -> None:
    for c in _live():
        c.kill_now()


def _handler(signum, frame):
    _state["count"] += 1
    name = signal.Signals(signum).name
    if _state["count"] > 1 and signum == signal.SIGINT:
        print(f"e2e: second {name}: killing every worker now", file=sys.stderr, flush=True)
        kill_all()
        raise SystemExit(130)
    print(f"e2e: {name}: tearing down {len(_live())} live topology(ies)", file=sys.stderr,
          flush=True)
    teardown_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install() -> None:
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    _state["installed"] = True
