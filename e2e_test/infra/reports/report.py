"""Validation report: markdown generated from result folders, never retyped.

Each folder is what a run left in E2E_RESULTS_DIR (tests/*.json, summary.json) plus an
optional `run.json` written next to it by whoever ran it ({"lane", "device", "date", "note"}).
`python -m e2e_test report DIR [DIR ...] [--out FILE]` (markdown; docs/validation.md is
validation_page.py's, from the index)
"""

from __future__ import annotations

import json
from pathlib import Path

from ..engines import PROOF_KEYS as ENGINE_PROOF_KEYS
from ..engines import all_engines
from ..verdicts.oracle import verdict_line as oracle_line
from . import time_report

RESULT_FILES = ("run.json", "summary.json", "note.json")


def has_results(d: Path) -> bool:
    """The folder holds what a run (or its publisher) left: run.json, summary.json, note.json
    or tests/*.json."""
    d = Path(d)
    return (any((d / f).is_file() for f in RESULT_FILES)
            or ((d / "tests").is_dir() and any((d / "tests").glob("*.json"))))


def load_results(d: Path) -> dict:
    run = json.loads((d / "run.json").read_text()) if (d / "run.json").is_file() else {}
    # note.json: what the publisher adds beside a lane's own files (the machine in words, what
    # to know); it never overrides what the lane recorded, only fills what it lacks.
    if (d / "note.json").is_file():
        note = json.loads((d / "note.json").read_text())
        run = {**note, **{k: v for k, v in run.items() if v not in (None, "", "cpu")},
               "note": note.get("note", run.get("note"))}
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
    tests = [json.loads(p.read_text()) for p in sorted((d / "tests").glob("*.json"))] \
        if (d / "tests").is_dir() else []
    return {"dir": d, "run": run, "summary": summary, "tests": tests}


def _fmt_ready(t: dict) -> str:
    r = t.get("ready_s") or {}
    return ", ".join(f"{k} {v:.0f}s" for k, v in sorted(r.items()))


def details(t: dict) -> str:
    out = []
    for ev in (t.get("evals") or {}).values():
        out.append(f"{ev['eval']} {ev['correct']}/{ev['scored']} = {ev['accuracy']:.3f} "
                   f"(errors {ev['errors']})")
    for b in (t.get("bursts") or {}).values():
        lat = b.get("latency_s") or {}
        ref = b.get("refusal_latency_s") or {}
        s = f"{b.get('name')}: {b.get('status_counts')}"
        if lat:
            s += f", 200 p50 {lat.get('p50', 0):.2f}s p99 {lat.get('p99', 0):.2f}s"
        if ref:
            s += f", refusals p99 {ref.get('p99', 0) * 1000:.0f} ms"
        win = (b.get("effective_window") or {}).get("max_num_seqs")
        if win:
            s += f", engine window {win}"
        if b.get("rejected_metric_delta") is not None:
            s += f", smg rejected {b['rejected_metric_delta']:.0f}"
        out.append(s)
    for key in PROOF_KEYS:
        if t.get(key):
            line = proof_line(key, t[key])
            if line:
                out.append(line)
    for e in all_engines():                 # the keys an engine's own suite writes
        out.extend(e.record_lines(t))
    for name, v in (t.get("pd_vs_regular") or {}).items():
        if "message" in v:
            out.append(oracle_line(v))
            continue
        tol = f" (tolerance {v['tolerance']:.0%})" if "tolerance" in v else ""
        out.append(f"{name} vs `1`: {v['same_prediction']}/{v['items']} same answers{tol}")
    for name, c in (t.get("oracle_control") or {}).items():
        out.append("control arm " + "; ".join(
            f"{x['b']}: {x['counts']['identical']} identical, {x['counts']['numerics']} numerics, "
            f"{x['counts']['mismatch']} mismatch" for x in c["comparisons"]))
    if t.get("oracle_negative_control"):
        out.append("negative control: " + oracle_line(t["oracle_negative_control"]))
    for name, vs in (t.get("oracle_dp") or {}).items():
        out.extend(oracle_line(v) for v in vs)
    if t.get("error"):
        out.append(f"error: {t['error']}")
    if t.get("chat"):
        out.append(f"chat {t['chat']['usage']['completion_tokens']} tokens")
    return "; ".join(out)


PROOF_KEYS = tuple(ENGINE_PROOF_KEYS.values())     # pd_proof, epd_proof, the FFN's


def proof_line(key: str, proof: dict) -> str | None:
    """A recorded disaggregation proof in one line, worded by the engine whose proof it is
    (Engine.proof_line); None when no engine knows it."""
    for e in all_engines():
        line = e.proof_line(key, proof)
        if line:
            return line
    return None


def _time_lines(d: Path) -> list[str]:
    """The run's time report (timing.json, time_report.py): its headline and, where the run
    recorded them, its boot phases and its warm children's imports and calls."""
    f = d / "timing.json"
    if not f.is_file():
        return []
    rep = json.loads(f.read_text())
    out = [f"- time: {rep.get('headline') or time_report.headline(rep)}"]
    for line in (time_report.phases_line(rep), time_report.warm_line(rep)):
        if line:
            out.append(f"- {line}")
    return out


def render(dirs: list[Path]) -> str:
    lines = ["# Validation results", "",
             "Generated by `python -m e2e_test report` from the result files of the runs below;",
             "nothing here is typed by hand.", ""]
    for d in dirs:
        r = load_results(Path(d))
        run, s = r["run"], r["summary"]
        vers = s.get("versions", {})
        lines += [f"## {run.get('lane', Path(d).name)} — {run.get('device', '?')}", "",
                  f"- date: {run.get('date', s.get('finished', '?'))}",
                  "- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(vers.items())),
                  f"- tests: {sum(t.get('outcome') == 'passed' for t in r['tests'])} passed, "
                  f"{sum(t.get('outcome') == 'failed' for t in r['tests'])} failed, "
                  f"{sum(t.get('outcome') == 'skipped' for t in r['tests'])} skipped, "
                  f"{sum(t.get('outcome') == 'error' for t in r['tests'])} errored at setup "
                  f"(session wall {s.get('wall_s', '?')} s)"]
        if run.get("note"):
            lines.append(f"- note: {run['note']}")
        if run.get("extra"):
            lines.append(f"- {run['extra']}")
        lines += _time_lines(Path(d))
        for name in ("gpu-before.txt", "gpu-after.txt"):
            f = Path(d) / name
            if f.is_file():
                rows = [ln.strip() for ln in f.read_text().splitlines()[1:] if ln.strip()]
                lines.append(f"- nvidia-smi {name[4:-4]} the session (index, MiB used): "
                             + "; ".join(rows))
        lines.append("")
        clusters = s.get("clusters", {})
        if clusters:
            lines += ["| topology run | ready (slowest worker / all) | gateway | teardown |",
                      "|---|---|---|---|"]
            for name, c in clusters.items():
                tm = c.get("timing", {})
                w = tm.get("workers") or {}
                tdd = c.get("teardown") or {}
                td = tdd.get("verdict", "")
                if tdd.get("gpu_checked") and not tdd.get("gpu_leaks"):
                    td += "; GPU memory back to baseline (NVML)"
                lines.append(f"| {name} | {max(w.values()) if w else 0:.1f} s / "
                             f"{tm.get('topology_ready_s') or 0:.1f} s | "
                             f"{gateway_cell(tm)} | {td} |")
            lines.append("")
        lines += ["| test | outcome | topology | plan | ready per role | results |",
                  "|---|---|---|---|---|---|"]
        for t in r["tests"]:
            plan = t.get("plan") or {}
            where = "; ".join(
                f"{e['name']}: gpu {','.join(map(str, e['gpus']))}" if e.get("gpus")
                else f"{e['name']}: cores {','.join(map(str, e.get('cores', [])))}"
                for e in plan.get("entries", []))
            lines.append(f"| {t['test'].split('::')[-1]} | {t.get('outcome', '')} | "
                         f"{t.get('topology', '')} | {where} | {_fmt_ready(t)} | {details(t)} |")
        lines.append("")
    return "\n".join(lines)


def gateway_cell(timing: dict) -> str:
    """A topology's gateway readiness, with the probes that failed on the way (a record from
    before they were kept has none): `7.2 s (1 failed probe: HTTP 504 after 3.0 s)`."""
    cell = f"{timing.get('gateway_ready_s') or 0:.1f} s"
    failed = timing.get("gateway_probe_failures") or []
    if failed:
        what = "; ".join(f"{_probe_error(f.get('error', ''))} after {f.get('after_s', 0):.1f} s"
                         for f in failed[:3])
        more = f"; {len(failed) - 3} more" if len(failed) > 3 else ""
        cell += f" ({len(failed)} failed probe{'s' if len(failed) > 1 else ''}: {what}{more})"
    return cell


def _probe_error(error: str) -> str:
    """The short form of a failed probe's reason: `HTTP 504`, `ReadTimeout(...)`."""
    short = error.removeprefix("probe chat completion ").split(":", 1)[0]
    return short.replace("|", "/")[:60]
