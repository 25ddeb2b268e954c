"""The mutation ratchet, without running mutmut: docs/mutation.json's per-file scores never
fall below the floor committed with them, scripts/mutation_scores.py refuses to write a score
under its floor (the negative control), the equivalent mutants docs/mutation.md lists are
mutants of the mutated files, and the hand-written mutation workflow passes actionlint."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutation_scores",
                                              ROOT / "scripts" / "mutation_scores.py")
ms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ms)

FILES = ms.mutated_files()


def committed() -> dict:
    return json.loads((ROOT / "docs" / "mutation.json").read_text())


def test_every_mutated_file_has_a_score_at_or_above_its_floor_with_its_sha():
    doc = committed()
    assert sorted(doc["files"]) == sorted(FILES) and len(FILES) == 5
    for f, s in doc["files"].items():
        assert re.fullmatch(r"[0-9a-f]{40}", s["sha"]), (f, s["sha"])     # not "+dirty"
        assert s["floor"] >= 85.0 and s["score"] >= s["floor"], (f, s["score"], s["floor"])
        assert s["not_checked"] == 0 and s["total"] == sum(
            s[k] for k in ("killed", "equivalent", "survived", "no_tests"))
        assert s["score"] == round(100 * (s["killed"] + s["equivalent"]) / s["total"], 1)
        assert sum(fn["total"] for fn in s["functions"].values()) == s["total"]


def test_every_listed_equivalent_is_a_mutant_of_a_mutated_file_and_counted():
    listed = ms.equivalents((ROOT / "docs" / "mutation.md").read_text())
    modules = {f.removesuffix(".py").replace("/", ".") for f in FILES}
    assert listed and all(m.rsplit(".", 1)[0] in modules for m in listed), listed
    doc = committed()
    counted = sum(s["equivalent"] for s in doc["files"].values())
    assert counted == len(listed)
    survivors = {n for s in doc["files"].values() for n in s["survivors"]}
    assert not survivors & listed


def test_a_score_below_the_floor_is_refused_and_the_floor_kept():
    old = {"files": {"a.py": {"floor": 90.0, "score": 91.0}}}
    low = ms.file_scores({"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0}, set())
    assert low["score"] == 50.0 and low["survivors"] == ["m.x_f__mutmut_2"]
    doc, problems = ms.merge(old, {"a.py": low}, "f" * 40, raise_floor=False)
    assert problems == ["a.py: score 50.0 % is below its floor 90.0 %"]
    high = ms.file_scores({"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0}, {"m.x_f__mutmut_2"})
    assert high["score"] == 100.0 and high["equivalent"] == 1 and high["survivors"] == []
    doc, problems = ms.merge(old, {"a.py": high}, "f" * 40, raise_floor=False)
    assert problems == [] and doc["files"]["a.py"]["floor"] == 90.0
    assert doc["sha"] == doc["files"]["a.py"]["sha"] == "f" * 40
    doc, _ = ms.merge(old, {"a.py": high}, "f" * 40, raise_floor=True)
    assert doc["files"]["a.py"]["floor"] == 100.0
    unfinished = ms.file_scores({"m.x_f__mutmut_1": None}, set())
    assert ms.merge({}, {"b.py": unfinished}, "f" * 40, False)[1] == [
        "b.py: 1 mutant(s) not checked: the run did not end"]


def test_scores_by_function_name_methods_too():
    s = ms.file_scores({"e.b.x_check_window__mutmut_1": 1, "e.b.x_check_window__mutmut_2": 36,
                        "e.b.xǁBurstResultǁsummary__mutmut_1": 0,
                        "e.b.xǁBurstResultǁsummary__mutmut_2": 33}, set())
    assert s["functions"] == {"BurstResult.summary": {"survived": 1, "no_tests": 1, "total": 2,
                                                      "score": 0.0},
                              "check_window": {"killed": 2, "total": 2, "score": 100.0}}


def test_mutation_script_answers_help_and_refuses_a_file_it_does_not_mutate():
    r = subprocess.run(["bash", "scripts/mutation.sh", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30, check=False)
    assert r.returncode == 0 and "scripts/mutation_scores.py" in r.stdout
    if importlib.util.find_spec("mutmut") is None:
        pytest.skip("mutmut not installed")
    r = subprocess.run(["bash", "scripts/mutation.sh", "README.md"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30, check=False,
                       env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                            "PYTHON": sys.executable})
    assert r.returncode == 2 and "README.md is not one of the mutated files" in r.stderr


def test_the_mutation_workflow_passes_actionlint():
    from test_workflow_lint import lint
    path = ROOT / ".github" / "workflows" / "mutation.yml"
    text = path.read_text()
    assert "schedule:" in text and "bash scripts/mutation.sh" in text
    r = lint(path)
    assert r.returncode == 0, r.stdout + r.stderr
