"""The README's commands work: every command in its fenced ```bash blocks is classified here
by hand (not guessed). One that starts no engine is run as written (a pytest collection with
--collect-only), asserting exit 0; one that boots engines is checked for existence only: its
script or subcommand answers --help. A command in the README that this table does not know
fails the test, so a new one gets classified. The Python example is compiled and the names it
uses exist."""

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_test.infra.cluster.cluster import Cluster
from e2e_test.infra.lifecycle.teardown import TeardownReport

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

RUN = "run"                  # starts no engine: run it, exit 0
COLLECT = "collect"          # pytest: run with --collect-only added, exit 0
EXISTS = "exists"            # boots engines or installs: only `--help` of it, exit 0
# (the `python -m e2e_test run LANE -- ARGS` form: `run --help`)

KIND = {
    "bash scripts/main.sh": EXISTS,
    "bash scripts/test.sh": EXISTS,
    "bash scripts/test.sh --full": EXISTS,
    "bash scripts/test.sh --hog": EXISTS,
    "pip install -e '.[dev]'": EXISTS,
    "python -m pytest tests -n auto": COLLECT,
    "python -m e2e_test --help": RUN,
    "python -m e2e_test plan 1p1d --backend cpu": RUN,
    "python -m e2e_test models list": RUN,
    "python -m e2e_test datasets check": RUN,
    "python -m e2e_test settings": RUN,
    "python -m e2e_test lanes": RUN,
    "python -m e2e_test report docs/validation/h100-e2e-1gpu-pd-vllm-vpd-ee38fb5": RUN,
    "pytest -m tokenspeed --collect-only": COLLECT,
    'pytest e2e_test/router -m "pd and vllm" --topology 1,1p1d --backend cpu': COLLECT,
    "pytest e2e_test/router -n auto --dist loadgroup": COLLECT,
    'pytest "e2e_test/router/test_pd.py::test_pd_answers_match_regular[vllm-1p1d-gsm8k]"':
        COLLECT,
    "python -m e2e_test run e2e-cpu -- -x": EXISTS,
}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)


def commands() -> list[str]:
    out = []
    for b in blocks("bash"):
        for line in b.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_readme_is_short_and_every_command_is_classified():
    assert len(README.read_text().splitlines()) <= 200
    cmds = commands()
    assert cmds, "no ```bash block in README.md"
    assert set(cmds) == set(KIND), (
        f"classify these in KIND: {sorted(set(cmds) - set(KIND))}; "
        f"no longer in README.md: {sorted(set(KIND) - set(cmds))}")


def _argv(cmd: str) -> list[str]:
    words = shlex.split(cmd)
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] in ("pytest", "pip"):
        words[:1] = [sys.executable, "-m", words[0]]
    return words


@pytest.fixture
def env(tmp_path):
    """A clean environment with small GSM8K/MMLU files (datasets check reads them)."""
    data = tmp_path / "data"
    for name, splits in (("gsm8k", ("train", "test")), ("mmlu", ("dev", "test"))):
        (data / name).mkdir(parents=True)
        row = ('{"question": "1+1?", "answer": "#### 2"}' if name == "gsm8k" else
               '{"subject": "s", "question": "q", "choices": ["a", "b", "c", "d"], '
               '"answer": "A"}')
        for s in splits:
            (data / name / f"{s}.jsonl").write_text(row + "\n")
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("E2E_", "AFD_", "PYTEST_")) and k != "PYTEST_ADDOPTS"}
    e.update(E2E_RESULTS_DIR=str(tmp_path / "results"), E2E_DATASET_DIR=str(data),
             E2E_CACHE_DIR=str(tmp_path / "cache"))
    return e


@pytest.mark.parametrize("cmd", sorted(KIND))
def test_readme_command(cmd, env):
    kind = KIND[cmd]
    argv = _argv(cmd)
    if kind == COLLECT:
        argv += ["--collect-only", "-q", "-p", "no:cacheprovider"]
        argv = [a for a in argv if a not in ("-n", "auto")]       # collection needs no workers
    elif kind == EXISTS:
        if argv[:3] == [sys.executable, "-m", "e2e_test"]:
            argv = argv[:4] + ["--help"]                  # the subcommand answers --help
        elif argv[0] == "bash":
            argv = argv[:2] + ["--help"]
        else:
            argv = argv[:4] + ["--help"]                  # pip install --help
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, f"{cmd} ({kind}): {argv}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    if kind == EXISTS:
        assert "usage:" in r.stdout.lower() or "Usage:" in r.stdout, r.stdout[:300]


def test_readme_python_example_uses_real_names():
    (code,) = blocks("python")
    tree = ast.parse(code)
    compile(tree, "README.md", "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = __import__(node.module, fromlist=[a.name for a in node.names])
            for a in node.names:
                assert hasattr(mod, a.name), f"{node.module}.{a.name}"
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "c"}
    assert used == {"chat", "gateway_url", "model_name", "teardown_report"}, used
    for name in used - {"teardown_report"}:
        assert hasattr(Cluster, name), name
    assert callable(TeardownReport.verdict)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "Cluster")
    import inspect
    params = inspect.signature(Cluster).parameters
    assert {k.arg for k in call.keywords} <= set(params)
