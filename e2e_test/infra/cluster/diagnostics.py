"""What the harness attaches when something hangs (worker queue gauges, stack dumps) or a
nested session fails (the first error of its worker logs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from ..lifecycle.process import first_error
from . import metrics


def queue_gauges(cluster) -> dict[str, str]:
    """{"running": metric, "waiting": metric} from the engine's own idle gauges
    (Engine.idle_gauges); empty when the engine names none."""
    g = cluster.driver.idle_gauges or {}
    return {k: g[k] for k in ("running", "waiting") if k in g}


# The stall report's wait for a worker's /metrics: on a loaded 2-core runner an API server
# answered in up to 10.5 s (cluster.WORK_SCRAPE_S). A stopped worker is named without it.
QUEUE_SCRAPE_S = 10.0


def _tree(w) -> list:
    """Worker `w`'s processes as psutil objects; [] where they cannot be listed (not started,
    another machine, a launcher's handle that cannot say)."""
    proc = getattr(w, "process", None)
    try:
        return list(proc.tree()) if proc is not None else []
    except Exception:  # noqa: BLE001 (a launcher's handle that cannot list: unknown)
        return []


def stopped_pid(w) -> int | None:
    """A process of worker `w` that is stopped (state T: SIGSTOP, a debugger), or None."""
    for p in _tree(w):
        try:
            if p.status() == psutil.STATUS_STOPPED:
                return p.pid
        except psutil.Error:
            pass
    return None


def worker_queues(cluster) -> dict[str, dict[str, float]]:
    gauges = queue_gauges(cluster)

    def one(w):
        if not gauges:
            return {"error": f"engine {cluster.engine!r} names no queue gauges",
                    "no_gauges": 1.0}
        pid = stopped_pid(w)
        if pid is not None:
            return {"error": f"process {pid} is stopped (state T, e.g. SIGSTOP)",
                    "stopped": 1.0}
        try:
            s = metrics.scrape(f"{w.http_url}/metrics", timeout=QUEUE_SCRAPE_S)
            return {k: metrics.total(s, name) for k, name in gauges.items()}
        except Exception as e:
            return {"error": repr(e)[:120]}

    with ThreadPoolExecutor(max_workers=max(1, len(cluster.workers))) as ex:
        return dict(zip([w.name for w in cluster.workers], ex.map(one, cluster.workers)))


def _schedstat_s(pid: int) -> float | None:
    """Seconds the process's threads ran or waited on a run queue (Linux
    /proc/PID/task/*/schedstat: on-CPU plus run-queue wait, nanoseconds); None where the kernel
    gives no schedstat or the process is gone. A thread that ends meanwhile is left out."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        total += int(run) + int(wait)
    return total / 1e9


SCHEDSTAT = _schedstat_s(os.getpid()) is not None


def cpu_cores(workers, interval: float = 1.0) -> dict[str, float | None]:
    """Cores each worker's processes asked for over `interval` seconds: the time its process
    tree ran or was ready to run (schedstat: on-CPU plus run-queue wait), so a computing
    worker counts about a core per busy thread however loaded the machine is, and a waiting
    one about none; where the kernel has no schedstat, the user + system time it got. None
    where they cannot be read (another machine, gone). An engine's gauges move once a step,
    so in a long step (a 2k-token prefill on one CPU core takes tens of seconds) they show
    the step's start: about a core busy says it computes, about none that it waits. A hint,
    not a verdict: a spinning wait is busy too."""
    def times(ps):
        out = 0.0
        for p in ps:
            demand = _schedstat_s(p.pid) if SCHEDSTAT else None
            if demand is not None:
                out += demand
                continue
            try:
                t = p.cpu_times()
                out += t.user + t.system
            except psutil.Error:
                pass
        return out

    trees = {w.name: _tree(w) for w in workers}
    t0 = {n: times(ps) for n, ps in trees.items()}
    m0 = time.monotonic()
    time.sleep(interval)
    dt = max(time.monotonic() - m0, 1e-6)
    return {n: (round((times(ps) - t0[n]) / dt, 2) if ps else None) for n, ps in trees.items()}


def stuck_role(queues: dict[str, dict[str, float]], cluster=None) -> str:
    """The worker that holds requests (running or waiting) or stopped answering; with the
    cores it used (`cores`, from cpu_cores) where known."""
    # a stopped worker first: it explains the others' silence, not the other way round
    dead = sorted((n for n, q in queues.items() if "error" in q),
                  key=lambda n: "stopped" not in queues[n])
    if dead:
        q = queues[dead[0]]
        why = q["error"] if "no_gauges" in q or "stopped" in q else \
            "metrics endpoint not answering"
        return f"{dead[0]} ({why})"

    def held(q):
        return q.get("running", 0) + q.get("waiting", 0)

    busy = sorted(queues.items(), key=lambda kv: -held(kv[1]))
    if busy and held(busy[0][1]) > 0:
        name, q = busy[0]
        cores = f", {q['cores']:.1f} cores busy" if q.get("cores") is not None else ""
        return (f"{name} (running {q.get('running', 0):.0f}, "
                f"waiting {q.get('waiting', 0):.0f}{cores})")
    return "gateway (no worker holds the requests)"


def _dump(exe: str | None, p: psutil.Process, f: Path, timeout: float) -> Path:
    try:
        if p.status() == psutil.STATUS_STOPPED:
            f.write_text(f"pid {p.pid} is stopped (state T, e.g. SIGSTOP): no stack to sample\n")
            return f
    except psutil.Error:
        f.write_text(f"pid {p.pid} is gone\n")
        return f
    if exe is None:
        f.write_text("py-spy not installed\n")
        return f
    try:
        r = subprocess.run([exe, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                           timeout=timeout)
        f.write_text(r.stdout + r.stderr)
    except subprocess.TimeoutExpired:
        f.write_text(f"py-spy timed out after {timeout:.0f} s\n")
    return f


def pyspy_exe() -> str | None:
    """py-spy on PATH, else beside this interpreter (a virtualenv's bin), else None."""
    exe = shutil.which("py-spy")
    if exe is None and (Path(sys.executable).parent / "py-spy").is_file():
        exe = str(Path(sys.executable).parent / "py-spy")
    return exe


def stack_dumps(cluster, out_dir: Path, timeout: float = 8.0, workers=None) -> list[Path]:
    """py-spy dump of every process of every worker (or of `workers`), in parallel; one file
    per process."""
    exe = pyspy_exe()
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(p, out_dir / f"stack-{w.name}-{p.pid}.txt")
            for w in (cluster.workers if workers is None else workers) if w.process
            for p in w.process.tree()]
    with ThreadPoolExecutor(max_workers=8) as ex:
        return list(ex.map(lambda j: _dump(exe, j[0], j[1], timeout), jobs))


def diagnose_stall(cluster) -> str:
    """First line: topology and the role that looks stuck. Then queues and dump paths."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as ex:
        cores = ex.submit(cpu_cores, cluster.workers)
        queues = worker_queues(cluster)
        for name, c in cores.result().items():
            if name in queues and c is not None:
                queues[name]["cores"] = c
    role = stuck_role(queues)
    dumps = stack_dumps(cluster, cluster.dir / "stall")
    lines = [f"topology {cluster.topology.name} ({cluster.engine}): looks stuck at {role}",
             "worker queues: " + ", ".join(f"{n} {q}" for n, q in queues.items()),
             f"stack dumps ({len(dumps)}) in {cluster.dir / 'stall'} "
             f"(collected in {time.monotonic() - t0:.1f} s)"]
    return "\n".join(lines)


# Where a session's output names a worker that failed: a failed start's `log: PATH`
# (process.failure_summary) or a boot timeout's `--- worker-0 (PATH): ...`; a death's
# `topology dp2 (vllm): worker-1 (pid 7) died: ...` (Cluster.dead_processes), whose log
# cluster.json names.
LOG_PATH = re.compile(r"(/[^\s'\"()]+\.log)\b")
DEATHS = re.compile(r"topology (\S+) \((\S+)\): (.+)")
DIED = re.compile(r"(\S+) \(pid \d+.*?\) died")
# How much of a worker log's head is searched for its first error (a failed start's is early).
LOG_HEAD_BYTES = 4_000_000


def _log_head(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(LOG_HEAD_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def _died_logs(line: str, root: Path) -> list[Path]:
    """The logs of the workers (or gateway) that a death line names, from the cluster.json of
    each topology of that name and engine under `root`."""
    m = DEATHS.search(line)
    if not m:
        return []
    topology, engine, rest = m.groups()
    out = []
    for f in sorted(root.glob("clusters/*/cluster.json")):
        try:
            desc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if desc.get("topology") != topology or desc.get("engine") != engine:
            continue
        logs = {w.get("name"): w.get("log") for w in desc.get("workers", [])}
        for name in DIED.findall(rest):
            out.append(Path(logs.get(name) or f.parent / "logs" / f"{name}.log"))
    return out


def failed_worker_logs(out: str, results: Path) -> list[Path]:
    """The worker logs under `results` that a session's output `out` names as a failed
    worker's, in the order it names them."""
    root = Path(results).resolve()
    logs: list[Path] = []
    for line in out.splitlines():
        for p in [Path(m) for m in LOG_PATH.findall(line)] + _died_logs(line, root):
            p = p.resolve()
            if p not in logs and p.is_relative_to(root) and p.is_file():
                logs.append(p)
    return logs


def nested_failure(out: str, results: Path, returncode: int | None = None,
                   tail: int = 4000, most: int = 3) -> str:
    """The failure message of a nested pytest session: the first error (process.first_error)
    of each worker log (up to `most`) that its output `out` names as a failed worker's, with
    the worker's name and the log's path, then the output's last `tail` characters. The tail
    alone cuts off a failed boot's cause: the error of every test of that topology and the
    session's summary follow it. Only named logs: every vLLM log shows an ERROR record at a
    clean teardown."""
    logs = failed_worker_logs(out, results)
    parts = ["nested pytest" + (f" exited {returncode}" if returncode is not None else "")]
    shown = 0
    for p in logs:
        hit = first_error(_log_head(p))
        if hit is not None and shown < most:
            parts.append(f"first error of {p.parent.parent.name}/{p.stem} "
                         f"(line {hit[0]} of {p}):\n{hit[1]}")
            shown += 1
    if not logs:
        parts.append("its output names no worker that failed (a failed start's `log: PATH`, "
                     "a death's `worker-0 (pid N) died`)")
    elif not shown:
        parts.append("no error line (a traceback, an ERROR record, a known error) in "
                     + ", ".join(map(str, logs)))
    parts.append(f"last {tail} characters of its output:\n{out[-tail:]}")
    return "\n".join(parts)
