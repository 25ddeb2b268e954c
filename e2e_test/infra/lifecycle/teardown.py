"""Verified teardown: after a topology stops, nothing of it may remain.

Checks: every process of every worker's session and every remembered descendant is gone;
every port the harness allocated has no listener; GPU memory on each used device is back to
its baseline (NVML; the wait for it is measured, and a leak names the processes NVML still
lists on that device, with their owner); /dev/shm segments that appeared during the run and that no live process
holds are removed (vLLM leaves psm_* behind when killed), and any that cannot be removed are
reported. In CI (CI=true) a violation raises TeardownError; locally it is a loud warning.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ..errors import TeardownError
from ..specs import settings
from ..specs.devices import nvml
from .reaper import gpu_holders, nvml_processes

SHM = Path("/dev/shm")
GPU_TOLERANCE_MIB = 64


@dataclass
class TeardownReport:
    seconds: float = 0.0
    escalated: list[str] = field(default_factory=list)     # needed SIGKILL
    survivors: list[str] = field(default_factory=list)
    busy_ports: list[int] = field(default_factory=list)
    gpu_leaks: dict[int, float] = field(default_factory=dict)  # device -> MiB above baseline
    shm_removed: list[str] = field(default_factory=list)
    shm_left: list[str] = field(default_factory=list)
    gpu_checked: bool = False
    gpu_settle_s: float | None = None    # stop -> memory back to baseline; None: never within
    gpu_wait_s: float | None = None      # the bound waited
    gpu_holders: dict[int, list[str]] = field(default_factory=dict)  # device -> NVML processes
    # Multi-node launchers (ray_launcher.merge_reports): node label -> that node's report
    # (as to_dict); "driver" is this host's. Empty on one host.
    nodes: dict[str, dict] = field(default_factory=dict)
    # Hosts whose processes could not be checked (a lost node), with why: never clean.
    unverified: list[str] = field(default_factory=list)
    # Descendants found by their worker's tag outside its session (process.remember_escaped):
    # stopped with it, and named; a survivor among them is in `survivors` too.
    escaped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.survivors or self.busy_ports or self.gpu_leaks or self.shm_left
                    or self.unverified)

    def verdict(self) -> str:
        if self.ok:
            extra = f", {len(self.escalated)} needed SIGKILL" if self.escalated else ""
            if self.escaped:
                extra += f", {len(self.escaped)} had left a worker's session (stopped too)"
            where = (f" on {len(self.nodes) - 1} node(s) and the driver's host" if self.nodes
                     else "")
            return f"clean in {self.seconds:.1f} s{where}{extra}"
        if self.nodes and any(not sub["ok"] for sub in self.nodes.values()):
            return "NOT clean: " + "; ".join(
                f"{label}: {sub['verdict'].removeprefix('NOT clean: ')}"
                for label, sub in self.nodes.items() if not sub["ok"])
        parts = []
        if self.survivors:
            parts.append(f"{len(self.survivors)} process(es) alive: {self.survivors[:5]}")
        if self.busy_ports:
            parts.append(f"ports still listening: {self.busy_ports}")
        if self.gpu_leaks:
            part = f"GPU memory above baseline (MiB): {self.gpu_leaks}"
            if self.gpu_wait_s is not None:      # check_gpu ran: say who holds it
                part += f" after {self.gpu_wait_s:.0f} s"
                for d in self.gpu_leaks:
                    held = self.gpu_holders.get(d)
                    part += (f", GPU {d} held by {', '.join(held)}" if held else
                             f", no process holds memory on GPU {d} per NVML (released late)")
            parts.append(part)
        if self.shm_left:
            parts.append(f"/dev/shm segments left: {self.shm_left[:5]}")
        if self.unverified:
            parts.append(f"not verified: {'; '.join(self.unverified[:5])}")
        return "NOT clean: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "verdict": self.verdict()}


def shm_snapshot() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir()}
    except OSError:
        return set()


def _held_shm_paths() -> set[str]:
    held = set()
    for p in psutil.process_iter(["pid"]):
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        # The path is the rest of the line, spaces included.
                        name = line.rstrip("\n").split("/dev/shm/", 1)[1]
                        held.add(name.removesuffix(" (deleted)"))
            for fd in os.scandir(f"/proc/{p.pid}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):])
        except (OSError, psutil.Error):
            continue
    return held


def clean_shm(before: set[str]) -> tuple[list[str], list[str]]:
    """Remove segments that appeared since `before` and no live process holds."""
    new = shm_snapshot() - before
    if not new:
        return [], []
    held = _held_shm_paths()
    removed, left = [], []
    for name in sorted(new - held):
        path = SHM / name
        try:
            if path.is_dir():
                continue
            path.unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError:
            left.append(name)
    return removed, left


def listening_ports(ports: set[int]) -> list[int] | None:
    """Which of `ports` something listens on; None when the sockets could not be listed
    (the check did not run: never read as "none")."""
    if not ports:
        return []
    busy = set()
    try:
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
                busy.add(c.laddr.port)
    except (psutil.Error, OSError):
        return None
    return sorted(busy)


def gpu_memory_mib(devices) -> dict[int, float]:
    """Used memory per physical device, or {} when NVML is unavailable."""
    if not devices:
        return {}
    with nvml() as n:
        if n is None:
            return {}
        try:
            return {d: n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(d)).used
                    / 2**20 for d in devices}
        except Exception:
            return {}


def wait_gpu_baseline(baseline: dict[int, float], timeout: float = 20.0) -> dict[int, float]:
    """Devices still above baseline + tolerance after `timeout` (see check_gpu)."""
    rep = TeardownReport()
    check_gpu(rep, baseline, timeout)
    return rep.gpu_leaks


def _settle(report: TeardownReport, measure, timeout: float, poll: float) -> dict | None:
    """Poll `measure()` ({device: what is still held}, or None when it cannot tell) until it
    finds nothing or `timeout` passes, recording the wait on `report`. Returns the last
    finding ({} once settled), or None when nothing could be measured."""
    t0 = time.monotonic()
    while True:
        held = measure()
        if held is None:
            return None
        report.gpu_checked = True
        report.gpu_wait_s = timeout
        if not held:
            report.gpu_settle_s = round(time.monotonic() - t0, 2)
            report.gpu_leaks = {}
            return {}
        if time.monotonic() - t0 > timeout:
            report.gpu_leaks = held
            return held
        time.sleep(poll)


def check_gpu(report: TeardownReport, baseline: dict[int, float], timeout: float = 20.0,
              poll: float = 0.25) -> None:
    """Wait (measured) for GPU memory to come back to the baseline; name what still holds it.
    A device of the baseline that NVML no longer reads is not verified (never clean)."""
    if not baseline:
        return
    unread: set = set()

    def leaks():
        now = gpu_memory_mib(baseline.keys())
        unread.clear()
        unread.update(d for d in baseline if d not in now)
        return {d: round(now[d] - baseline[d], 1) for d in baseline
                if d in now and now[d] - baseline[d] > GPU_TOLERANCE_MIB}

    left = _settle(report, leaks, timeout, poll)
    if unread:
        report.unverified.append(f"GPU memory of GPU(s) {sorted(unread)}: NVML read nothing "
                                 "at the stop, so it was not compared with the baseline")
        if unread == set(baseline):     # nothing was compared: not "back to baseline"
            report.gpu_checked = False
    if left:
        holders = gpu_holders(list(left)) or []
        report.gpu_holders = {d: [str(h) for h in holders if h.device == d] for d in left}


def check_gpu_own(report: TeardownReport, devices, pids: set[int], timeout: float = 20.0,
                  poll: float = 0.25) -> None:
    """A topology stopped while others still run on its devices: wait (measured) until none
    of its processes (`pids`) holds memory on `devices` by NVML's per-process list; the
    others' memory is theirs. Without NVML nothing could be checked: not verified."""
    if not devices:
        return
    seen: dict = {}

    def held():
        procs = nvml_processes(devices)
        if procs is None:
            return None
        seen["procs"] = procs
        return {d: round(sum(m or 0.0 for pid, m in rows if pid in pids), 1)
                for d, rows in procs.items() if any(pid in pids for pid, _ in rows)}

    left = _settle(report, held, timeout, poll)
    if left is None:
        report.unverified.append(f"GPU memory of GPU(s) {sorted(devices)}: NVML's process "
                                 "list could not be read, so this topology's was not checked")
    if left:
        report.gpu_holders = {d: [f"pid {pid} {m or 0:.0f} MiB on GPU {d} (this topology)"
                                  for pid, m in seen["procs"].get(d, []) if pid in pids]
                              for d in left}


def enforce(report: TeardownReport, what: str, strict: bool | None = None) -> None:
    if report.ok:
        return
    if strict is None:
        strict = settings.ci()
    msg = f"teardown of {what}: {report.verdict()}"
    if strict:
        raise TeardownError(msg)
    warnings.warn("!!! " + msg, RuntimeWarning, stacklevel=2)
