"""What the harness attaches when something hangs: worker queue gauges and stack dumps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from . import metrics


def queue_gauges(cluster) -> dict[str, str]:
    """{"running": metric, "waiting": metric} from the engine's own idle gauges
    (Engine.idle_gauges); empty when the engine names none."""
    g = cluster.driver.idle_gauges or {}
    return {k: g[k] for k in ("running", "waiting") if k in g}


def worker_queues(cluster) -> dict[str, dict[str, float]]:
    gauges = queue_gauges(cluster)

    def one(w):
        if not gauges:
            return {"error": f"engine {cluster.engine!r} names no queue gauges",
                    "no_gauges": 1.0}
        try:
            s = metrics.scrape(f"{w.http_url}/metrics", timeout=3.0)
            return {k: metrics.total(s, name) for k, name in gauges.items()}
        except Exception as e:
            return {"error": repr(e)[:120]}

    with ThreadPoolExecutor(max_workers=max(1, len(cluster.workers))) as ex:
        return dict(zip([w.name for w in cluster.workers], ex.map(one, cluster.workers)))


def stuck_role(queues: dict[str, dict[str, float]], cluster=None) -> str:
    """The worker that holds requests (running or waiting) or stopped answering."""
    dead = [n for n, q in queues.items() if "error" in q]
    if dead:
        why = queues[dead[0]]["error"] if "no_gauges" in queues[dead[0]] else \
            "metrics endpoint not answering"
        return f"{dead[0]} ({why})"

    def held(q):
        return q.get("running", 0) + q.get("waiting", 0)

    busy = sorted(queues.items(), key=lambda kv: -held(kv[1]))
    if busy and held(busy[0][1]) > 0:
        name, q = busy[0]
        return f"{name} (running {q.get('running', 0):.0f}, waiting {q.get('waiting', 0):.0f})"
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


def stack_dumps(cluster, out_dir: Path, timeout: float = 8.0, workers=None) -> list[Path]:
    """py-spy dump of every process of every worker (or of `workers`), in parallel; one file
    per process."""
    exe = shutil.which("py-spy")
    if exe is None and (Path(sys.executable).parent / "py-spy").is_file():
        exe = str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(p, out_dir / f"stack-{w.name}-{p.pid}.txt")
            for w in (cluster.workers if workers is None else workers) if w.process
            for p in w.process.tree()]
    with ThreadPoolExecutor(max_workers=8) as ex:
        return list(ex.map(lambda j: _dump(exe, j[0], j[1], timeout), jobs))


def diagnose_stall(cluster) -> str:
    """First line: topology and the role that looks stuck. Then queues and dump paths."""
    t0 = time.monotonic()
    queues = worker_queues(cluster)
    role = stuck_role(queues)
    dumps = stack_dumps(cluster, cluster.dir / "stall")
    lines = [f"topology {cluster.topology.name} ({cluster.engine}): looks stuck at {role}",
             "worker queues: " + ", ".join(f"{n} {q}" for n, q in queues.items()),
             f"stack dumps ({len(dumps)}) in {cluster.dir / 'stall'} "
             f"(collected in {time.monotonic() - t0:.1f} s)"]
    return "\n".join(lines)
