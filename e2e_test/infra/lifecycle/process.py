"""One OS process the harness owns: its own session, its own log, verified stop.

Every worker and the gateway is a ManagedProcess. It starts in a new session (so the whole
tree can be signalled even after the leader died), inherits the caller's environment plus the
builder's overrides (never a scrubbed one: GPU machines set NCCL variables that workers need),
and writes stdout+stderr to one log file. Descendants are remembered (pid + create time) while
the process lives, so stragglers that left the session are found at teardown too. Each one
carries its run's marker (reaper.marker_env) and is registered with the driver's guardian
(reaper.py), which stops it if the driver dies; a clean stop unregisters it.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from . import reaper
from .reaper import extend_pythonpath  # noqa: F401 (its home is reaper.py; callers import it here)

# The first line matching one of these (in order of preference) names the failure.
ERROR_PATTERNS = [
    ("cuda_oom", re.compile(r"CUDA out of memory|OutOfMemoryError|cudaErrorMemoryAllocation")),
    ("nccl", re.compile(r"NCCL error|ncclInternalError|ncclSystemError|NCCL WARN")),
    ("address_in_use", re.compile(r"[Aa]ddress already in use|EADDRINUSE|Errno 98")),
    ("import", re.compile(r"(ImportError|ModuleNotFoundError): .*")),
    ("oom", re.compile(r"MemoryError|Cannot allocate memory|Killed")),
    ("error", re.compile(r"^\S*(Error|Exception): .+")),
]


@dataclass
class StopReport:
    name: str
    pid: int
    exit_code: int | None
    escalated: bool            # SIGKILL was needed
    seconds: float
    survivors: list[str] = field(default_factory=list)
    escaped: list[str] = field(default_factory=list)   # found outside its session by its tag


def classify_log(text: str) -> tuple[str, str] | None:
    """(kind, line) for the most telling error line of a log, or None."""
    lines = text.splitlines()
    for kind, rx in ERROR_PATTERNS:
        for line in lines:
            if rx.search(line):
                return kind, line.strip()[:300]
    return None


TRACEBACK = "Traceback (most recent call last)"
# A log record at level ERROR or CRITICAL: the level is one of a line's first few words
# (vLLM: `(EngineCore pid=7) ERROR 12-06 06:36:55 [core.py:1510] ...`; uvicorn `ERROR:    ...`;
# Python's logging `ERROR:root:...`; a timestamp first in Rust's tracing).
ERROR_RECORD = re.compile(r"^(?:\S+\s+){0,3}(?:ERROR|CRITICAL)\b")


def _traceback_block(lines: list[str], i: int, max_lines: int) -> list[str]:
    """The traceback whose header is lines[i], through its exception line. The header's text
    before `Traceback` (a process prefix, a log record's head) starts each of its lines; lines
    without it are another process's output, interleaved, and left out. The exception line is
    the first one whose text after that prefix is not indented (of chained exceptions, the first
    raised). Longer than max_lines: its head, a count of the lines left out, its last line."""
    prefix = lines[i][:lines[i].index(TRACEBACK)]
    block = [lines[i]]
    for line in lines[i + 1:i + 500]:
        if not line.startswith(prefix):
            continue
        block.append(line)
        rest = line[len(prefix):]
        if rest and not rest[0].isspace():
            break
    if len(block) > max_lines:
        keep = max(0, max_lines - 2)
        block = block[:keep] + [f"... {len(block) - keep - 1} lines ..."] + block[-1:]
    return block


def last_traceback(text: str, max_lines: int = 30) -> str:
    """The log's last traceback, through its exception line; "" when it has none."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if TRACEBACK in lines[i]:
            return "\n".join(_traceback_block(lines, i, max_lines))
    return ""


def first_error(text: str, max_lines: int = 30) -> tuple[int, str] | None:
    """(line number from 1, block) of the first error a log shows, or None: its first
    traceback, or its first ERROR/CRITICAL record with the traceback that record carries, or
    where it has neither, the line that classify_log picks. The first, not the last: an engine
    whose child process failed to start raises again in its parent ("See root cause above"), and
    that later traceback names no cause."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if TRACEBACK in line:
            return i + 1, "\n".join(_traceback_block(lines, i, max_lines))
        if ERROR_RECORD.match(line):
            block = [line]
            tb = next((j for j in range(i + 1, min(i + 3, len(lines))) if TRACEBACK in lines[j]),
                      None)
            if tb is not None:
                block += _traceback_block(lines, tb, max_lines - 1)
            return i + 1, "\n".join(block)
    hit = classify_log(text)
    if hit is None:
        return None
    return next(i + 1 for i, line in enumerate(lines) if line.strip()[:300] == hit[1]), hit[1]


def open_pidfd(p: psutil.Process) -> int | None:
    """A pidfd of `p`, which runs now: through it a signal reaches that process and no other,
    and it becomes readable once the process has ended (a zombie or reaped), all without
    reading /proc. None where Python or the kernel has none (Linux < 5.3) or `p` has ended."""
    try:
        fd = os.pidfd_open(p.pid)
    except (AttributeError, OSError):
        return None
    if not reaper.running(p):      # ended, or the pid reused, before the open
        os.close(fd)
        return None
    return fd


# Signals sent through libc by ctypes, which lets go of the GIL for the call: os.kill and
# signal.pidfd_send_signal keep it, so while the syscall (or the thread, descheduled on its
# way out of it) waits, no other thread of the harness runs: on a loaded 2-core CI host the
# watch thread stalls exactly as long as the kill call (docs/lifecycle.md, table "Lifecycle
# figures").
_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_PIDFD_SEND_SIGNAL = 424        # the same number on every Linux architecture (5.1+)


def pidfd_signal(fd: int, sig: int) -> bool:
    """Send `sig` to the process behind a pidfd, the GIL let go; whether it was sent."""
    return _LIBC.syscall(_SYS_PIDFD_SEND_SIGNAL, fd, sig, None, 0) == 0


def kill_pid(pid: int, sig: int) -> bool:
    """os.kill with the GIL let go; whether it was sent."""
    return _LIBC.kill(pid, sig) == 0


def kill_group(pgid: int, sig: int) -> bool:
    """os.killpg with the GIL let go; whether it was sent."""
    return _LIBC.killpg(pgid, sig) == 0


def pidfd_ended(fd: int) -> bool:
    """Whether the process behind a pidfd has ended (its pidfd is readable)."""
    return bool(select.select([fd], [], [], 0)[0])


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path,
                 cwd: str | None = None, unset_env: tuple[str, ...] | list[str] = (),
                 cpu_affinity: tuple[int, ...] | list[int] = (), held: bool = False,
                 note: str = "", tmp_env: str = ""):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.env_overrides = dict(env)
        self.unset_env = tuple(unset_env)   # dropped from the inherited environment
        # CPU workers: the whole process tree (not only the OMP compute threads) stays on the
        # worker's own cores, so one worker's busy threads cannot slow another down.
        self.cpu_affinity = tuple(cpu_affinity)
        self.log_path = Path(log_path)
        self.cwd = cwd
        # Started ahead and held (launcher.held_command): its standard input is a pipe on which
        # release() sends `go`; until then it waits, and it exits when the pipe closes unsent.
        self.held = held
        self.note = note        # a line of the harness's own, after the command's (one line)
        # A variable pointed at a short folder of this process's own, made at start and
        # removed at stop once none of its processes is left (WorkerCommand.tmp_env).
        self.tmp_env = tmp_env
        self.tmp_dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.known: dict[int, float] = {}   # pid -> reaper.started, descendants seen alive
        self.tag = ""                       # reaper.PROC_TAG_ENV in its environment (start())
        self.escaped: list[str] = []        # descendants found outside its session (stop())
        self._log = None

    # -- life -----------------------------------------------------------------------------
    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"# {self.name}: {' '.join(self.argv)}\n".encode())
        if self.note:
            self._log.write(f"{' '.join(self.note.splitlines())}\n".encode())
        env = {k: v for k, v in os.environ.items() if k not in self.unset_env}
        env.update(self.env_overrides)
        env.update(reaper.marker_env())     # ownership: sweeps stop marked processes only
        # This process's own tag: stop() finds a descendant that left the session by it.
        self.tag = f"{self.name}-{uuid.uuid4().hex[:12]}"
        env[reaper.PROC_TAG_ENV] = self.tag
        if self.tmp_env:
            self.tmp_dir = tempfile.mkdtemp(dir=reaper.tmp_root())
            env[self.tmp_env] = self.tmp_dir
        cores = set(self.cpu_affinity)
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        stdin = subprocess.PIPE if self.held else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=env, cwd=self.cwd, stdin=stdin,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=pin)
        self.started_at = time.monotonic()
        reaper.watch(self.pid, self.name)
        self.remember_descendants()
        return self

    def release(self) -> bool:
        """A held process goes on (`go` on its standard input); its start counts from now.
        False where it cannot: not held, released already, or gone."""
        if not self.held or self.proc is None or self.proc.stdin is None \
                or self.proc.stdin.closed or not self.alive():
            return False
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except OSError:         # it died just now: the pipe is broken
            return False
        self.started_at = time.monotonic()
        return True

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    where = ""       # where it runs, for messages (", node 1 (10.77.0.3)" on other hosts)

    def death_reason(self) -> str:
        """How it ended, in words: `signal 9` or `exit code 1`."""
        code = self.exit_code
        return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"

    def remember_descendants(self) -> None:
        if not self.alive():
            return
        try:
            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                self.known[p.pid] = reaper.started(p)
            except psutil.Error:
                pass

    def tree(self) -> list[psutil.Process]:
        """Every live process of this worker: its session, plus remembered descendants."""
        found: dict[int, psutil.Process] = {}
        sid = self.pid
        for p in psutil.process_iter(["pid"]):
            try:
                if p.pid in self.known and reaper.started(p) == self.known[p.pid]:
                    found[p.pid] = p
                elif sid > 0 and os.getsid(p.pid) == sid:
                    found[p.pid] = p
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return [p for p in found.values() if reaper.running(p)]

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the session's process group (everything the worker started that did
        not leave it), reading nothing first."""
        if self.pid > 0:
            kill_group(self.pid, sig)

    def signal_tree(self, sig: int) -> list[psutil.Process]:
        """Send `sig` to the session's group, then to every process of the tree still running;
        those processes."""
        self.signal_group(sig)
        procs = self.tree()
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        return procs

    def kill(self) -> None:
        """SIGKILL the whole tree at once, no grace (the second Ctrl-C)."""
        self.remember_descendants()
        self.signal_tree(signal.SIGKILL)

    def remember_escaped(self) -> None:
        """Descendants that left the session (a double fork and setsid: no child of the tree,
        no member of its session) carry the process's tag: remembered like descendants, so the
        stop signals them and counts them, and named in the stop's report."""
        if not self.tag:
            return
        tree = {p.pid for p in self.tree()}
        for p in reaper.tagged(self.tag):
            if p.pid in tree or p.pid in self.known:
                continue
            try:
                self.known[p.pid] = reaper.started(p)
                self.escaped.append(_describe(p))
            except psutil.Error:
                pass

    def stop(self, grace: float = 15.0) -> StopReport:
        t0 = time.monotonic()
        self.remember_descendants()
        self.remember_escaped()
        escalated = False
        if self.tree():
            self.signal_tree(signal.SIGCONT)   # a SIGSTOPped worker cannot handle SIGTERM
            self.signal_tree(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.tree():
                self._reap()
                time.sleep(0.1)
            if self.tree():
                escalated = True
                self.signal_tree(signal.SIGKILL)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and self.tree():
                    self._reap()
                    time.sleep(0.05)
        self._reap(wait=2.0)
        self.remember_escaped()             # one that left the session while it stopped
        survivors = [_describe(p) for p in self.tree()]
        if not survivors:      # survivors stay with the guardian, which stops them at exit
            reaper.forget(self.pid)
            if self.tmp_dir:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
                self.tmp_dir = None
        if self._log:
            self._log.close()
            self._log = None
        return StopReport(self.name, self.pid, self.exit_code, escalated,
                          time.monotonic() - t0, survivors, list(self.escaped))

    def _reap(self, wait: float = 0.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=wait) if wait else self.proc.poll()
        except subprocess.TimeoutExpired:
            pass

    # -- logs -----------------------------------------------------------------------------
    def log_text(self, max_bytes: int = 2_000_000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text(200_000).splitlines()[-n:])

    def failure_summary(self) -> str:
        """Role, argv, exit code, the first recognisable error line and the log tail."""
        text = self.log_text()
        hit = classify_log(text)
        code = self.exit_code
        code_s = f"exit code {code}" + (f" (signal {-code})" if code is not None and code < 0 else "")
        head = f"{self.name} exited while starting ({code_s})"
        if hit:
            head += f": [{hit[0]}] {hit[1]}"
        details = [f"argv: {' '.join(self.argv)}", f"log: {self.log_path}"]
        first, tb = first_error(text), last_traceback(text)
        if first and first[1] not in (tb, hit and hit[1]):
            details.append(f"first error (line {first[0]}):\n{first[1]}")
        if tb:
            details.append("last traceback:\n" + tb)
        details.append("log tail:\n" + self.log_tail(25))
        return head + "\n" + "\n".join(details)


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {p.pid}"
