"""Where a lane's time went: booting workers, serving the tests' traffic, tearing down, idle.

    boots 71 %, traffic 28 %, teardown 2 %, idle 0 % of 100 s (2 boots, 71 s; compile cache: 3 off)

Inputs are plain data, so the arithmetic is pure (tests/test_time_report.py):
- one entry per cluster (`cluster_entry`): when its boot started (epoch seconds) and how long
  it took to be ready (Cluster.timing: total_ready_s, each worker's ready_s with its role, the
  gateway), when its teardown started and how long it took, the boots of restarted workers,
  and the engine's compile-cache verdict per worker (hit / miss / off / unknown);
- the test bodies' intervals (pytest's call phase, start and stop in epoch seconds);
- the session's start and end.

The four shares partition the session's wall time, each second counted once, in this order:
boot (any cluster booting, a worker restarting, or a restart's held interpreter importing
ahead: Cluster.hold_restarts), teardown (any cluster stopping, outside a
boot), traffic (a test body running, outside boots and teardowns: the window tests and the
fault tests boot inside their body; that part is a boot), idle (the rest: collection, fixture and idle-verification
waits, unit tests, result files).

Apart from that partition, `boot_waited_s` (and `boot_waited_pct`) counts the seconds the
session's main thread was blocked on a boot (each cluster's `boot_waits`: a boot it ran
itself, a wait for a topology booting in a thread, a wait for a background restart): what the
lane waited on. Serially every boot is waited on, so it equals the boot share; booted
together, a topology booting or a leg restarting while other topologies' tests run is a boot
second the lane did not wait on.

Per role, `boot_by_role_s` sums each cluster's slowest worker of that role (the workers of a
topology boot in parallel, so the roles overlap and do not add up to `boot_s`).

Per worker boot, `phases` (in each cluster's entry) says when each state of its log was first
seen (progress.py's markers: the engine's own, e.g. vLLM's "initializing engine" when the
engine process logs its first line); `boot_phases` gives each state's median duration over the
session's worker boots (from the state before it, or from the launch: `starting`), so a lane
shows whether its boots go to imports, weights, KV allocation or warm-up.

Per worker started through the warm-spawn launcher with a waiting child interpreter
(launchers/e2e_warm_spawn.py: TokenSpeed's scheduler), `warm_spawn` (in each cluster's entry)
holds what the child's lines in the worker's log say (`warm_spawn_status`): its imports, its
calls and whether they ran before the request or beside it, when the request came against the
end of the imports, and so how long it waited for the calls; the report's `warm_spawn` sums
them up over the session (`warm_line`).

Written as timing.json next to summary.json; the plugin prints `headline()` at the end.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

Interval = tuple[float, float]


def union(intervals) -> list[Interval]:
    """Sorted, merged intervals; empty or reversed ones dropped."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def subtract(intervals, minus) -> list[Interval]:
    """`intervals` less every second covered by `minus`."""
    out = []
    cut = union(minus)
    for a, b in union(intervals):
        pieces = [(a, b)]
        for c, d in cut:
            nxt = []
            for x, y in pieces:
                if d <= x or c >= y:
                    nxt.append((x, y))
                    continue
                if c > x:
                    nxt.append((x, c))
                if d < y:
                    nxt.append((d, y))
            pieces = nxt
        out.extend(pieces)
    return union(out)


def clip(intervals, lo: float, hi: float) -> list[Interval]:
    return union((max(a, lo), min(b, hi)) for a, b in intervals)


def _boot_intervals(c: dict) -> list[Interval]:
    out = []
    start, took = c.get("boot_started"), c.get("total_ready_s")
    if start is not None:
        if took is None:     # the start failed: booting until its teardown began (or nothing)
            took = (c["teardown_started"] - start) if c.get("teardown_started") else 0.0
        out.append((start, start + took))
    for s, took in c.get("restart_boots", ()):
        out.append((s, s + took))
    for s, took in c.get("held_imports", ()):     # a restart's imports, done ahead
        out.append((s, s + took))
    return out


def _teardown_intervals(c: dict) -> list[Interval]:
    s, took = c.get("teardown_started"), c.get("teardown_s")
    return [(s, s + took)] if s is not None and took is not None else []


def compute(clusters: list[dict], tests: list[Interval], t_start: float, t_end: float) -> dict:
    """The report as a dict (see the module doc). Pure."""
    wall = max(0.0, t_end - t_start)
    boot = clip([i for c in clusters for i in _boot_intervals(c)], t_start, t_end)
    down = subtract(clip([i for c in clusters for i in _teardown_intervals(c)], t_start, t_end),
                    boot)
    traffic = subtract(clip(tests, t_start, t_end), boot + down)
    boot_s, down_s, traffic_s = length(boot), length(down), length(traffic)
    recorded = any("boot_waits" in c for c in clusters)     # None: a record from before
    waited_s = length(clip([(a, a + d) for c in clusters for a, d in c.get("boot_waits", ())],
                           t_start, t_end)) if recorded else None
    idle_s = max(0.0, wall - boot_s - down_s - traffic_s)
    by_role: dict[str, float] = {}
    per_cluster = []
    for c in clusters:
        slowest: dict[str, float] = {}
        for w, s in (c.get("workers") or {}).items():
            role = (c.get("roles") or {}).get(w, w.rsplit("-", 1)[0])
            slowest[role] = max(slowest.get(role, 0.0), s or 0.0)
        if c.get("gateway_ready_s") is not None:
            slowest["gateway"] = c["gateway_ready_s"]
        for role, s in slowest.items():
            by_role[role] = round(by_role.get(role, 0.0) + s, 2)
        per_cluster.append({"name": c.get("name"), "topology": c.get("topology"),
                            "profile": c.get("profile"),
                            "boot_s": c.get("total_ready_s"),
                            "teardown_s": c.get("teardown_s"),
                            "restarts_s": [round(t, 2) for _, t in c.get("restart_boots", ())],
                            "held": c.get("held") or {},
                            "compile_cache": c.get("compile_cache") or {},
                            "phases": c.get("phases") or {},
                            "warm_spawn": c.get("warm_spawn") or {}})

    def pct(x: float) -> float:
        return round(100.0 * x / wall, 1) if wall > 0 else 0.0
    cache = [v for c in clusters for v in (c.get("compile_cache") or {}).values()]
    return {
        "wall_s": round(wall, 1), "boots": sum(1 for c in clusters if c.get("boot_started") is not None),
        "boot_s": round(boot_s, 1), "traffic_s": round(traffic_s, 1),
        "teardown_s": round(down_s, 1), "idle_s": round(idle_s, 1),
        "share_pct": {"boot": pct(boot_s), "traffic": pct(traffic_s),
                      "teardown": pct(down_s), "idle": pct(idle_s)},
        "boot_waited_s": None if waited_s is None else round(waited_s, 1),
        "boot_waited_pct": None if waited_s is None else pct(waited_s),
        "boot_by_role_s": by_role,
        "compile_cache": {k: cache.count(k) for k in sorted(set(cache))},
        "boot_phases": boot_phases(clusters),
        "warm_spawn": warm_spawn_summary(clusters),
        "clusters": per_cluster,
    }


def phase_durations(seen: dict[str, float]) -> list[tuple[str, float]]:
    """One worker boot's states in the order first seen, each with how long it lasted: from
    the launch (`starting`) to the first state, and from each state to the next; `ready`
    ends it. Pure."""
    order = sorted(((t, s) for s, t in seen.items() if s != "ready"), key=lambda x: x[0])
    end = seen.get("ready")
    marks = [(0.0, "starting")] + order
    out = []
    for i, (t, state) in enumerate(marks):
        nxt = marks[i + 1][0] if i + 1 < len(marks) else end
        if nxt is not None:
            out.append((state, round(max(0.0, nxt - t), 2)))
    return out


def boot_phases(clusters: list[dict]) -> dict:
    """Each state's median duration over every worker boot of the session that has phases,
    in the order states first occur: {"boots": N, "median_s": {state: s}}. Pure."""
    spans: dict[str, list[float]] = {}
    boots = 0
    for c in clusters:
        for seen in (c.get("phases") or {}).values():
            if "ready" not in seen:
                continue
            boots += 1
            for state, d in phase_durations(seen):
                spans.setdefault(state, []).append(d)

    def median(xs):
        xs = sorted(xs)
        n = len(xs)
        return round(xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2, 2)
    return {"boots": boots, "median_s": {s: median(v) for s, v in spans.items()}}


def phases_line(rep: dict) -> str | None:
    """`boot phases (median of N worker boots): starting 25.1 s, initializing engine ...`,
    None without phases."""
    bp = rep.get("boot_phases") or {}
    if not bp.get("boots"):
        return None
    return (f"boot phases (median of {bp['boots']} worker boots): "
            + ", ".join(f"{s} {d:.1f} s" for s, d in bp["median_s"].items()))


def headline(rep: dict) -> str:
    s = rep["share_pct"]
    cache = ", ".join(f"{n} {k}" for k, n in rep.get("compile_cache", {}).items())
    waited = ("" if rep.get("boot_waited_pct") is None
              or round(rep["boot_waited_pct"]) == round(s["boot"])
              else f" (waited on {rep['boot_waited_pct']:.0f} %)")
    return (f"boots {s['boot']:.0f} %{waited}, traffic {s['traffic']:.0f} %, teardown "
            f"{s['teardown']:.0f} %, idle {s['idle']:.0f} % of {rep['wall_s']:.0f} s "
            f"({rep['boots']} boots, {rep['boot_s']:.0f} s"
            + (f"; compile cache: {cache}" if cache else "") + ")"
            + (f"; {rep['assignment']['workers']} topologies at once"
               if (rep.get("assignment") or {}).get("workers", 1) > 1 else ""))


# The warm child's line when it takes the request, and the line of calls made beside the
# target when they end (launchers/e2e_warm_spawn.py child_main, calls_beside).
_WARM_LINE = re.compile(
    r"e2e_warm_spawn \(pid \d+\): imports ([0-9.]+) s, (?:(\d+) calls (?:([0-9.]+) s "
    r"\((\d+) failed\)|beside the target \((?:ended|running) at the request\)), )?request "
    r"(?:([0-9.]+) s after the imports|([0-9.]+) s before the imports ended)")
_BESIDE_LINE = re.compile(
    r"e2e_warm_spawn \(pid \d+\): \d+ calls beside the target: ([0-9.]+) s \((\d+) "
    r"failed\), ended (?:([0-9.]+) s after the request came|before the request came)")


def warm_spawn_status(text: str) -> dict | None:
    """What a worker log's first warm child says (its first boot's), None where it has none:
    {"imports_s", "calls", "calls_mode" (before | beside | None), "calls_s" (before: how long
    they took; beside: how long the thread ran, once it said so), "calls_failed",
    "request_after_imports_s" (negative: the request came while the imports still ran),
    "waited_for_calls_s" (before: how much longer the calls ran than the request waited for
    the imports; beside: 0), "beside_ended_after_request_s" (beside: when the calls ended
    against the request; 0 where before it)}. Pure."""
    m = _WARM_LINE.search(text)
    if not m:
        return None
    imports, n, calls_s, failed, after, before = m.groups()
    lag = float(after) if after is not None else -float(before)
    out = {"imports_s": float(imports), "calls": int(n or 0),
           "calls_mode": None if not n else ("before" if calls_s is not None else "beside"),
           "calls_s": None if calls_s is None else float(calls_s),
           "calls_failed": None if failed is None else int(failed),
           "request_after_imports_s": lag}
    if out["calls_mode"] == "before":
        out["waited_for_calls_s"] = round(max(0.0, out["calls_s"] - max(0.0, lag)), 2)
    elif out["calls_mode"] == "beside":
        out["waited_for_calls_s"] = 0.0
        b = _BESIDE_LINE.search(text, m.end())
        if b:
            out.update(calls_s=float(b.group(1)), calls_failed=int(b.group(2)),
                       beside_ended_after_request_s=float(b.group(3) or 0.0))
    return out


def warm_spawn_summary(clusters: list[dict]) -> dict | None:
    """The session's warm children (`warm_spawn` of every cluster entry) summed up: how
    many, their imports, how their calls ran, and the request's wait for them (min, median,
    max); None without any. Pure."""
    rows = [w for c in clusters for w in (c.get("warm_spawn") or {}).values() if w]
    if not rows:
        return None

    def spread(xs):
        xs = [x for x in xs if x is not None]
        return [round(min(xs), 2), round(statistics.median(xs), 2),
                round(max(xs), 2)] if xs else None
    modes = sorted({r["calls_mode"] for r in rows if r["calls_mode"]})
    return {"children": len(rows), "imports_s": spread(r["imports_s"] for r in rows),
            "calls_modes": modes,
            "calls_failed": sum(r.get("calls_failed") or 0 for r in rows),
            "waited_for_calls_s": spread(r.get("waited_for_calls_s") for r in rows),
            "calls_s": spread(r.get("calls_s") for r in rows),
            "beside_ended_after_request_s": spread(
                r.get("beside_ended_after_request_s") for r in rows)}


def warm_line(rep: dict) -> str | None:
    """`warm spawn (5 children): imports 9.9 s (9.1-11.9), 3 calls before the request, which
    waited 0.3 s for them (0.0-0.5), 0 failed`, None without warm children."""
    w = rep.get("warm_spawn")
    if not w:
        return None

    def fmt(x, label):
        return f"{x[1]:.1f} s {label}({x[0]:.1f}-{x[2]:.1f})" if x else "?"
    out = f"warm spawn ({w['children']} children): imports {fmt(w['imports_s'], '')}"
    if not w["calls_modes"]:
        return out + ", no calls"
    out += f", calls {' and '.join(w['calls_modes'])} the request"
    if "before" in w["calls_modes"]:
        out += f", which waited {fmt(w['waited_for_calls_s'], 'for them ')}"
    if w.get("beside_ended_after_request_s"):
        out += f", beside ended {fmt(w['beside_ended_after_request_s'], 'after it ')}"
    return out + f", {w['calls_failed']} failed"


def cluster_entry(c) -> dict:
    """A Cluster's part of the report: its timing, its workers' roles and each worker's
    compile-cache verdict as its engine reads it from the worker's log."""
    t = c.timing
    cache, warm = {}, {}
    for w in c.workers:
        try:
            text = w.process.log_text() if w.process else ""
        except OSError:
            text = ""
        cache[w.name] = c.driver.compile_cache_status(text, c.options)
        status = warm_spawn_status(text)
        if status:
            warm[w.name] = status
    return {"name": c.name, "topology": c.topology.name,
            "profile": "eager" if c.options.enforce_eager else "compiled",
            "boot_started": t.boot_started, "total_ready_s": t.total_ready_s,
            "workers": dict(t.workers), "roles": {w.name: w.entry.role for w in c.workers},
            "gateway_ready_s": t.gateway_ready_s,
            "gateway_probe_failures": list(t.gateway_probe_failures),
            "teardown_started": t.teardown_started,
            "teardown_s": t.teardown_s, "restart_boots": list(t.restart_boots),
            "held_imports": list(t.held_imports), "held": dict(t.held),
            "boot_waits": list(t.boot_waits),
            "compile_cache": cache, "phases": {k: dict(v) for k, v in t.phases.items()},
            "warm_spawn": warm}


def write(rep: dict, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "timing.json"
    path.write_text(json.dumps({**rep, "headline": headline(rep)}, indent=2))
    return path
