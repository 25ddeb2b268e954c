"""The import contracts of pyproject.toml [tool.importlinter] hold: e2e_test.infra is layered
(no import back up to a higher layer, so no circle between layers), engines/__init__.py imports
no part of the harness but errors.py, no module outside engines/ imports an engine module, and
no circle runs inside a sub-package. The negative controls run the same contracts on a copy of
the package with one import added, inside a function (import-linter reads those too): each
breaks its contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint(where: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the e2e_test package under `where`, with `where`'s pyproject.toml."""
    assert LINT_IMPORTS.exists(), "import-linter is not installed (pip install -e '.[dev]')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(where)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_import_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


CONTRACTS = ("infra layers", "engine interface", "only engines know engines",
             "no circle inside a sub-package")
# (file, the import added inside a new function, the contracts it breaks)
BROKEN = {
    "circle": ("infra/engines/__init__.py", "from ..lifecycle.reaper import extend_pythonpath",
               {"engine interface", "infra layers"}),   # engines -> reaper -> settings -> engines
    "back up": ("infra/specs/settings.py", "from ..cluster import cluster", {"infra layers"}),
    "an engine": ("infra/reports/report.py", "from ..engines import vllm",
                  {"only engines know engines"}),
    "circle inside": ("infra/specs/topology.py", "from . import settings",
                      {"no circle inside a sub-package"}),    # settings imports topology
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_contract_breaks_on_an_import_against_it(tmp_path, case):
    path, line, broken = BROKEN[case]
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "e2e_test", tmp_path / "e2e_test",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "e2e_test" / path, "a") as f:
        f.write(f"\n\ndef _against_the_contract():\n    {line}\n")
    r = lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    for name in CONTRACTS:
        assert f"{name} {'BROKEN' if name in broken else 'KEPT'}" in r.stdout, r.stdout
