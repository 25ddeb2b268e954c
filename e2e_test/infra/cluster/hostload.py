"""Who else used the host's CPUs while a boot failed: one line for a boot's StartupError.

A boot that fails or times out on a loaded host (another run's workers, a compile, a busy loop
beside the lane) looks like a failure of the engine or the harness. `Cluster` takes one
process snapshot when a boot starts and one when it fails (psutil: each process's CPU seconds,
a few /proc reads per process, no sampling thread), and the error gets one line naming the
processes outside this session that took a significant share of the host's CPUs meanwhile:

    host load: outside this session, over the boot's 212 s (2 CPUs, 98 % busy): pid 4242
    python3 (python3 -c while ...) 99 % of a CPU

No such line where no process outside the session was that busy.

This session: the process tree of the outermost Python process in the unbroken chain of
Python ancestors of this one (`python -m e2e_test run`, its pytest, pytest-xdist workers and a
nested session's pytest; a shell above them is not), every descendant of it (workers and
their children, whatever title they set), and every process that carries the run marker of a
driver in that tree (reaper.marker_of: one that left its parent's session). A process of
another run of the harness on this host is outside it: to this session it is the host's load.
A process that started and ended between the two snapshots is not seen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from ..errors import HarnessError

# A process outside the session is named where it took at least this share of the host's
# CPUs (all of them) over the boot. A CPU boot uses every core (one topology at a time on CPU,
# docs/cpu-lanes.md), so such a process lengthens it by about as much: 10 % is above the
# spread of one boot measured on the 2-core machine (dp2: 46.9 s and 49.0 s, 4 %) and far
# below a busy loop on one of its 2 cores (50 %). On a 2-core host: 20 % of a CPU.
SIGNIFICANT_SHARE = 0.10
MOST_NAMED = 3
CREATE_SLACK_S = 1.0     # one process's create time read twice (psutil: btime + start ticks)
CMDLINE_CHARS = 60


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    created: float           # epoch seconds (psutil create_time)
    cpu_s: float             # user + system seconds, its own (not its children's)
    name: str = ""
    python: bool = False     # its executable is a Python interpreter


@dataclass(frozen=True)
class Sample:
    at: float                 # time.monotonic()
    procs: dict[int, Proc]
    host_busy_s: float        # all CPUs together, since the host booted
    host_all_s: float
    cpus: int


def _is_python(exe: str | None) -> bool:
    return bool(exe) and os.path.basename(exe).startswith("python")


def snapshot() -> Sample | None:
    """Every process's CPU seconds now, and the host's; None where they cannot be read."""
    try:
        t = psutil.cpu_times()
        procs = {}
        for p in psutil.process_iter(["ppid", "create_time", "cpu_times", "name", "exe"]):
            i = p.info
            if i["cpu_times"] is None or i["create_time"] is None:
                continue
            procs[p.pid] = Proc(p.pid, i["ppid"] or 0, i["create_time"],
                                i["cpu_times"].user + i["cpu_times"].system, i["name"] or "",
                                _is_python(i["exe"]))
        # Linux counts guest time in user time too (psutil's cpu_percent leaves it out alike)
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return Sample(time.monotonic(), procs, total - idle, total,
                      psutil.cpu_count() or os.cpu_count() or 1)
    except (psutil.Error, OSError):
        return None


def session_root(procs: dict[int, Proc], me: int) -> int:
    """The outermost Python process in the unbroken chain of Python ancestors of `me`."""
    root, seen = me, {me}
    while True:
        parent = procs.get(procs[root].ppid) if root in procs else None
        if parent is None or not parent.python or parent.pid in seen:
            return root
        seen.add(parent.pid)
        root = parent.pid


def in_session(pid: int, procs: dict[int, Proc], root: int,
               driver_of: Callable[[int], int | None]) -> bool:
    """`pid` descends from `root` (or is it), or it or an ancestor carries the run marker of a
    driver that does (`driver_of`: the marker's driver pid, None where there is none)."""
    def chain(p: int) -> list[int]:
        out = []
        while p in procs and p not in out:
            out.append(p)
            p = procs[p].ppid
        return out

    line = chain(pid)
    if root in line:
        return True
    for p in line:
        d = driver_of(p)
        if d is not None and root in chain(d):
            return True
    return False


@dataclass(frozen=True)
class Busy:
    proc: Proc
    of_a_cpu: float           # CPU seconds over the window / the window's seconds


def busy_outside(before: Sample, after: Sample, me: int,
                 driver_of: Callable[[int], int | None] = lambda pid: None,
                 share: float = SIGNIFICANT_SHARE) -> list[Busy]:
    """Processes outside this session (`me`'s, see the module) that took at least `share` of
    the host's CPUs between the samples, busiest first. A process that started in the window
    counts from 0; one that was there before counts from its earlier reading (matched by pid
    and create time: a reused pid is a new process)."""
    window = after.at - before.at
    if window <= 0:
        return []
    cands = []
    for p in after.procs.values():
        old = before.procs.get(p.pid)
        start = old.cpu_s if old and abs(old.created - p.created) <= CREATE_SLACK_S else 0.0
        used = (p.cpu_s - start) / window
        if used >= share * after.cpus:
            cands.append(Busy(p, used))
    if not cands:
        return []
    root = session_root(after.procs, me)
    out = [b for b in cands if not in_session(b.proc.pid, after.procs, root, driver_of)]
    return sorted(out, key=lambda b: -b.of_a_cpu)


def host_line(before: Sample, after: Sample, busy: list[Busy],
              cmdline: Callable[[int], str] = lambda pid: "") -> str | None:
    """The line for the error: None where nothing outside the session was busy."""
    if not busy:
        return None
    window = after.at - before.at
    total = after.host_all_s - before.host_all_s
    host = (f", {100 * (after.host_busy_s - before.host_busy_s) / total:.0f} % busy"
            if total > 0 else "")
    named = []
    for b in busy[:MOST_NAMED]:
        cmd = " ".join(cmdline(b.proc.pid).split())     # a set title pads with spaces
        if cmd == b.proc.name:
            cmd = ""
        if len(cmd) > CMDLINE_CHARS:
            cmd = cmd[:CMDLINE_CHARS - 3] + "..."
        named.append(f"pid {b.proc.pid} {b.proc.name}{f' ({cmd})' if cmd else ''} "
                     f"{100 * b.of_a_cpu:.0f} % of a CPU")
    more = f"; {len(busy) - MOST_NAMED} more" if len(busy) > MOST_NAMED else ""
    took = f"{window:.0f}" if window >= 10 else f"{window:.1f}"
    return (f"host load: outside this session, over the boot's {took} s ({after.cpus} CPUs"
            f"{host}): {'; '.join(named)}{more}")


def _driver_of(pid: int) -> int | None:
    from ..lifecycle.reaper import marker_of
    try:
        m = marker_of(psutil.Process(pid))
    except psutil.Error:
        return None
    return m.driver_pid if m else None


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return ""


def explain(before: Sample | None) -> str | None:
    """The host line from `before` to now (None: nothing to name, or no sample)."""
    if before is None:
        return None
    after = snapshot()
    if after is None:
        return None
    return host_line(before, after, busy_outside(before, after, os.getpid(), _driver_of),
                     _cmdline)


@contextmanager
def named_on_failure(errors: tuple[type[HarnessError], ...], enabled: bool = True
                     ) -> Iterator[None]:
    """Around a boot: an error of `errors` raised in it gets the host line (`explain`) as the
    first line of its details."""
    before = snapshot() if enabled else None
    try:
        yield
    except errors as e:
        line = explain(before)
        if line:
            e.add_detail(line)
        raise
