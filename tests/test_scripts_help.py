"""Every script under scripts/ answers --help (and -h for the shell ones): exit 0, a `usage:`
line first, and nothing started. The shell scripts run with python3, pip, nvidia-smi and
friends on PATH replaced by stand-ins that record being called, and a venv path that must not
appear."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (REPO / "scripts").iterdir()
                 if p.suffix in (".py", ".sh") and p.is_file())


def test_every_script_is_listed():
    assert {"main.sh", "test.sh", "bootstrap.sh", "rejudge_oracle.py"} <= set(SCRIPTS)


@pytest.fixture
def guarded_env(tmp_path):
    shims = tmp_path / "shims"
    shims.mkdir()
    called = tmp_path / "called"
    for tool in ("python", "python3", "pip", "pip3", "nvidia-smi", "pytest", "vllm", "smg",
                 "apt-get", "timeout"):
        f = shims / tool
        f.write_text(f"#!/bin/sh\necho {tool} >> {called}\nexit 1\n")
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "AFD_"))}
    env.update(PATH=f"{shims}:{env['PATH']}", E2E_VENV=str(tmp_path / "venv"),
               PYTHON=str(shims / "python3"), OUT=str(tmp_path / "out"),
               E2E_RESULTS_DIR=str(tmp_path / "results"))
    return env, called, tmp_path


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_answers_help_and_starts_nothing(script, guarded_env):
    env, called, tmp = guarded_env
    path = REPO / "scripts" / script
    flags = ["--help", "-h"] if script.endswith(".sh") else ["--help"]
    for flag in flags:
        argv = (["bash", str(path)] if script.endswith(".sh") else [sys.executable, str(path)])
        r = subprocess.run(argv + [flag], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120, check=False)
        assert r.returncode == 0, (flag, r.stdout, r.stderr)
        assert r.stdout.lower().startswith("usage:"), (flag, r.stdout[:200])
        assert not called.exists(), f"{script} {flag} ran {called.read_text()}"
        assert not (tmp / "venv").exists() and not (tmp / "out").exists()


@pytest.mark.parametrize("script,args,wants", [
    ("main.sh", ["--topology", "1"], ["-m e2e_test models prepare",
                                      "-m e2e_test main --topology 1"]),
    ("test.sh", ["-x"], ["-m e2e_test models prepare", "-m e2e_test run e2e-cpu -x"]),
    ("test.sh", ["--full", "-x"], ["-m e2e_test models prepare",
                                   "-m e2e_test run e2e-cpu-full -x"]),
])
def test_main_and_test_scripts_run_in_E2E_VENV(tmp_path, script, args, wants):
    """E2E_VENV names the venv that bootstrap sets up and the script then runs in: a stand-in
    venv (its install stamp current, so bootstrap installs nothing) whose python records its
    arguments."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho "$*" >> {log}\necho "LANE_PYTHON=$E2E_LANE_PYTHON" >> {log}\n')
    py.chmod(0o755)
    stamp = subprocess.run(f"cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16",
                           shell=True, cwd=REPO, capture_output=True, text=True, check=True)
    (venv / ".e2e-bootstrap-cpu").write_text(stamp.stdout)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "AFD_"))}
    env["E2E_VENV"] = str(venv)
    r = subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = log.read_text()
    assert all(w in ran for w in wants), ran
    if script == "test.sh":
        assert f"LANE_PYTHON={py}" in ran, ran
