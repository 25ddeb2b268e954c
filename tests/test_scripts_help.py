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


def _stand_in_venv(tmp_path, lane_rc=0, wait_for=None):
    """A venv whose install stamp is current (bootstrap installs nothing) and whose python
    records its arguments and exits with `lane_rc`, as the lane once `wait_for` has 2 lines
    (up to 30 s); returns (venv, its log)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    py = venv / "bin" / "python"
    wait = (f'for i in $(seq 300); do [ "$(wc -l < {wait_for} 2>/dev/null || echo 0)" -ge 2 ] '
            f'&& break; sleep 0.1; done; ' if wait_for else "")
    py.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *"e2e_test run"*) '
                  f'{wait}exit {lane_rc};; esac\n')
    py.chmod(0o755)
    stamp = subprocess.run("cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16",
                           shell=True, cwd=REPO, capture_output=True, text=True, check=True)
    (venv / ".e2e-bootstrap-cpu").write_text(stamp.stdout)
    return venv, log


def _gone(pid: int, timeout: float = 10.0) -> bool:
    import time

    import psutil
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("lane_rc", [0, 3])
def test_test_sh_hog_runs_the_e2e_part_beside_a_pinned_loop_that_ends_with_it(tmp_path,
                                                                                lane_rc):
    """`--hog`: the lane's e2e part (`--part e2e`), a process pinned to one CPU beside it
    (PYTHON runs it: here a stand-in that sleeps, so no CPU is burnt), gone when the script
    ends, whether the lane passed or failed (its exit code is the script's)."""
    hog_log = tmp_path / "hog.log"
    venv, log = _stand_in_venv(tmp_path, lane_rc, wait_for=hog_log)
    hog = tmp_path / "hog"
    hog.write_text(f'#!/bin/sh\necho "pid $$ deadline $3" >> {hog_log}\n'
                   f'taskset -pc $$ >> {hog_log}\nexec sleep 120\n')
    hog.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "AFD_"))}
    env.update(E2E_VENV=str(venv), PYTHON=str(hog))
    r = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), "--hog", "-x"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == lane_rc, r.stdout + r.stderr
    assert "-m e2e_test run e2e-cpu --part e2e -x" in log.read_text()
    first, affinity = hog_log.read_text().splitlines()[:2]
    pid = int(first.split()[1])
    from e2e_test import lanes
    assert first.endswith(f" {lanes.get_lane('e2e-cpu').timeout_minutes * 60}"), first
    assert f"test.sh: --hog: pid {pid} busy on CPU" in r.stdout
    assert affinity.endswith(": " + str(min(os.sched_getaffinity(0)))), affinity
    assert _gone(pid), f"the hog (pid {pid}) outlived test.sh"


def test_test_sh_hog_refuses_a_part_before_anything_starts(tmp_path):
    """The negative control: `--hog --part unit` is one line, exit 2, no bootstrap, no hog."""
    venv, log = _stand_in_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "AFD_"))}
    env.update(E2E_VENV=str(venv), PYTHON="/nonexistent/python")
    r = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), "--hog", "--part", "unit"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and r.stderr.strip() == (
        "test.sh: --hog runs the e2e part (--part e2e); leave out --part unit"), r.stderr
    assert not log.exists()
