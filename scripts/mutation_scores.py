"""Per-file and per-function mutation scores from mutmut's results (mutants/**/*.meta), written
to docs/mutation.json with the git SHA they ran at (scripts/mutation.sh runs it).

    python scripts/mutation_scores.py [--raise-floor] [--check-only] [FILE ...]

A mutant counts as killed when a test failed on it (or it timed out), and so does one listed
as equivalent in docs/mutation.md (a line "- `MUTANT`: why"). Each file's score is killed over
all its mutants. docs/mutation.json keeps a "floor" per file: a score below it is refused
(exit 1, nothing written); --raise-floor sets each floor written to the new score. FILEs: only
those files' entries are replaced (default: every file of [tool.mutmut] only_mutate).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "mutation.json"
DOC = ROOT / "docs" / "mutation.md"
# mutmut 3.8.1's exit codes (mutmut/stats.py status_by_exit_code): 1 and 3 killed, 0
# survived, 33/5 no tests, 36 and the SIGXCPU codes timeout.
KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
EQUIVALENT_LINE = re.compile(r"^- `([\w.ǁ]+__mutmut_\d+)`")


def mutated_files() -> list[str]:
    try:
        from tomllib import loads
    except ModuleNotFoundError:           # Python 3.10: mutmut brings `toml` there
        from toml import loads
    return loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]


def equivalents(text: str) -> set[str]:
    """The mutant names docs/mutation.md lists as equivalent."""
    return {m.group(1) for line in text.splitlines() if (m := EQUIVALENT_LINE.match(line))}


def function_of(mutant: str) -> str:
    """e2e_test.x.bursts.x_check_window__mutmut_3 -> check_window;
    ...xǁBurstResultǁsummary__mutmut_1 -> BurstResult.summary."""
    last = mutant.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
    if last.startswith("xǁ"):
        return ".".join(p for p in last[2:].split("ǁ") if p)
    return last.removeprefix("x_")


def file_scores(exit_codes: dict[str, int | None], equivalent: set[str]) -> dict:
    """Scores of one file from {mutant: exit code}. Pure."""
    by_fn: dict[str, Counter] = {}
    total = Counter()
    for name, code in exit_codes.items():
        kind = ("equivalent" if name in equivalent and code in SURVIVED else
                "killed" if code in KILLED or code in TIMEOUT else
                "survived" if code in SURVIVED else
                "not_checked" if code is None else "no_tests")
        for c in (by_fn.setdefault(function_of(name), Counter()), total):
            c[kind] += 1
            c["total"] += 1

    def score(c: Counter) -> float:
        return round(100.0 * (c["killed"] + c["equivalent"]) / c["total"], 1) if c["total"] else 0.0
    keys = ("killed", "equivalent", "survived", "no_tests", "not_checked", "total")
    return {**{k: total[k] for k in keys}, "score": score(total),
            "survivors": sorted(n for n, c in exit_codes.items()
                                if c in SURVIVED and n not in equivalent),
            "functions": {fn: {**{k: c[k] for k in keys if c[k]}, "score": score(c)}
                          for fn, c in sorted(by_fn.items())}}


def merge(old: dict, new_files: dict, sha: str, raise_floor: bool) -> tuple[dict, list[str]]:
    """docs/mutation.json with `new_files` replacing their entries; the floor kept (or raised
    to the new score). Returns (document, problems): a score under its floor is a problem. Pure."""
    files = dict(old.get("files", {}))
    problems = []
    for f, s in new_files.items():
        floor = files.get(f, {}).get("floor", 0.0)
        if s["not_checked"]:
            problems.append(f"{f}: {s['not_checked']} mutant(s) not checked: the run did not end")
        if s["score"] < floor:
            problems.append(f"{f}: score {s['score']} % is below its floor {floor} %")
        files[f] = {**s, "sha": sha, "floor": s["score"] if raise_floor else floor}
    return {"mutmut": "3.8.1", "sha": sha, "files": dict(sorted(files.items()))}, problems


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--raise-floor", action="store_true")
    ap.add_argument("--check-only", action="store_true", help="print, write nothing")
    a = ap.parse_args(argv)
    files = a.files or mutated_files()
    equivalent = equivalents(DOC.read_text()) if DOC.is_file() else set()
    new = {}
    for f in files:
        meta = ROOT / "mutants" / (f + ".meta")
        if not meta.is_file():
            print(f"mutation_scores: no mutmut results for {f} ({meta} missing): run "
                  "scripts/mutation.sh first", file=sys.stderr)
            return 2
        new[f] = file_scores(json.loads(meta.read_text())["exit_code_by_key"], equivalent)
    # The commit the run started at (scripts/mutation.sh writes it before mutmut copies the
    # tree), else HEAD.
    started = ROOT / "mutants" / "SHA"
    sha = (started.read_text().strip() if started.is_file() else
           subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip())
    old = json.loads(OUT.read_text()) if OUT.is_file() else {}
    doc, problems = merge(old, new, sha, a.raise_floor)
    for f, s in new.items():
        print(f"{f}: {s['score']} % ({s['killed']} killed + {s['equivalent']} equivalent of "
              f"{s['total']}; {s['survived']} survived)")
    if problems:
        print("mutation_scores: " + "; ".join(problems) + ": docs/mutation.json not written",
              file=sys.stderr)
        return 1
    if not a.check_only:
        OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
