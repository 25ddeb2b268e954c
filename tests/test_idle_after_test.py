"""The idle check after every test on a shared topology (pytest_plugin._e2e_idle_after), in a
nested pytest session: the test that leaves its topology busy fails, naming itself and what was
busy, its topology is stopped, and the next test gets a fresh one; a test after which every
role is idle passes. The Cluster is built but never started (start, stop and wait_idle are
stand-ins here: the fixture's logic is what is tested; the real idle check runs in
e2e_test/router/test_serving_faults.py and after every e2e test)."""

import json
import types

import pytest

from e2e_test.infra.cluster import cluster as cluster_mod
from e2e_test.infra.cluster.idle import IdleError

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["e2e_test.pytest_plugin"]\n'
TESTS = '''
import pytest

SEEN = []

@pytest.mark.topology_kinds("regular")
def test_leaks(cluster, record):
    SEEN.append(id(cluster))
    record["sent"] = 1

@pytest.mark.topology_kinds("regular")
def test_after_the_leak(cluster):
    SEEN.append(id(cluster))
    assert SEEN[0] != SEEN[1], "the leaking topology was handed on"

@pytest.mark.topology_kinds("regular")
def test_shares_the_fresh_one(cluster, record):
    SEEN.append(id(cluster))
    assert SEEN[2] == SEEN[1]
'''


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    calls = {"start": 0, "stop": 0, "idle": 0}

    def start(self):
        calls["start"] += 1
        # a topology that is up (the check applies), with no process to watch
        self.gateway = types.SimpleNamespace(started_at=None)
        return self

    def stop(self, **kw):
        calls["stop"] += 1
        self.stopped = True

    class Report:
        seconds = 0.01

    def wait_idle(self, **kw):
        calls["idle"] += 1
        if calls["idle"] == 1:          # after the first test: a request still running
            raise IdleError("topology 1 (vllm): not idle 30 s after traffic: "
                            "worker-0 (running 1, waiting 0)")
        return Report()

    monkeypatch.setattr(cluster_mod, "weights_path", lambda spec: tmp_path)
    monkeypatch.setattr(cluster_mod.Cluster, "start", start)
    monkeypatch.setattr(cluster_mod.Cluster, "stop", stop)
    monkeypatch.setattr(cluster_mod.Cluster, "wait_idle", wait_idle)
    return calls


def _run(pytester, monkeypatch, idle_after="1"):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    monkeypatch.setenv("E2E_IDLE_AFTER_TEST", idle_after)
    monkeypatch.delenv("E2E_TOPOLOGIES", raising=False)
    monkeypatch.delenv("E2E_DEVICES", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=TESTS)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-p", "no:randomly",
                                        "-W", "ignore::pytest.PytestUnknownMarkWarning",
                                        "--engine", "vllm", "--topology", "1")


def test_the_test_that_leaves_its_topology_busy_fails_and_the_next_gets_a_fresh_one(
        pytester, monkeypatch, stand_ins):
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(passed=3, errors=1)
    text = "\n".join(result.outlines)
    assert ("after test_leaks[vllm-1]: topology 1 (vllm): not idle 30 s after traffic: "
            "worker-0 (running 1, waiting 0)") in text, text
    assert stand_ins == {"start": 2, "stop": 2, "idle": 3}
    # the result files say so too (the record was taken before the check ran)
    [rec] = [json.loads(f.read_text()) for f in (pytester.path / "res").rglob("*test_leaks*.json")]
    assert rec["outcome"] == "error" and "not idle 30 s after traffic" in rec["teardown_error"]
    [rec] = [json.loads(f.read_text()) for f in (pytester.path / "res").rglob("*fresh_one*.json")]
    assert rec["outcome"] == "passed" and rec["idle_after_s"] == 0.01   # the check ran


def test_without_the_check_the_leak_passes_and_is_handed_on(pytester, monkeypatch,
                                                             stand_ins):
    """The negative control: E2E_IDLE_AFTER_TEST=0, the same leak, no failure, one topology
    for all three tests (test_after_the_leak fails on the shared object instead)."""
    result = _run(pytester, monkeypatch, idle_after="0")
    result.assert_outcomes(passed=2, failed=1)
    assert "the leaking topology was handed on" in "\n".join(result.outlines)
    assert stand_ins["idle"] == 0 and stand_ins["start"] == 1
