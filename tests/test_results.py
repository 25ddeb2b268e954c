"""Result files: the markdown table and the session files, from plain record dicts."""

import json
import os
from pathlib import Path

import pytest

from e2e_test.infra.lifecycle.teardown import TeardownReport
from e2e_test.infra.reports import results
from e2e_test.infra.verdicts.evals import EvalResult

GSM8K = EvalResult("gsm8k", n=32, correct=12, errors=2).summary()   # accuracy 12/30


def rec(**kw) -> dict:
    r = {"test": "e2e_test/router/test_evals.py::test_gsm8k[vllm-1p1d]", "outcome": "passed",
         "engine": "vllm", "topology": "1p1d", "cluster": "vllm-1p1d",
         "ready_s": {"prefill-0": 12.34, "decode-0": 14.56},
         "evals": {"gsm8k": GSM8K},
         "teardown": {"verdict": "clean in 1.0 s"}}
    r.update(kw)
    return r


@pytest.fixture(autouse=True)
def _no_step_summary(monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


def test_table():
    bursts = {"b1": {"name": "over-window", "status_counts": {"200": 8, "429 "
                                                            "admission_queue_full": 4}}}
    t = results.table([rec(bursts=bursts),
                       {"test": "tests/x.py::test_bare", "outcome": "failed"}])
    lines = t.splitlines()
    assert lines[0] == ("| test | outcome | engine | topology | ready s (max role) | results | "
                        "teardown |")
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2] == ("| test_gsm8k[vllm-1p1d] | passed | vllm | 1p1d | 14.6 | "
                        "gsm8k 0.400 (n=30, err=2); burst over-window: "
                        "{'200': 8, '429 admission_queue_full': 4} | clean in 1.0 s |")
    assert lines[3] == "| test_bare | failed |  |  |  |  |  |"
    assert len(lines) == 4


def test_table_without_records():
    assert results.table([]).splitlines() == [
        "| test | outcome | engine | topology | ready s (max role) | results | teardown |",
        "|---|---|---|---|---|---|---|"]


def test_write_session(tmp_path):
    records = [rec(), rec(test="e2e_test/router/test_chat.py::test_chat[tokenspeed-1]",
                          engine="tokenspeed", topology="1", evals={}, ready_s={"worker-0": 3})]
    out = results.write_session(records, clusters={}, wall_s=12.345, root=tmp_path)
    assert out["dir"] == str(tmp_path)
    assert out["table"] == results.table(records)
    files = sorted(p.name for p in (tmp_path / "tests").iterdir())
    assert files == ["e2e_test_router_test_chat.py_test_chat_tokenspeed-1_.json",
                     "e2e_test_router_test_evals.py_test_gsm8k_vllm-1p1d_.json"]
    one = json.loads((tmp_path / "tests" / files[1]).read_text())
    assert one["evals"]["gsm8k"]["accuracy"] == 0.4 and one["ready_s"]["decode-0"] == 14.56
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["wall_s"], summary["tests"], summary["clusters"]) == (12.3, 2, {})
    assert summary["versions"]["python"]
    assert summary["finished"].endswith("Z")
    md = (tmp_path / "summary.md").read_text()
    assert md == f"## e2e results\n\n{out['table']}\n"


def test_write_session_without_records(tmp_path):
    out = results.write_session([], clusters={}, wall_s=0.0, root=tmp_path / "r")
    assert out == {"dir": str(tmp_path / "r"), "table": ""}
    assert (tmp_path / "r" / "summary.md").read_text() == "## e2e results\n\n(no records)\n"
    assert list((tmp_path / "r" / "tests").iterdir()) == []


def test_write_session_appends_to_github_step_summary(tmp_path, monkeypatch):
    step = tmp_path / "step.md"
    step.write_text("earlier\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    results.write_session([rec()], clusters={}, wall_s=1.0, root=tmp_path / "r")
    text = step.read_text()
    assert text.startswith("earlier\n## e2e results\n\n| test |")
    assert "test_gsm8k[vllm-1p1d]" in text


def test_write_session_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(tmp_path / "res"))
    out = results.write_session([rec()], clusters={}, wall_s=1.0)
    assert out["dir"] == str(tmp_path / "res")
    assert (tmp_path / "res" / "summary.json").is_file()


def test_write_session_takes_teardown_from_the_cluster(tmp_path):
    # A cluster as the plugin hands it over (from this process or a pytest-xdist worker).
    cluster = {"teardown": TeardownReport(seconds=2.0, busy_ports=[20001]).to_dict(),
               "timing": {"workers": {"prefill-0": 1.0}, "gateway_ready_s": 2.5}}
    r = rec()
    results.write_session([r], clusters={"vllm-1p1d": cluster}, wall_s=1.0, root=tmp_path)
    assert r["teardown"]["verdict"] == "NOT clean: ports still listening: [20001]"
    assert r["teardown"]["ok"] is False
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["clusters"]["vllm-1p1d"]["timing"] == {"workers": {"prefill-0": 1.0},
                                                          "gateway_ready_s": 2.5}
    assert summary["clusters"]["vllm-1p1d"]["teardown"]["busy_ports"] == [20001]
    assert "NOT clean" in (tmp_path / "summary.md").read_text()


def test_safe_names():
    assert results.safe_name("a/b.py::t[x y|z]") == "a_b.py_t_x_y_z_"
    assert len(results.safe_name("x" * 500)) == 150


def test_versions():
    v = results.versions()
    assert "python" in v and "smg" in v


# -- one results folder per run (issue 28) -------------------------------------------------------

REC_TEST = """
def test_recorded(record):
    record["x"] = 1
"""


def test_two_concurrent_runs_keep_both_summaries(tmp_path):
    """Two pytest sessions at once in one checkout, E2E_RESULTS_DIR unset: each writes its own
    results/<run>-.../summary.json, and results/latest points at one of them."""
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "test_rec.py").write_text(REC_TEST)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("E2E_", "AFD_")) and k not in ("PYTEST_ADDOPTS",
                                                                "GITHUB_STEP_SUMMARY")}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
            "e2e_test.pytest_plugin", "-q", "test_rec.py"]
    procs = [subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    runs = sorted(d for d in (tmp_path / "results").iterdir() if d.name != "latest")
    assert len(runs) == 2 and all(d.name.startswith("run-") for d in runs), runs
    for d in runs:
        assert json.loads((d / "summary.json").read_text())["tests"] == 1
    latest = tmp_path / "results" / "latest"
    assert latest.is_symlink() and latest.resolve() in [d.resolve() for d in runs]


def test_results_dir_override_and_default(tmp_path):
    from e2e_test.infra.specs import settings
    env = {"E2E_RESULTS_DIR": str(tmp_path / "mine")}
    assert settings.results_dir(env) == tmp_path / "mine"
    env = {"E2E_LANE": "e2e-cpu"}
    d = settings.results_dir(env)
    assert d.parent == Path("results") and d.name.startswith("e2e-cpu-")
    assert env["E2E_RESULTS_DIR"] == str(d)          # children of the run inherit it
    assert settings.results_dir(env) == d            # stable within the run


def test_the_summary_names_the_given_commit_over_gits(monkeypatch):
    """A device runs a copied tree whose .git held another commit (an H100 summary named an
    earlier commit, "-dirty", for a run of a later one): E2E_GIT_SHA, which the lane scripts
    pass, wins. The control: unset, git's own answer (this checkout's HEAD) stands."""
    from e2e_test.infra.reports import results
    monkeypatch.delenv("E2E_GIT_SHA", raising=False)
    own = results.git_sha()
    assert own and own != "abc1234"
    monkeypatch.setenv("E2E_GIT_SHA", "abc1234")
    assert results.git_sha() == "abc1234"
