"""HTML pages from result folders: one page per run, and a trend page across runs.

Both pages are static and self-contained (styles inline, plots embedded as data: URIs), so a
CI artifact or a folder under docs/ can be opened from disk with no server and no network.

  python -m e2e_test report --html DIR [--out run.html]
  python -m e2e_test report --trend DIR DIR ... [--out trend.html]
  python -m e2e_test report --trend docs/validation/index.jsonl [--out trend.html]

Inputs are what a run leaves in E2E_RESULTS_DIR (see results.py and report.py): tests/*.json,
summary.json, optional run.json ({"lane", "device", "date", "note", "git_sha", "argv"}), and the
burst histograms (PNG) next to them or under bursts/. Nothing is retyped: a key a record does not
have is left out of the page.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from pathlib import Path

from . import report

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5rem;color:#1d2330;
max-width:1400px}
h1{font-size:1.5rem;margin-bottom:.2rem}h2{font-size:1.2rem;margin-top:2rem;
border-bottom:1px solid #ccd;padding-bottom:.2rem}h3{font-size:1rem;margin-top:1.2rem}
table{border-collapse:collapse;margin:.5rem 0 1rem 0;font-size:.85rem}
th,td{border:1px solid #ccd;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#eef0f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.passed,.identical,.clean,.same{background:#e3f6e6}.failed,.error,.mismatch,.dirty,.changed{background:#fde2e1}
.skipped,.numerics{background:#fff5d6}.meta{color:#555;font-size:.85rem}
code{background:#f3f4f8;padding:0 .2rem;border-radius:3px}
img.plot{max-width:640px;border:1px solid #ccd;margin:.3rem .6rem .6rem 0}
details{margin:.3rem 0}summary{cursor:pointer}
.mark{color:#b3261e;font-weight:bold}
"""


def esc(x) -> str:
    return html.escape("" if x is None else str(x))


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _table(head: list[str], rows: list[list], classes: list[str | None] | None = None) -> str:
    """`rows` cells are already-escaped HTML strings (use esc() for text)."""
    out = ["<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head)
           + "</tr></thead><tbody>"]
    for i, r in enumerate(rows):
        cls = (classes or [None] * len(rows))[i]
        attr = f' class="{esc(cls)}"' if cls else ""
        out.append(f"<tr{attr}>"
                   + "".join(f"<td>{c}</td>" for c in r) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _png_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _find_png(d: Path, recorded: str | None) -> Path | None:
    """A burst histogram was recorded with the absolute path of the machine that ran it; the
    published folder keeps it next to the records or under bursts/."""
    if not recorded:
        return None
    name = Path(recorded).name
    for cand in (Path(recorded), d / name, d / "bursts" / name):
        if cand.is_file():
            return cand
    return None


def _run_meta(r: dict) -> dict:
    """git SHA and command line: run.json first, then summary.json (results.write_session)."""
    run, s = r["run"], r["summary"]
    sha = run.get("git_sha") or s.get("git_sha")
    argv = run.get("argv") or run.get("command") or s.get("argv")
    if isinstance(argv, list):
        import shlex
        argv = shlex.join(str(a) for a in argv)
    return {"sha": sha, "argv": argv}


# ---------------------------------------------------------------- generic oracle rendering

def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return esc(json.dumps(v, default=str)[:300])
    return esc(v)


def oracle_html(o: dict) -> str:
    """Render an `oracle` record key generically: verdict, counts, control arm, items table.
    Items are dicts with at least index and verdict; every other key becomes a column."""
    if not isinstance(o, dict):
        return f"<p>{esc(o)}</p>"
    out = []
    verdict = o.get("verdict")
    if verdict is not None:
        out.append(f"<p>oracle verdict: <b>{esc(verdict)}</b></p>")
    items = o.get("items") or []
    if items and all(isinstance(i, dict) for i in items):
        counts: dict[str, int] = {}
        for i in items:
            counts[str(i.get("verdict"))] = counts.get(str(i.get("verdict")), 0) + 1
        out.append("<p>items: " + ", ".join(f"{esc(v)} {n}" for v, n in sorted(counts.items()))
                   + "</p>")
    scalars = {k: v for k, v in o.items() if k not in ("verdict", "items", "control")
               and not isinstance(v, (dict, list))}
    if scalars:
        out.append(_table(["key", "value"], [[esc(k), _cell(v)] for k, v in scalars.items()]))
    ctl = o.get("control")
    if isinstance(ctl, dict):
        out.append("<details><summary>control arm (baseline against itself)</summary>"
                   + oracle_html(ctl) + "</details>")
    if items and all(isinstance(i, dict) for i in items):
        cols: list[str] = []
        for i in items:
            for k in i:
                if k not in cols:
                    cols.append(k)
        cols.sort(key=lambda k: (k != "index", k != "verdict"))
        rows = [[_cell(i.get(k)) for k in cols] for i in items]
        cls = [str(i.get("verdict")) for i in items]
        out.append(f"<details{' open' if any(c == 'mismatch' for c in cls) else ''}>"
                   f"<summary>{len(items)} items</summary>" + _table(cols, rows, cls)
                   + "</details>")
    for k, v in o.items():          # nested non-control dicts: one level, as key/value tables
        if isinstance(v, dict) and k != "control":
            out.append(f"<h4>{esc(k)}</h4>" + _table(
                ["key", "value"], [[esc(a), _cell(b)] for a, b in v.items()]))
    return "".join(out)


# ---------------------------------------------------------------- the run page

def _plan_cell(plan: dict) -> str:
    out = []
    for e in plan.get("entries", []):
        where = (f"gpu {','.join(map(str, e['gpus']))}" if e.get("gpus")
                 else f"cores {','.join(map(str, e.get('cores', [])))}")
        extra = f", tp {e['tp']}" if e.get("tp", 1) != 1 else ""
        out.append(f"{esc(e['name'])}: {esc(where)}{esc(extra)}")
    return "<br>".join(out)


def _teardown_cell(td: dict | None) -> tuple[str, str | None]:
    if not td:
        return "", None
    v = esc(td.get("verdict", ""))
    if td.get("gpu_checked") and not td.get("gpu_leaks"):
        v += "; GPU memory back to baseline (NVML)"
    for k in ("survivors", "escalated", "busy_ports", "shm_left"):
        if td.get(k):
            v += f"<br>{esc(k)}: {esc(td[k])}"
    if td.get("gpu_leaks"):
        v += f"<br>gpu_leaks: {esc(td['gpu_leaks'])}"
    return v, ("clean" if td.get("ok") else "dirty")


def render_run(d: Path) -> str:
    d = Path(d)
    r = report.load_results(d)
    run, s, tests = r["run"], r["summary"], r["tests"]
    meta = _run_meta(r)
    title = f"{run.get('lane', d.name)} — {run.get('device', '?')}"
    body = [f"<h1>{esc(title)}</h1>"]
    counts = {o: sum(t.get("outcome") == o for t in tests)
              for o in ("passed", "failed", "skipped", "error")}
    facts = [("date", run.get("date", s.get("finished"))),
             ("git SHA", meta["sha"]), ("command line", meta["argv"]),
             ("versions", ", ".join(f"{k} {v}" for k, v in sorted(s.get("versions", {}).items()))),
             ("tests", ", ".join(f"{n} {o}" for o, n in counts.items())
              + (f" (session wall {s['wall_s']} s)" if "wall_s" in s else "")),
             ("note", run.get("note")), ("", run.get("extra"))]
    body.append("<ul class=\"meta\">" + "".join(
        f"<li>{esc(k) + ': ' if k else ''}{'<code>' + esc(v) + '</code>' if k in ('git SHA', 'command line') else esc(v)}</li>"
        for k, v in facts if v) + "</ul>")
    for name in ("gpu-before.txt", "gpu-after.txt"):
        f = d / name
        if f.is_file():
            body.append(f"<p class=\"meta\">nvidia-smi {esc(name[4:-4])} the session: "
                        f"<code>{esc(' ; '.join(ln.strip() for ln in f.read_text().splitlines() if ln.strip()))}</code></p>")

    # topologies: plan from any record of that cluster, timing/teardown from the summary
    by_cluster: dict[str, dict] = {}
    for t in tests:
        if t.get("cluster"):
            by_cluster.setdefault(t["cluster"], t)
    clusters = s.get("clusters", {})
    names = list(clusters) + [n for n in by_cluster if n not in clusters]
    if names:
        body.append("<h2>Topologies</h2>")
        rows, cls = [], []
        for name in names:
            c = clusters.get(name, {})
            t = by_cluster.get(name, {})
            tm = c.get("timing", {})
            ready = tm.get("workers") or t.get("ready_s") or {}
            td, tcls = _teardown_cell(c.get("teardown") or t.get("teardown"))
            rows.append([esc(name), esc(t.get("engine", "")), esc(t.get("topology", "")),
                         _plan_cell(t.get("plan") or {}),
                         "<br>".join(f"{esc(k)}: {v:.1f} s" for k, v in sorted(ready.items())),
                         f"{tm['topology_ready_s']:.1f} s" if tm.get("topology_ready_s") else "",
                         f"{tm['gateway_ready_s']:.1f} s" if tm.get("gateway_ready_s") else "",
                         td])
            cls.append(None if tcls == "clean" else tcls)
        body.append(_table(["cluster", "engine", "topology", "plan", "ready per role",
                            "all ready", "gateway", "teardown"], rows, cls))

    body.append("<h2>Tests</h2>")
    rows, cls = [], []
    for t in tests:
        rows.append([esc(t["test"].split("::")[-1]), esc(t.get("outcome", "")),
                     esc(t.get("topology", "")), esc(t.get("cluster", "")),
                     esc(report.details(t))])
        cls.append(t.get("outcome"))
    body.append(_table(["test", "outcome", "topology", "cluster", "results"], rows, cls))

    oracles = [t for t in tests if t.get("oracle")]
    if oracles:
        body.append("<h2>Comparison verdicts</h2>")
        for t in oracles:
            body.append(f"<h3>{esc(t['test'].split('::')[-1])}</h3>" + oracle_html(t["oracle"]))

    bursts = [(t, b) for t in tests for b in (t.get("bursts") or {}).values()]
    if bursts:
        body.append("<h2>Bursts</h2>")
        for t, b in bursts:
            lat = b.get("latency_s") or {}
            win = b.get("effective_window") or {}
            body.append(f"<h3>{esc(t.get('cluster', ''))} · {esc(b.get('name', ''))}</h3>")
            facts = [("status", b.get("status_counts")), ("n", b.get("n")),
                     ("200 latency p50 / p99 s", f"{lat['p50']:.3f} / {lat['p99']:.3f}"
                      if lat else None),
                     ("req/s", b.get("req_per_s")), ("output tok/s", b.get("out_tok_per_s")),
                     ("engine window", json.dumps(win) if win else None),
                     ("admission", json.dumps(b["admission"]) if b.get("admission") else None),
                     ("smg rejected", b.get("rejected_metric_delta"))]
            body.append(_table(["", ""], [[esc(k), _cell(v)] for k, v in facts
                                          if v is not None]))
            png = _find_png(d, b.get("histogram"))
            if png:
                body.append(f"<img class=\"plot\" alt=\"latency histogram {esc(b.get('name'))}\" "
                            f"src=\"{_png_uri(png.read_bytes())}\">")
            elif b.get("histogram"):
                body.append(f"<p class=\"meta\">histogram not in this folder: "
                            f"{esc(b['histogram'])}</p>")

    if clusters:
        body.append("<h2>Teardown</h2>")
        rows, cls = [], []
        for name, c in clusters.items():
            td, tcls = _teardown_cell(c.get("teardown"))
            secs = (c.get("teardown") or {}).get("seconds")
            rows.append([esc(name), f"{secs:.1f} s" if secs is not None else "", td])
            cls.append(tcls)
        body.append(_table(["cluster", "seconds", "verdict"], rows, cls))
    return _page(title, body)


# ---------------------------------------------------------------- the trend page

def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes of n (95 % at z=1.96)."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def proportion_changed(k1: int, n1: int, k2: int, n2: int, z: float = 1.96) -> bool:
    """Two-proportion z-test (pooled): is k2/n2 different from k1/n1 beyond sampling noise?"""
    if n1 <= 0 or n2 <= 0:
        return False
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:
        return k1 / n1 != k2 / n2
    return abs(k2 / n2 - k1 / n1) / se > z


# A continuous series point is marked when it leaves the band the earlier points of the same
# series span: median ± max(3 · 1.4826 · MAD, FLOOR · median). With one earlier point the MAD
# is 0 and the floor alone decides. The floor stands for the run-to-run spread no folder
# records (boot time on a shared machine); it is a documented constant, not tuned to a run.
NOISE_FLOOR = 0.25


def beyond_noise(history: list[float], value: float, floor: float = NOISE_FLOOR) -> bool:
    hist = [h for h in history if h is not None and not math.isnan(h)]
    if not hist or value is None or math.isnan(value):
        return False
    med = statistics.median(hist)
    mad = statistics.median(abs(h - med) for h in hist)
    band = max(3 * 1.4826 * mad, floor * abs(med))
    return abs(value - med) > band


def _run_label(r: dict) -> str:
    return r["run"].get("lane", r["dir"].name).split(":")[0].split(" (")[0][:40] \
        + f" [{r['dir'].name}]"


GROUPS = ("ready_s", "accuracy", "burst_p50_s", "burst_p99_s", "shed", "window", "teardown_s")


def trend_points(r: dict) -> dict:
    """One run's values (r: report.load_results): {group: {series key: value}}, accuracy as
    {k, n} summed over the run's tests, the engine window as the last one recorded, every
    other value the largest of the run's clusters of that series (the slowest)."""
    points: dict[str, dict] = {g: {} for g in GROUPS}

    def put(group: str, key: str, value) -> None:
        have = points[group].get(key)
        if group == "accuracy" and have is not None:
            points[group][key] = {"k": have["k"] + value["k"], "n": have["n"] + value["n"]}
        elif have is None or group == "window":
            points[group][key] = value
        else:
            points[group][key] = max(have, value)

    topo_of = {t["cluster"]: (t.get("engine", "?"), t.get("topology", "?"))
               for t in r["tests"] if t.get("cluster")}
    for name, c in r["summary"].get("clusters", {}).items():
        eng, topo = topo_of.get(name, ("?", name))
        for role, v in ((c.get("timing") or {}).get("workers") or {}).items():
            put("ready_s", f"{eng} {topo} {role}", float(v))
        td = c.get("teardown") or {}
        if td.get("seconds") is not None:
            put("teardown_s", f"{eng} {topo}", float(td["seconds"]))
    for t in r["tests"]:
        eng, topo = t.get("engine", "?"), t.get("topology", "?")
        for ev in (t.get("evals") or {}).values():
            if ev.get("scored"):
                put("accuracy", f"{eng} {topo} {ev['eval']}",
                    {"k": int(ev["correct"]), "n": int(ev["scored"])})
        for b in (t.get("bursts") or {}).values():
            key = f"{eng} {topo} {b.get('name')}"
            lat = b.get("latency_s") or {}
            if lat:
                put("burst_p50_s", key, float(lat["p50"]))
                put("burst_p99_s", key, float(lat["p99"]))
            sc = b.get("status_counts") or {}
            put("shed", key, float(sum(v for k, v in sc.items() if not k.startswith("200"))))
            win = (b.get("effective_window") or {}).get("max_num_seqs")
            if win is not None:
                put("window", key, int(win))
    return {g: v for g, v in points.items() if v}


def series_of(labels: list[str], points: list[dict]) -> dict:
    """{"runs": labels, "series": {group: {key: [value per run or None]}}} from each run's
    trend_points, in the order given."""
    series: dict[str, dict[str, list]] = {g: {} for g in GROUPS}
    for i, p in enumerate(points):
        for group, vals in p.items():
            for key, v in vals.items():
                series[group].setdefault(key, [None] * len(points))[i] = v
    return {"runs": labels, "series": series}


def collect_trend(dirs: list[Path]) -> dict:
    """Per run folder: the series values (series_of over trend_points)."""
    runs = [report.load_results(Path(d)) for d in dirs]
    return series_of([_run_label(r) for r in runs], [trend_points(r) for r in runs])


def collect_trend_index(lines: list[dict]) -> dict:
    """The same from index lines (reports/index.py), which carry each run's trend_points."""
    return series_of([_line_label(x) for x in lines], [x.get("trend") or {} for x in lines])


def _line_label(line: dict) -> str:
    return (line.get("lane") or line["run"]).split(":")[0].split(" (")[0][:40] \
        + f" [{line['run']}]"


def mark_changes(group: str, values: list) -> list[bool]:
    marks = []
    for i, v in enumerate(values):
        prev = [x for x in values[:i] if x is not None]
        if v is None or not prev:
            marks.append(False)
        elif group == "accuracy":
            last = prev[-1]
            marks.append(proportion_changed(last["k"], last["n"], v["k"], v["n"]))
        elif group == "window":
            marks.append(v != prev[-1])
        elif group == "shed":
            marks.append(False)   # counts that the test itself asserts on; shown, not flagged
        else:
            marks.append(beyond_noise(prev, v))
    return marks


TITLES = {"ready_s": ("Ready time per role", "s"),
          "accuracy": ("Accuracy (95 % Wilson interval at its n)", "accuracy"),
          "burst_p50_s": ("Burst latency p50 (200s)", "s"),
          "burst_p99_s": ("Burst latency p99 (200s)", "s"),
          "shed": ("Requests shed (non-200) per burst", "requests"),
          "window": ("Engine window each worker resolved (max_num_seqs, per burst)", "seqs"),
          "teardown_s": ("Teardown time", "s")}


MAX_XTICKS = 16   # runs on a trend plot's x axis labelled one by one; more: thinned


def _plot(group: str, runs: list[str], rows: dict[str, list], marks: dict[str, list]) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=90)
    xs = list(range(len(runs)))
    for key, vals in rows.items():
        pts = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if not pts:
            continue
        if group == "accuracy":
            px = [x for x, _ in pts]
            py = [v["k"] / v["n"] for _, v in pts]
            lo = [p - wilson(v["k"], v["n"])[0] for p, (_, v) in zip(py, pts)]
            hi = [wilson(v["k"], v["n"])[1] - p for p, (_, v) in zip(py, pts)]
            line = ax.errorbar(px, py, yerr=[lo, hi], marker="o", capsize=3, label=key)
        else:
            line = ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", label=key)
        flagged = [(x, v) for x, v, m in zip(xs, vals, marks[key]) if m and v is not None]
        if flagged:
            fy = [(v["k"] / v["n"]) if group == "accuracy" else v for _, v in flagged]
            ax.scatter([x for x, _ in flagged], fy, s=160, facecolors="none",
                       edgecolors="red", linewidths=2, zorder=5)
        del line
    if len(xs) <= MAX_XTICKS:
        ax.set_xticks(xs)
        ax.set_xticklabels([f"#{i + 1}" for i in xs])
    else:
        # a label per run overlaps its neighbours on a many-run page, and laying each one out
        # is most of such a page's render time: at most MAX_XTICKS ticks, each its run's #
        from matplotlib.ticker import FuncFormatter, MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(nbins=MAX_XTICKS, integer=True))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"#{int(x) + 1}"))
        ax.set_xlim(-1, len(xs))      # no tick past the last run
    ax.set_ylabel(TITLES[group][1])
    ax.set_title(TITLES[group][0] + " (red ring: change beyond the noise)", fontsize=10)
    ax.grid(alpha=.3)
    if rows:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _fmt(group: str, v) -> str:
    if v is None:
        return ""
    if group == "accuracy":
        lo, hi = wilson(v["k"], v["n"])
        return f"{v['k']}/{v['n']} = {v['k'] / v['n']:.3f} [{lo:.3f}, {hi:.3f}]"
    if group in ("window", "shed"):
        return f"{v:.0f}"
    return f"{v:.2f}"


def render_trend(dirs: list[Path] | None = None, lines: list[dict] | None = None,
                 flakes_href: str | None = None) -> str:
    """The trend page from result folders (`dirs`) or from index lines (`lines`, what
    reports/index.py wrote: no folder needed); `flakes_href` links the flake view."""
    data = collect_trend_index(lines) if lines is not None else collect_trend(dirs or [])
    runs = data["runs"]
    body = ["<h1>Trend across " + ("indexed runs" if lines is not None else "result folders")
            + "</h1>"]
    if flakes_href:
        body.append(f"<p class=\"meta\">Per test: <a id=\"flakes\" href=\"{esc(flakes_href)}\">"
                    "passes, failures and the failure rate's interval (flake view)</a></p>")
    body += ["<p class=\"meta\">Runs in the order given: "
             + "; ".join(f"#{i + 1} {esc(r)}" for i, r in enumerate(runs)) + "</p>",
             ("<p class=\"meta\">Marked (red): accuracy that differs from the previous run of the "
              "same series beyond a two-proportion z-test at 95 %; an engine window that differs "
              "from the previous run; a time outside median ± max(3·1.4826·MAD, "
              f"{NOISE_FLOOR:.0%} of the median) of the earlier runs of that series.</p>")]
    for group, rows in data["series"].items():
        if not rows:
            continue
        marks = {k: mark_changes(group, v) for k, v in rows.items()}
        n_marked = sum(sum(m) for m in marks.values())
        body.append(f"<h2>{esc(TITLES[group][0])}"
                    + (f" <span class=\"mark\">({n_marked} marked)</span>" if n_marked else "")
                    + "</h2>")
        if group not in ("window",):
            body.append(f"<img class=\"plot\" alt=\"{esc(TITLES[group][0])}\" "
                        f"src=\"{_png_uri(_plot(group, runs, rows, marks))}\">")
        trows, tcls = [], []
        for key, vals in sorted(rows.items()):
            trows.append([esc(key)] + [
                ("<span class=\"mark\">▲ " if m else "") + esc(_fmt(group, v))
                + ("</span>" if m else "") for v, m in zip(vals, marks[key])])
            tcls.append("changed" if any(marks[key]) else None)
        body.append(_table(["series"] + [f"#{i + 1}" for i in range(len(runs))], trows, tcls))
    return _page("e2e trend", body)
