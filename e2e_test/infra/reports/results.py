"""Result files: one JSON record per test, a session summary as JSON and markdown.

Layout under E2E_RESULTS_DIR (unset: results/<lane or run>-<date>-<time>-<pid>/ of this run,
with results/latest pointing at the newest; settings.results_dir):
  tests/<test id>.json     engine and versions, model, topology, device plan, ready time per
                           role, eval scores with n and errors, burst statistics, teardown verdict
  clusters/<name>/         plan.txt, cluster.json, logs/ (one per worker and the gateway)
  summary.json, summary.md the session table (markdown also goes to $GITHUB_STEP_SUMMARY)
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from ..cluster.cluster import results_root
from ..engines import all_engines
from ..specs import settings

VERSIONED = ("smg", "torch")      # besides each engine's own (Engine.packages)


def versions() -> dict[str, str]:
    out = {}
    for name in (*(p for e in all_engines() for p in e.packages), *VERSIONED):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    out["python"] = platform.python_version()
    return out


def git_sha() -> str | None:
    """The commit the harness ran from: E2E_GIT_SHA where set (a copied tree, whose .git, if
    any, is not the commit it holds), else git's (with "-dirty" for local changes); None
    outside git."""
    given = settings.get("E2E_GIT_SHA")
    if given:
        return given
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False).stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=False).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cluster_facts(c) -> dict:
    return {
        "engine": c.engine, "model": c.spec.id, "topology": c.topology.name,
        "backend": c.backend, "versions": versions(), "plan": c.plan.to_dict(),
        "ready_s": dict(c.timing.workers), "topology_ready_s": c.timing.topology_ready_s,
        "gateway_ready_s": c.timing.gateway_ready_s,
    }


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[-150:]


def _fmt_evals(rec: dict) -> str:
    parts = []
    for ev in rec.get("evals", {}).values():
        parts.append(f"{ev['eval']} {ev['accuracy']:.3f} (n={ev['scored']}, err={ev['errors']})")
    for b in rec.get("bursts", {}).values():
        parts.append(f"burst {b.get('name', '')}: {b.get('status_counts')}")
    return "; ".join(parts)


def table(records: list[dict]) -> str:
    head = "| test | outcome | engine | topology | ready s (max role) | results | teardown |"
    lines = [head, "|" + "---|" * 7]
    for r in records:
        ready = r.get("ready_s") or {}
        mx = max(ready.values()) if ready else None
        lines.append("| {} | {} | {} | {} | {} | {} | {} |".format(
            r["test"].split("::")[-1], r.get("outcome", ""), r.get("engine", ""),
            r.get("topology", ""), f"{mx:.1f}" if mx is not None else "",
            _fmt_evals(r), r.get("teardown", {}).get("verdict", "")))
    return "\n".join(lines)


def write_session(records: list[dict], clusters: dict, wall_s: float,
                  root: Path | None = None) -> dict:
    """The session's result files: one record per test (tests/), summary.json and summary.md.
    `clusters`: name -> {"timing": Timing as a dict, "teardown": TeardownReport.to_dict()}."""
    root = Path(root or results_root())
    (root / "tests").mkdir(parents=True, exist_ok=True)
    settings.mark_latest(root)
    teardowns = {name: c["teardown"] for name, c in clusters.items() if c.get("teardown")}
    timings = {name: c["timing"] for name, c in clusters.items()}
    for r in records:
        if r.get("cluster") in teardowns:
            r["teardown"] = teardowns[r["cluster"]]
        (root / "tests" / f"{safe_name(r['test'])}.json").write_text(
            json.dumps(r, indent=2, default=str))
    tbl = table(records) if records else ""
    summary = {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "wall_s": round(wall_s, 1), "versions": versions(), "tests": len(records),
               "git_sha": git_sha(), "argv": list(sys.argv),
               "clusters": {n: {"timing": timings[n], "teardown": teardowns.get(n)}
                            for n in clusters}}
    (root / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    md = f"## e2e results\n\n{tbl}\n" if tbl else "## e2e results\n\n(no records)\n"
    (root / "summary.md").write_text(md)
    step = os.environ.get("GITHUB_STEP_SUMMARY")
    if step:
        with open(step, "a") as f:
            f.write(md)
    return {"dir": str(root), "table": tbl}
