"""Nothing outlives the runner: ownership markers, an out-of-process guardian, a preflight.

Markers. Every process the harness starts (process.ManagedProcess) carries three environment
variables, inherited by everything it forks: E2E_RUN_ID (one per driver process),
E2E_DRIVER_PID and E2E_DRIVER_START (the driver's pid and its start in seconds since boot,
`started`, so that a reused pid is not taken for a live driver). psutil's Process.environ() reads them back. Every sweep here
stops marked processes only (and the descendants of what it stops), never anything by name.

Guardian. The first process a driver starts also starts one guardian (`python -m
e2e_test.infra.lifecycle.reaper`, in its own session so a terminal's Ctrl-C does not reach it). It holds
the read end of a pipe whose write end only the driver holds (closed in forked children), and
the driver tells it each process group it starts and each one it stopped cleanly. When the
pipe closes without the driver's goodbye (SIGKILL, OOM killer, os._exit), or the driver's pid
is gone, it stops every group still registered, every process marked with the run id and
their descendants: SIGCONT, SIGTERM, GRACE_S, SIGKILL. After a goodbye (normal interpreter
exit) it stops only what is still registered (a Cluster that was never stopped), usually
nothing. It writes reaper-<run id>.json into the results folder when it stopped anything, and
exits. PR_SET_PDEATHSIG only wakes it up: it fires when the parent *thread* exits, so the pipe
and the driver's pid decide.

Each run's processes' own temp folders (tmp_root) go with its RUNS_DIR file (forget_run).

Preflight (Cluster.start, before any process starts): processes marked by an earlier run whose
driver is gone are stopped and named in a log line (E2E_PREFLIGHT=clear, the default), or named
in a one-line PreflightError (E2E_PREFLIGHT=fail); E2E_PREFLIGHT=off skips the checks. On CUDA,
each device of the plan is checked for memory held by processes this run does not own (NVML
running compute processes): a one-line error naming pids and MiB.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
from filelock import FileLock, Timeout

from ..errors import PreflightError
from ..specs import settings
from ..specs.devices import nvml

RUN_ID_ENV = "E2E_RUN_ID"
DRIVER_PID_ENV = "E2E_DRIVER_PID"
DRIVER_CREATE_ENV = "E2E_DRIVER_START"
GUARDIAN_ENV = "E2E_GUARDIAN_OF"        # set on the guardian itself (it is not marked)
# One per started process (process.ManagedProcess): a descendant that left the worker's session
# (setsid after a double fork) is no child and in no session of the worker, but keeps this.
PROC_TAG_ENV = "E2E_PROC_TAG"
PREFLIGHT_ENV = "E2E_PREFLIGHT"
PREFLIGHT_MODES = ("clear", "fail", "off")
GRACE_S = 5.0            # SIGTERM -> SIGKILL
KILL_WAIT_S = 3.0        # after SIGKILL
POLL_S = 0.5             # the guardian's check of the driver's pid
GPU_SETTLE_S = 15.0      # preflight: wait for cleared processes' GPU memory to go
PR_SET_PDEATHSIG = 1
_ROOT = str(Path(__file__).resolve().parents[3])   # the folder holding the e2e_test package
# Each driver also lists the sessions it started in RUNS_DIR/<run id>.procs: a process that
# rewrites its title (setproctitle: VLLM::EngineCore, smg::router) can no longer show its
# environment in /proc, so the preflight finds it there when the guardian died too.
RUNS_DIR = Path(tempfile.gettempdir()) / f"e2e-runs-{os.getuid()}"


# -- markers ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    run_id: str
    driver_pid: int
    driver_create: float

    def driver_alive(self) -> bool:
        return pid_alive(self.driver_pid, self.driver_create)


_me: dict = {"pid": None}


def extend_pythonpath(first: str, inherited: str | None = None) -> str:
    """`first` ahead of the inherited PYTHONPATH (default: this process's), never instead of
    it: on a runner whose engines come from PYTHONPATH a child must still import them."""
    if inherited is None:
        inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([first] + [p for p in inherited.split(os.pathsep)
                                      if p and p != first])


def _identity() -> dict:
    pid = os.getpid()
    if _me["pid"] != pid:       # first call, or a forked child: a run of its own
        _me.update(pid=pid, run_id=f"{pid}-{uuid.uuid4().hex[:8]}",
                   create=started(pid))
    return _me


def run_id() -> str:
    """This driver's run id (one per process)."""
    return _identity()["run_id"]


def marker_env() -> dict[str, str]:
    """The environment that marks a process as this run's."""
    me = _identity()
    return {RUN_ID_ENV: me["run_id"], DRIVER_PID_ENV: str(me["pid"]),
            DRIVER_CREATE_ENV: repr(me["create"])}


def marker_of(p: psutil.Process) -> Marker | None:
    """The run marker in a process's environment; None when unmarked or unreadable."""
    try:
        env = p.environ()
    except (psutil.Error, OSError):
        return None
    rid = env.get(RUN_ID_ENV)
    if not rid:
        return None
    try:
        return Marker(rid, int(env[DRIVER_PID_ENV]), float(env[DRIVER_CREATE_ENV]))
    except (KeyError, ValueError):
        return None        # half a marker: not provably ours, so never touched


# How far two readings of one process's start (`started`) may differ: one clock tick. A pid
# reused within a tick of the first process's start would need the pid space to wrap in it.
CREATE_SLACK_S = 0.02
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def started(p: psutil.Process | int) -> float:
    """When a process started, in seconds since boot: /proc/PID/stat's `starttime` (field 22,
    clock ticks), which no change of the wall clock moves. psutil's create_time() adds the
    boot time of /proc/stat's `btime`, which the kernel derives from the wall clock at each
    read: a step of the clock moves it, and a live driver then reads as a reused pid (its
    guardian and other runs' preflights then stop the run's workers: a CI run lost every
    topology to SIGTERM so; docs/lifecycle.md, table "Lifecycle figures"). Without /proc,
    create_time(). Raises psutil.NoSuchProcess for a process that is gone."""
    pid = p if isinstance(p, int) else p.pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    except OSError:
        return (psutil.Process(pid) if isinstance(p, int) else p).create_time()
    # the name (field 2) may hold spaces and parentheses: the fields after it follow its last ')'
    return int(stat[stat.rindex(b")") + 2:].split()[19]) * _TICK_S


def pid_alive(pid: int, create: float | None = None) -> bool:
    """A live (not zombie) process with this pid and, when given, this create time."""
    try:
        p = psutil.Process(pid)
        if create is not None and abs(started(p) - create) > CREATE_SLACK_S:
            return False          # the pid was reused
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tagged(tag: str) -> list[psutil.Process]:
    """Every running process whose environment carries PROC_TAG_ENV=tag; never this one."""
    out = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(PROC_TAG_ENV) == tag and running(p):
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def marked(run: str | None = None) -> list[tuple[psutil.Process, Marker]]:
    """Every process carrying a run marker (of `run` only, when given); never this process."""
    out = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        m = marker_of(p)
        if m is None or (run is not None and m.run_id != run) or p.pid == m.driver_pid:
            continue
        if running(p):
            out.append((p, m))
    return out


def _read_runs() -> dict[str, tuple[Marker, dict[int, float]]]:
    """RUNS_DIR: run id -> (its driver, {session leader pid: create time} still registered)."""
    out = {}
    try:
        files = sorted(RUNS_DIR.glob("*.procs"))
    except OSError:
        return out
    for f in files:
        try:
            lines = f.read_text().splitlines()
            head = lines[0].split()
            m = Marker(f.stem, int(head[1]), float(head[2]))
        except (OSError, IndexError, ValueError):
            continue
        groups: dict[int, float] = {}
        for line in lines[1:]:
            parts = line.split()
            try:
                if parts[0] == "add":
                    groups[int(parts[1])] = float(parts[2])
                elif parts[0] == "del":
                    groups.pop(int(parts[1]), None)
            except (IndexError, ValueError):
                continue
        out[m.run_id] = (m, groups)
    return out


GUARDIAN_MODULE = "e2e_test.infra.lifecycle.reaper"


def guarded_runs() -> set[str]:
    """Run ids whose guardian (`python -m GUARDIAN_MODULE --run-id RUN`) is still running."""
    out = set()
    for p in psutil.process_iter():
        try:
            argv = p.cmdline()
        except (psutil.Error, OSError):
            continue
        if GUARDIAN_MODULE in argv and "--run-id" in argv[:-1] and running(p):
            out.add(argv[argv.index("--run-id") + 1])
    return out


def orphans() -> list[tuple[psutil.Process, Marker]]:
    """Processes of another run whose driver is gone: marked ones, and the members of the
    sessions it registered in RUNS_DIR (see session_members). A run whose guardian still runs
    is left to it: it is stopping them now and reports what it stopped (a preflight that took
    them first would leave its report without them); what it leaves is an orphan once it
    exits."""
    mine = run_id()
    alive: dict[tuple[int, float], bool] = {}
    guarded = guarded_runs()

    def gone(m: Marker) -> bool:
        if m.run_id in guarded:
            return False
        key = (m.driver_pid, m.driver_create)
        if key not in alive:
            alive[key] = m.driver_alive()
        return not alive[key]

    found: dict[int, tuple[psutil.Process, Marker]] = {}
    for p, m in marked():
        if m.run_id != mine and gone(m):
            found[p.pid] = (p, m)
    for rid, (m, groups) in _read_runs().items():
        if rid == mine or not gone(m):
            continue
        for p in session_members(groups):
            found.setdefault(p.pid, (p, m))
    return list(found.values())


def forget_dead_runs() -> None:
    """Forget runs whose driver is gone and whose sessions are all gone (forget_run)."""
    for rid, (m, groups) in _read_runs().items():
        if rid != run_id() and not m.driver_alive() and not session_members(groups):
            forget_run(rid)


def tmp_root() -> Path:
    """This run's folder of its processes' own temp folders (ManagedProcess.tmp_env). Each
    process's stop removes its own; forget_run removes what a run whose driver died left."""
    root = RUNS_DIR / f"{run_id()}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def forget_run(rid: str) -> None:
    """Remove a run's RUNS_DIR file and its processes' temp folders (tmp_root)."""
    try:
        (RUNS_DIR / f"{rid}.procs").unlink()
    except OSError:
        pass
    shutil.rmtree(RUNS_DIR / f"{rid}.tmp", ignore_errors=True)


# -- stopping -----------------------------------------------------------------------------------

def running(p: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(p: psutil.Process) -> str:
    try:
        cmd = " ".join(" ".join(p.cmdline()).split()) or p.name()
    except psutil.Error:
        cmd = "?"
    return f"pid {p.pid} {cmd[:160]}"


def _send(procs, sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)   # psutil refuses a reused pid
        except psutil.Error:
            pass


def _with_descendants(procs) -> list[psutil.Process]:
    found = {p.pid: p for p in procs}
    for p in list(procs):
        try:
            for c in p.children(recursive=True):
                found.setdefault(c.pid, c)
        except psutil.Error:
            pass
    me = os.getpid()
    return [p for p in found.values() if p.pid != me and running(p)]


def stop_processes(procs, grace: float = GRACE_S, more=None) -> dict:
    """SIGCONT + SIGTERM to every process and its descendants, SIGKILL after `grace`.

    `more()` may name further processes (found again while waiting: new children, or marked
    ones that appeared); they get the same treatment. Returns what happened, with each
    process described before it was signalled."""
    t0 = time.monotonic()
    seen: dict[int, tuple[psutil.Process, str]] = {}

    def take(batch):
        new = [p for p in _with_descendants(batch) if p.pid not in seen]
        for p in new:
            seen[p.pid] = (p, describe(p))
        _send(new, signal.SIGCONT)      # a stopped process cannot handle SIGTERM
        _send(new, signal.SIGTERM)

    gone_s: dict[int, float] = {}      # pid -> seconds from the first signal until it was gone

    def alive_now():
        out = []
        for p, _ in seen.values():
            if running(p):
                out.append(p)
            else:
                gone_s.setdefault(p.pid, round(time.monotonic() - t0, 2))
        return out

    take(list(procs))
    deadline = t0 + grace
    while True:
        if more is not None:
            take(more())
        alive = alive_now()
        if not alive or time.monotonic() >= deadline:
            break
        take(alive)                     # children forked since
        time.sleep(0.05)
    killed = alive_now()
    _send(killed, signal.SIGKILL)
    kill_deadline = time.monotonic() + KILL_WAIT_S
    while alive_now() and time.monotonic() < kill_deadline:
        time.sleep(0.05)
    killed_pids = {p.pid for p in killed}
    return {
        "terminated": [d for pid, (_, d) in seen.items() if pid not in killed_pids],
        "killed": [seen[p.pid][1] for p in killed],
        "survivors": [seen[p.pid][1] for p in killed if running(p)],
        "gone_s": {str(pid): gone_s.get(pid) for pid in seen},
        "seconds": round(time.monotonic() - t0, 2),
    }


# -- the guardian (runs in its own process) ------------------------------------------------------

def _set_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def session_members(leaders: dict[int, float]) -> list[psutil.Process]:
    """Processes of registered sessions {leader pid: create time}. Linux does not hand out a
    pid while it still names a session, so members of session S are the original ones while
    the leader lives with its create time, or is gone and S names no other process; then only
    members created after the leader are taken. A pid S that names a newer process means the
    session ended and S was reused: nothing of it is taken."""
    if not leaders:
        return []
    valid: dict[int, float] = {}
    for sid, create in leaders.items():
        try:
            p = psutil.Process(sid)
            if abs(started(p) - create) <= CREATE_SLACK_S:
                valid[sid] = create
        except psutil.NoSuchProcess:
            valid[sid] = create
        except psutil.Error:
            continue
    out = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            sid = os.getsid(p.pid)
            if sid in valid and started(p) >= valid[sid] - CREATE_SLACK_S and running(p):
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _session_members(groups: dict[int, tuple[float, str]], run: str) -> list[psutil.Process]:
    return session_members({sid: create for sid, (create, _) in groups.items()})


def _note(line: str) -> None:
    """One line to the inherited stderr, given up after 1 s: never hang on a full pipe that
    nobody reads any more (and never make a shared terminal non-blocking)."""
    def write():
        try:
            os.write(2, (line + "\n").encode())
        except OSError:
            pass
    t = threading.Thread(target=write, daemon=True)
    t.start()
    t.join(1.0)


def guard(fd: int, run: str, driver_pid: int, driver_create: float, report_dir: str,
          grace: float = GRACE_S) -> int:
    """The guardian's loop: read the driver's messages until it is gone, then sweep."""
    # Signals only wake the loop (through a self-pipe): the pipe and the driver's pid decide.
    # SIGTERM too: a guardian must not be stopped before the driver it guards.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_pdeathsig(signal.SIGUSR1)
    groups: dict[int, tuple[float, str]] = {}      # session id -> (leader create time, name)
    buf, goodbye, why = b"", False, ""
    while not why:
        ready, _, _ = select.select([fd, wake_r], [], [], POLL_S)
        if wake_r in ready:
            os.read(wake_r, 4096)
        chunk = os.read(fd, 65536) if fd in ready else None
        if chunk == b"":
            why = "pipe closed after the driver's goodbye" if goodbye else \
                "pipe closed without a goodbye (driver killed)"
            break
        if chunk:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                parts = line.decode(errors="replace").split(" ", 3)
                if parts[0] == "add" and len(parts) >= 3:
                    groups[int(parts[1])] = (float(parts[2]), parts[3] if len(parts) > 3 else "")
                elif parts[0] == "del" and len(parts) >= 2:
                    groups.pop(int(parts[1]), None)
                elif parts[0] == "bye":
                    goodbye = True
        if not pid_alive(driver_pid, driver_create):
            why = f"driver pid {driver_pid} gone" + ("" if goodbye else " without a goodbye")
    t0 = time.monotonic()
    noticed = time.time()
    if goodbye and not groups:
        return 0                      # a normal exit that stopped everything: nothing to do

    def targets():
        found = {p.pid: p for p in _session_members(groups, run)}
        if not goodbye:
            found.update((p.pid, p) for p, _ in marked(run))
        return list(found.values())

    first = targets()
    if not first:
        forget_run(run)
        return 0
    result = stop_processes(first, grace=grace, more=targets)
    report = {"run_id": run, "driver_pid": driver_pid, "why": why, "goodbye": goodbye,
              "noticed_at": noticed,
              "groups": {str(k): v[1] for k, v in groups.items()}, **result,
              "seconds": round(time.monotonic() - t0, 2)}
    n = len(result["terminated"]) + len(result["killed"])
    path = Path(report_dir) / f"reaper-{run}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    except OSError:
        path = None
    _note(f"e2e reaper: {why}; stopped {n} process(es) of run {run} in {report['seconds']} s "
          f"({len(result['killed'])} needed SIGKILL, {len(result['survivors'])} survived)"
          + (f"; report {path}" if path else ""))
    if not result["survivors"]:
        forget_run(run)
    return 1 if result["survivors"] else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="e2e_test.infra.lifecycle.reaper")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--driver-pid", type=int, required=True)
    ap.add_argument("--driver-create", type=float, required=True)
    ap.add_argument("--report-dir", required=True)
    ap.add_argument("--grace", type=float, default=GRACE_S)
    a = ap.parse_args(argv)
    return guard(a.fd, a.run_id, a.driver_pid, a.driver_create, a.report_dir, a.grace)


# -- the driver's side --------------------------------------------------------------------------

def _results_dir() -> Path:
    # Mirrors cluster.results_root() (not imported: process.py must not pull in the cluster).
    return Path(settings.results_dir()).resolve()


class Guardian:
    """The driver's handle on its guardian process: one per driver process."""

    _lock = threading.Lock()
    current: Guardian | None = None

    def __init__(self, report_dir: Path | None = None, grace: float = GRACE_S):
        self.report_dir = Path(report_dir) if report_dir else _results_dir()
        self.grace = grace
        self.owner = os.getpid()
        self.groups: dict[int, tuple[float, str]] = {}
        self._wlock = threading.Lock()
        me = _identity()
        self.runs_file = RUNS_DIR / f"{me['run_id']}.procs"
        self._note_run(f"driver {me['pid']} {me['create']!r}")
        self._spawn()

    def _note_run(self, line: str) -> None:
        try:
            RUNS_DIR.mkdir(parents=True, exist_ok=True)
            with open(self.runs_file, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass

    def _spawn(self) -> None:
        me = _identity()
        r, w = os.pipe()
        env = {k: v for k, v in os.environ.items()
               if k not in (RUN_ID_ENV, DRIVER_PID_ENV, DRIVER_CREATE_ENV)}
        env[GUARDIAN_ENV] = me["run_id"]
        env["PYTHONPATH"] = extend_pythonpath(_ROOT)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", GUARDIAN_MODULE, "--fd", str(r),
                 "--run-id", me["run_id"], "--driver-pid", str(me["pid"]),
                 "--driver-create", repr(me["create"]), "--report-dir", str(self.report_dir),
                 "--grace", str(self.grace)],
                pass_fds=(r,), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            os.close(r)
        self.fd = w

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, line: str) -> None:
        with self._wlock:
            if self.fd < 0:
                return
            try:
                os.write(self.fd, (line + "\n").encode())
                return
            except OSError:        # the guardian died: start another and tell it everything
                os.close(self.fd)
            self._spawn()
            for sid, (create, name) in self.groups.items():
                os.write(self.fd, f"add {sid} {create!r} {name}\n".encode())

    def watch(self, pid: int, name: str = "") -> None:
        try:
            create = started(pid)
        except psutil.Error:
            return
        name = " ".join(name.split())[:80]
        self.groups[pid] = (create, name)
        self._note_run(f"add {pid} {create!r}")
        self._send(f"add {pid} {create!r} {name}")

    def forget(self, pid: int) -> None:
        if self.groups.pop(pid, None) is not None:
            self._note_run(f"del {pid}")
            self._send(f"del {pid}")

    def close(self, wait: float = 10.0) -> int | None:
        """Goodbye and close the pipe (normal exit); returns the guardian's exit code."""
        with self._wlock:
            if self.fd >= 0:
                try:
                    os.write(self.fd, b"bye\n")
                except OSError:
                    pass
                os.close(self.fd)
                self.fd = -1
        try:
            return self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None

    @classmethod
    def get(cls) -> Guardian:
        with cls._lock:
            g = cls.current
            if g is None or g.owner != os.getpid():
                g = cls.current = Guardian()
            return g


def _goodbye() -> None:
    g = Guardian.current
    if g is not None and g.owner == os.getpid() and g.fd >= 0:
        with g._wlock:
            try:
                os.write(g.fd, b"bye\n")
            except OSError:
                pass
            # the pipe closes with the process; the guardian exits at once when nothing is left
        if not g.groups:
            forget_run(_identity()["run_id"])


def _after_fork_in_child() -> None:
    g = Guardian.current
    if g is not None and g.fd >= 0:
        try:
            os.close(g.fd)       # a forked child must not keep the driver's pipe open
        except OSError:
            pass
        g.fd = -1
    Guardian.current = None
    Guardian._lock = threading.Lock()


atexit.register(_goodbye)
os.register_at_fork(after_in_child=_after_fork_in_child)


def watch(pid: int, name: str = "") -> None:
    """Tell this driver's guardian about a new process group (its leader's pid)."""
    Guardian.get().watch(pid, name)


def forget(pid: int) -> None:
    """A group stopped cleanly: the guardian no longer needs to stop it."""
    g = Guardian.current
    if g is not None and g.owner == os.getpid():
        g.forget(pid)


def guardian_pid() -> int | None:
    g = Guardian.current
    return g.pid if g is not None and g.owner == os.getpid() else None


# -- preflight ----------------------------------------------------------------------------------

def preflight_mode() -> str:
    """E2E_PREFLIGHT, checked by settings.py (clear | fail | off)."""
    return settings.get(PREFLIGHT_ENV)


def _name_orphans(found) -> str:
    parts = []
    for p, m in found[:6]:
        parts.append(f"{describe(p)[:100]} (run {m.run_id}, driver pid {m.driver_pid} gone)")
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    return "; ".join(parts) + more


@dataclass(frozen=True)
class GpuHolder:
    device: int
    pid: int
    mib: float | None          # None: NVML does not say (some containers)
    owner: str                 # "this run", "the driver", "run X (driver alive)", ...
    name: str = ""

    @property
    def ours(self) -> bool:
        return self.owner in ("this run", "the driver")

    def __str__(self) -> str:
        mib = "? MiB" if self.mib is None else f"{self.mib:.0f} MiB"
        name = f" {self.name}" if self.name else ""
        return f"pid {self.pid}{name} {mib} on GPU {self.device} ({self.owner})"


def nvml_processes(devices) -> dict[int, list[tuple[int, float | None]]] | None:
    """NVML's running compute processes per physical device: [(pid, MiB or None)];
    None when NVML is not available."""
    with nvml() as n:
        if n is None:
            return None
        try:
            out = {}
            for d in devices:
                h = n.nvmlDeviceGetHandleByIndex(d)
                rows = []
                for info in n.nvmlDeviceGetComputeRunningProcesses(h):
                    used = getattr(info, "usedGpuMemory", None)
                    rows.append((int(info.pid), None if used is None else used / 2**20))
                out[d] = rows
            return out
        except Exception:
            return None


def _owner_of(pid: int) -> tuple[str, str]:
    """(owner label, process name) of a pid NVML reported."""
    me = _identity()
    if pid == me["pid"]:
        return "the driver", _pname(pid)
    try:
        p = psutil.Process(pid)
    except psutil.Error:
        return "not visible from here", ""
    m = marker_of(p)
    name = _pname(pid)
    if m is None:
        return "not the harness's", name
    if m.run_id == me["run_id"]:
        return "this run", name
    return f"run {m.run_id} (driver {'alive' if m.driver_alive() else 'gone'})", name


def _pname(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def gpu_holders(devices) -> list[GpuHolder] | None:
    """Every process holding memory on the devices, with its owner; None without NVML."""
    procs = nvml_processes(devices)
    if procs is None:
        return None
    out = []
    for d, rows in procs.items():
        for pid, mib in rows:
            owner, name = _owner_of(pid)
            out.append(GpuHolder(d, pid, mib, owner, name))
    return out


# Preflights run one at a time on this machine, across processes (xdist workers, drivers) and
# threads: two never stop the same processes, and a test that plants an orphan holds this lock
# so that no other preflight sweeps it first. Reentrant within a thread.
PREFLIGHT_LOCK = FileLock(Path(tempfile.gettempdir()) / f"e2e-preflight-{os.getuid()}.lock",
                          timeout=120.0)


def preflight(devices=(), report_dir: Path | str | None = None, mode: str | None = None,
              log=None) -> dict:
    """Before a topology starts: clear (or name) what an earlier run left; on GPUs, fail on
    memory held by processes this run does not own. Returns what it did."""
    try:
        with PREFLIGHT_LOCK:
            return _preflight(devices, report_dir, mode, log)
    except Timeout:
        raise PreflightError(f"preflight: {PREFLIGHT_LOCK.lock_file} stayed locked for "
                             f"{PREFLIGHT_LOCK.timeout:.0f} s (another preflight on this "
                             f"machine hangs)") from None


def _preflight(devices, report_dir, mode, log) -> dict:
    mode = mode or preflight_mode()
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    done: dict = {}
    if mode == "off":
        return done
    found = orphans()
    if not found:
        forget_dead_runs()
    if found:
        if mode == "fail":
            raise PreflightError(f"preflight: {len(found)} process(es) left by an earlier run "
                                 f"whose driver is gone: {_name_orphans(found)} "
                                 f"({PREFLIGHT_ENV}=fail; the default clears them)")
        runs = sorted({m.run_id for _, m in found})
        sweep = stop_processes([p for p, _ in found],
                               more=lambda: [p for p, m in orphans() if m.run_id in runs])
        n = len(sweep["terminated"]) + len(sweep["killed"])
        log(f"e2e preflight: cleared {n} process(es) left by earlier run(s) "
            f"{', '.join(runs)} (driver gone) in {sweep['seconds']} s: "
            f"{'; '.join((sweep['terminated'] + sweep['killed'])[:6])}")
        done["cleared"] = {"runs": runs, **sweep}
        forget_dead_runs()
        if sweep["survivors"]:
            raise PreflightError(f"preflight: could not stop {len(sweep['survivors'])} "
                                 f"process(es) of an earlier run: {sweep['survivors'][:5]}")
    if devices:
        foreign = _foreign_gpu_holders(devices, settle=GPU_SETTLE_S)
        if foreign:
            raise PreflightError(f"preflight: GPU memory held by processes this run does not "
                                 f"own: {'; '.join(str(h) for h in foreign)}")
    if done and report_dir is not None:
        try:
            Path(report_dir).mkdir(parents=True, exist_ok=True)
            (Path(report_dir) / "preflight.json").write_text(json.dumps(done, indent=2))
        except OSError:
            pass
    return done


def _foreign_gpu_holders(devices, settle: float = 0.0) -> list[GpuHolder]:
    """Holders this run does not own; while some of them are dying (gone from here, or of a
    run whose driver is gone: just cleared), wait up to `settle` s for NVML to drop them."""
    deadline = time.monotonic() + settle
    while True:
        holders = gpu_holders(devices)
        if holders is None:        # a check over nothing: the error, not a pass
            raise PreflightError(
                f"preflight: NVML could not list the processes on GPU(s) {list(devices)}: "
                "whether memory there is held by others is unknown (E2E_PREFLIGHT=off skips "
                "the preflight's checks)")
        foreign = [h for h in holders if not h.ours]
        dying = [h for h in foreign if h.owner == "not visible from here"
                 or h.owner.endswith("(driver gone)")]
        if not dying or time.monotonic() >= deadline:
            return foreign
        time.sleep(0.25)


if __name__ == "__main__":
    sys.exit(main())
