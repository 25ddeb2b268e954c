"""Re-judge the recorded comparison-oracle runs under the current rule (oracle.judge: bounds
from the control arm, the first-step rank test), from their result records alone.

    python scripts/rejudge_oracle.py [--items N] [INDEX.jsonl | RUN_DIR ...]
                                                  # default: the committed index

A run is read from its index line (docs/validation/index.jsonl: its records' oracle inputs,
items compacted, from oracle_records.jsonl.xz beside the index, reports/index.py) or from its
folder's tests/*.json. It can be re-judged where its records hold the control arm's items
(test_control_arm's `oracle_control` with per-item first-step deltas and gaps) and the
comparison's items. What a run lacks is said, per
comparison, instead of a verdict. Prints one JSON line per comparison;
tests/test_rejudge_records.py asserts healthy runs pass and negative controls fail.

`--items N`: each comparison, its control arm and its path arm cut to the items a pass of N
items asks (`asked_items`), as though the run had asked N: what a smaller item count would
have judged on the same answers (docs/accuracy.md, "Items per pass").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from e2e_test.infra.reports import index
from e2e_test.infra.verdicts import oracle

VALIDATION = ROOT / "docs" / "validation"
INDEX = VALIDATION / "index.jsonl"


def lines(path: Path = INDEX) -> dict[str, dict]:
    """run name -> index line."""
    return {x["run"]: x for x in index.read(path)}


def _name(run: Path | dict) -> str:
    return run["run"] if isinstance(run, dict) else run.name


def read_records(run: Path | dict) -> list[dict]:
    """The records of a run: an index line's oracle inputs, or a folder's tests/*.json."""
    if isinstance(run, dict):
        return [index.expand_record(r) for r in run.get("oracle_records") or []]
    out = []
    for f in sorted((run / "tests").glob("*.json")) if (run / "tests").is_dir() else []:
        try:
            out.append(json.loads(f.read_text()))
        except ValueError:
            continue
    return out


def controls(records: list[dict]) -> dict[tuple[str, str], oracle.ControlArm]:
    """(engine, eval) -> the control arm, where a record holds its items."""
    out = {}
    for r in records:
        for name, arm in (r.get("oracle_control") or {}).items():
            if isinstance(arm, dict) and arm.get("items"):
                out[(r.get("engine"), name)] = oracle.ControlArm.from_record(arm)
        rec = (r.get("kv_recall") or {}).get("control")
        if "test_kv_recall_baseline" in r.get("test", "") and isinstance(rec, dict) \
                and rec.get("items"):
            out[(r.get("engine"), "recall")] = oracle.ControlArm.from_record(rec)
    return out


def paths(records: list[dict]) -> dict[tuple[str, str], oracle.PathArm]:
    """(engine, eval) -> the path arm of `1` (Engine.first_step_path_arm), where recorded."""
    out = {}
    for r in records:
        for name, arm in (r.get("oracle_path_arm") or {}).items():
            out[(r.get("engine"), name)] = oracle.PathArm.from_dict(arm)
        arm = (r.get("kv_recall") or {}).get("path_arm")
        if "test_kv_recall_baseline" in r.get("test", "") and isinstance(arm, dict):
            out[(r.get("engine"), "recall")] = oracle.PathArm.from_dict(arm)
    return out


def comparisons(records: list[dict]) -> list[tuple[str, str, str, dict, bool]]:
    """(what, expect, eval, comparison record, same path) for every comparison in the records:
    expect "pass" for a topology held against `1`, "fail" for the negative control, "shift"
    for a perturbed copy of the model (test_perturbed.py: failed by the same-path rank test).
    Same path: both sides compute every step as the control arm does (DP workers, the
    perturbed copy), so the rank test against the control arm decides (oracle.judge)."""
    out = []
    for r in records:
        test = r.get("test", "")
        for name, v in (r.get("pd_vs_regular") or {}).items():
            out.append((test, "pass", name, v.get("comparison"), False))
        neg = r.get("oracle_negative_control")
        if neg:
            out.append((test, "fail", "gsm8k", neg.get("comparison"), False))
        rec = r.get("kv_recall") or {}
        if "test_pd_kv_recall" in test and rec.get("oracle"):
            out.append((test, "pass", "recall", rec["oracle"].get("comparison"), False))
        for name, vs in (r.get("oracle_dp") or {}).items():
            for v in vs:
                out.append((test, "pass", name, v.get("comparison"), True))
        pert = r.get("oracle_perturbed")
        if pert:
            out.append((test, "shift" if pert["eps"] else "pass", "gsm8k",
                        pert["verdict"].get("comparison"), True))
    return out


def asked_items(name: str, of: int, n: int) -> set[int] | None:
    """The indices, in a pass recorded with `of` items, of the items a pass of `n` asks:
    GSM8K and the recall prompts the first n (the first rows, the first prompts); MMLU
    spreads its sample evenly over the test file (evals/mmlu.py `sample`), so n of `of` are
    every (of / n)-th where n divides `of`. None where `of` has fewer, or MMLU's do not
    divide. Pure."""
    if n > of:
        return None
    if name != "mmlu":
        return set(range(n))
    return set(range(0, of, of // n)) if of % n == 0 else None


def cut(c: oracle.Comparison, keep: set[int]) -> oracle.Comparison:
    return oracle.Comparison(c.name, c.a, c.b, [it for it in c.items if it.index in keep])


def _not_rejudged(run: Path | dict) -> str | None:
    """A run whose note.json (or index line) says `rejudge: "no: why"` (its items were judged
    on evidence the harness has since learnt to read differently)."""
    if isinstance(run, dict):
        why = run.get("rejudge")
    else:
        try:
            why = json.loads((run / "note.json").read_text()).get("rejudge")
        except (OSError, ValueError):
            return None
    return why if isinstance(why, str) and why.startswith("no") else None


def rejudge(run: Path | dict, items: int | None = None) -> list[dict]:
    """Every comparison of `run` judged again; `items`: on the items a pass of that many
    asks (asked_items), where the record holds them."""
    records = read_records(run)
    skip = _not_rejudged(run)
    arms, path_arms = controls(records), paths(records)
    engine = next((r.get("engine") for r in records if r.get("engine")), None)
    results = []
    for test, expect, name, cmp, same_path in comparisons(records):
        res = {"run": _name(run), "test": test, "eval": name, "expect": expect}
        if skip:
            res["rejudged"] = False
            res["why"] = f"note.json: {skip}"
        elif not cmp or "items" not in cmp:
            res["rejudged"] = False
            res["why"] = "the record holds no per-item comparison (written before the oracle)"
        elif (engine, name) not in arms:
            res["rejudged"] = False
            res["why"] = (f"no {name} control arm with per-item first-step deltas in this "
                          "run's records")
        elif items and asked_items(name, len(cmp["items"]), items) is None:
            res["rejudged"] = False
            res["why"] = f"{len(cmp['items'])} {name} items hold no pass of {items}"
        else:
            # a disaggregated topology's first steps are held to `1`'s path arm, where one
            # was recorded (test_pd.py)
            path = path_arms.get((engine, name)) if "test_pd_" in test else None
            comparison, arm = oracle.Comparison.from_dict(cmp), arms[(engine, name)]
            if items:
                keep = asked_items(name, len(cmp["items"]), items)
                comparison = cut(comparison, keep)
                arm = oracle.ControlArm([cut(c, keep) for c in arm.comparisons])
                if path is not None:
                    path = oracle.PathArm([cut(c, keep) for c in path.comparisons], path.how,
                                          path.decides, path.why)
                res["items"] = len(comparison.items)
            v = oracle.judge(comparison, arm, path=path, same_path=same_path)
            same = v.same_path_rank_test
            res.update(rejudged=True, ok=v.ok, message=v.message,
                       path_p=v.path_rank_test and v.path_rank_test["p"],
                       first_step_max=round(v.thresholds.first_step_max, 4),
                       gap_max=round(v.thresholds.gap_max, 4),
                       rank_p=v.rank_test and v.rank_test["p"],
                       same_path_p=same and same["p"],
                       max_first_step_delta=comparison.summary()["max_first_step_delta"],
                       as_expected=(v.ok if expect == "pass" else
                                    not v.ok and bool(same) and same["p"] < oracle.ALPHA
                                    if expect == "shift" else
                                    not oracle.negative_control_problems(v)))
        results.append(res)
    return results


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python scripts/rejudge_oracle.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=None, metavar="N",
                    help="judge each comparison on the items a pass of N asks")
    ap.add_argument("runs", nargs="*",
                    help="index files or result folders (default: the committed index, "
                         f"{INDEX.relative_to(INDEX.parents[2])})")
    args = ap.parse_args(argv)
    if args.items is not None and args.items < 1:
        print(f"rejudge_oracle: error: --items {args.items}: must be at least 1",
              file=sys.stderr)
        return 2
    runs: list[Path | dict] = []
    for a in args.runs or [str(INDEX)]:
        p = Path(a)
        if p.is_file():
            runs += index.read(p)
        elif p.is_dir():
            runs.append(p)
        else:
            print(f"rejudge_oracle: error: {a}: neither an index file nor a run folder",
                  file=sys.stderr)
            return 2
    bad = 0
    for run in runs:
        for res in rejudge(run, args.items):
            print(json.dumps(res))
            bad += int(res.get("rejudged", False) and not res["as_expected"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
