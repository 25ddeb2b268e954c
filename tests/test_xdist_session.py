"""A session under pytest-xdist (`-n 2 --dist loadgroup`) with stand-in topologies (a nested
pytest in a subprocess whose conftest replaces Cluster.start/stop, the evidence's compute and
the eval data's folders: nothing boots): each topology's tests run on one worker and it boots
once; `1`'s evidence is measured once for both workers (the worker judged against it waits for
the one that claimed it); the controller writes every worker's records; the scratch folder is
gone afterwards."""

import json
import os
from pathlib import Path

from e2e_test.infra.lifecycle.process import extend_pythonpath

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

CONFTEST = '''
import os, time, types
from pathlib import Path
pytest_plugins = ["e2e_test.pytest_plugin"]
from e2e_test.infra.cluster import cluster as cluster_mod
from e2e_test.infra.cluster import progress
from e2e_test.infra.specs import devices
from e2e_test.infra.verdicts import baseline as evidence
from e2e_test.infra.verdicts import datasets

LOG = Path(os.environ["STAND_IN_LOG"])

def log(*words):
    with open(LOG, "a") as f:
        f.write(" ".join(str(w) for w in words) + "\\n")

def start(self):
    log("start", self.topology.name, os.getpid())
    progress.emit(f"{self.topology.name} booting: stand-in")
    time.sleep(2.0 if self.topology.name == "1" else 0.0)
    self.gateway = types.SimpleNamespace(started_at=None)
    return self

def stop(self, **kw):
    log("stop", self.topology.name, os.getpid())
    self.stopped = True

def compute(c, what):
    log("compute", c.topology.name, what, os.getpid())
    return evidence.Evidence(c.engine, c.topology.name, what, passes={}, control=None)

cluster_mod.weights_path = lambda spec: Path(os.environ["STAND_IN_LOG"]).parent
cluster_mod.Cluster.start = start
cluster_mod.Cluster.stop = stop
cluster_mod.Cluster.wait_idle = lambda self, **kw: types.SimpleNamespace(seconds=0.0)
evidence.compute = compute
datasets.dataset_dir = lambda name: Path(os.environ["STAND_IN_LOG"]).parent / name
devices.affinity = lambda: tuple(range(8))
'''

TESTS = '''
import os, time
import pytest

def here(name):
    with open(os.environ["STAND_IN_LOG"], "a") as f:
        f.write(f"test {name} {os.getpid()}\\n")

@pytest.mark.topology_kinds("regular")
@pytest.mark.parametrize("i", range(3))
def test_a_on_1(cluster, record, i):
    here("a")

@pytest.mark.topology_kinds("regular")
@pytest.mark.baseline("gsm8k")
def test_b_on_1_judged(baseline, cluster, record):
    assert baseline("gsm8k").topology == "1"
    here("b")

@pytest.mark.topology_kinds("pd")
@pytest.mark.parametrize("i", range(3))
def test_c_pd(cluster, record, i):
    time.sleep(0.5)                   # the other worker has claimed `1`'s evidence by now
    here("c")

@pytest.mark.topology_kinds("pd")
@pytest.mark.baseline("gsm8k")
def test_d_pd_judged(baseline, cluster, record):
    assert baseline("gsm8k").what == "gsm8k"
    here("d")
'''


def _run(pytester, monkeypatch, dist, n="2"):
    res = pytester.path / "res"
    log = pytester.path / "log"
    log.unlink(missing_ok=True)
    monkeypatch.setenv("E2E_RESULTS_DIR", str(res))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", extend_pythonpath(str(ROOT), os.environ.get("PYTHONPATH", "")))
    monkeypatch.delenv("E2E_DEVICES", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", n, "--dist", dist,
                                           "-W", "ignore::pytest.PytestUnknownMarkWarning",
                                           "--engine", "vllm", "--topology", "1,1p1d")
    result.assert_outcomes(passed=8)
    lines = [ln.split() for ln in log.read_text().splitlines()]
    pids = {}
    for ln in lines:
        if ln[0] == "test":
            pids.setdefault(ln[1], set()).add(ln[2])
    return res, lines, pids


def test_two_workers_share_the_evidence_and_the_controller_writes_the_records(
        pytester, monkeypatch):
    res, lines, pids = _run(pytester, monkeypatch, "loadgroup")
    assert len(pids["a"] | pids["b"]) == 1 and len(pids["c"] | pids["d"]) == 1, lines
    assert pids["a"] != pids["c"], lines                   # the two groups on two workers
    starts = [ln[1] for ln in lines if ln[0] == "start"]
    assert sorted(starts) == ["1", "1p1d"], lines            # each topology booted once
    computes = [ln for ln in lines if ln[0] == "compute"]
    assert len(computes) == 1 and {computes[0][3]} == pids["a"], lines   # by `1`'s worker
    recs = {json.loads(f.read_text())["test"] for f in (res / "tests").glob("*.json")}
    assert recs == {f"test_x.py::{t}" for t in (
        *(f"test_a_on_1[vllm-1-{i}]" for i in range(3)), "test_b_on_1_judged[vllm-1]",
        *(f"test_c_pd[vllm-1p1d-{i}]" for i in range(3)), "test_d_pd_judged[vllm-1p1d]")}, recs
    summary = json.loads((res / "summary.json").read_text())
    assert summary["tests"] == 8 and len(summary["clusters"]) == 2, summary
    # each worker's progress lines (no terminal of its own) in its file
    assert sorted(p.name for p in res.glob("progress-gw*.log")) == ["progress-gw0.log",
                                                                    "progress-gw1.log"]
    assert not (res / ".session").exists() or not list((res / ".session").iterdir())


def test_without_the_groups_a_topology_boots_on_each_worker(pytester, monkeypatch):
    """The negative control: `--dist load` hands the same tests out in pairs, so both
    workers boot `1` (and 1p1d); the evidence is still measured once (the cache's lock)."""
    _, lines, _ = _run(pytester, monkeypatch, "load")
    starts = [ln[1] for ln in lines if ln[0] == "start"]
    assert starts.count("1") == 2, lines
    assert len([ln for ln in lines if ln[0] == "compute"]) == 1, lines


def test_auto_on_cpu_runs_every_test_in_this_process(pytester, monkeypatch):
    """`-n auto --dist loadgroup` asks the harness (coboot.assign): on CPU one topology at a
    time, so no worker process at all, and the reason is in the summary."""
    res, lines, pids = _run(pytester, monkeypatch, "loadgroup", "auto")
    assert len(set().union(*pids.values())) == 1, lines
    assert sorted(ln[1] for ln in lines if ln[0] == "start") == ["1", "1p1d"], lines
    timing = json.loads((res / "timing.json").read_text())
    assert timing["assignment"]["workers"] == 1
    assert timing["assignment"]["reason"].startswith("backend cpu")
