"""The `baseline` fixture (e2e_test/pytest_baseline.py) in nested pytest sessions with stand-in
topologies (Cluster.start/stop and the evidence's compute replaced; nothing boots): a test
judged against `1` run alone boots `1` first and gets its evidence, measured once for every
test that needs it; where `1` boots for its own tests its evidence is measured right after
the boot; a failed `1` boot fails its dependants with its error without booting again; missing
eval data fails a test judged on an eval before anything boots; a test must declare what it
reads."""

import types

import pytest

from e2e_test.infra.cluster import cluster as cluster_mod
from e2e_test.infra.errors import ConfigError, StartupError
from e2e_test.infra.verdicts import baseline as evidence
from e2e_test.infra.verdicts import datasets

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["e2e_test.pytest_plugin"]\n'
TESTS = '''
import pytest

@pytest.mark.topology_kinds("regular")
def test_a_plain_on_1(cluster):
    pass

@pytest.mark.topology_kinds("pd")
@pytest.mark.baseline("name")
@pytest.mark.parametrize("name", ["gsm8k"])
def test_b_judged(baseline, cluster, name):
    ev = baseline(name)
    assert ev.what == name and ev.topology == "1"
    assert cluster.topology.name == "1p1d"

@pytest.mark.topology_kinds("pd")
@pytest.mark.baseline("gsm8k", "recall")
def test_c_judged_twice(cluster, baseline):
    assert baseline("recall").what == "recall" and baseline("gsm8k").what == "gsm8k"
'''


@pytest.fixture
def log(monkeypatch, tmp_path):
    """Every start, stop and compute, in order."""
    events = []

    def start(self):
        events.append(("start", self.topology.name))
        if self.topology.name in FAIL:
            raise StartupError(f"worker-0 of {self.topology.name} exited while starting")
        self.gateway = types.SimpleNamespace(started_at=None)
        return self

    def stop(self, **kw):
        events.append(("stop", self.topology.name))
        self.stopped = True

    def compute(c, what):
        events.append(("compute", c.topology.name, what))
        return evidence.Evidence(c.engine, c.topology.name, what, passes={}, control=None)

    monkeypatch.setattr(cluster_mod, "weights_path", lambda spec: tmp_path)
    monkeypatch.setattr(cluster_mod.Cluster, "start", start)
    monkeypatch.setattr(cluster_mod.Cluster, "stop", stop)
    monkeypatch.setattr(cluster_mod.Cluster, "wait_idle",
                        lambda self, **kw: types.SimpleNamespace(seconds=0.0))
    monkeypatch.setattr(evidence, "compute", compute)
    monkeypatch.setattr(datasets, "dataset_dir", lambda name: tmp_path / name)
    FAIL.clear()
    return events


FAIL: set = set()


def _run(pytester, monkeypatch, tests, topologies, *args):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    monkeypatch.delenv("E2E_DEVICES", raising=False)
    # a given data folder is checked when the session starts (pytest_plugin), before any
    # fixture: these sessions find their data, or miss it, through datasets.dataset_dir
    monkeypatch.delenv("E2E_DATASET_DIR", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=tests)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "--engine", "vllm",
                                        "--topology", topologies, *args)


def test_judged_tests_alone_boot_1_first_and_share_one_measurement(pytester, monkeypatch, log):
    result = _run(pytester, monkeypatch, TESTS, "1p1d")
    result.assert_outcomes(passed=2)
    # `1` booted before the first judged test's own topology, measured for every what the
    # session needs (collected), stopped, then 1p1d booted once for both tests
    assert log == [("start", "1"), ("compute", "1", "gsm8k"), ("compute", "1", "recall"),
                   ("stop", "1"), ("start", "1p1d"), ("stop", "1p1d")], log
    # the session's cache, not a result: gone after the session
    assert not list((pytester.path / "res" / "evidence").glob("*")), \
        list((pytester.path / "res" / "evidence").rglob("*"))


def test_one_test_alone_measures_only_what_it_needs(pytester, monkeypatch, log):
    result = _run(pytester, monkeypatch, TESTS, "1p1d", "-k", "test_b")
    result.assert_outcomes(passed=1)
    assert [e for e in log if e[0] == "compute"] == [("compute", "1", "gsm8k")], log


def test_where_1_boots_for_its_own_tests_its_evidence_is_measured_right_after(
        pytester, monkeypatch, log):
    result = _run(pytester, monkeypatch, TESTS, "1,1p1d")
    result.assert_outcomes(passed=3)
    assert log == [("start", "1"), ("compute", "1", "gsm8k"), ("compute", "1", "recall"),
                   ("stop", "1"), ("start", "1p1d"), ("stop", "1p1d")], log


def test_a_failed_baseline_boot_fails_its_dependants_at_once(pytester, monkeypatch, log):
    FAIL.add("1")
    result = _run(pytester, monkeypatch, TESTS, "1p1d")
    result.assert_outcomes(errors=2)
    assert [e for e in log if e[0] == "start"] == [("start", "1")], log   # not booted again
    text = "\n".join(result.outlines)
    assert text.count("worker-0 of 1 exited while starting") >= 2, text


def test_missing_eval_data_fails_a_judged_test_before_1_boots(pytester, monkeypatch, log):
    """GSM8K's evidence needs its data: missing, the test errors with the data's message and
    nothing boots; `recall`, which needs none, still boots `1` (the control)."""
    def missing(name):
        raise ConfigError(f"no {name} data here")
    monkeypatch.setattr(datasets, "dataset_dir", missing)
    result = _run(pytester, monkeypatch, TESTS, "1p1d", "-k", "test_b")
    result.assert_outcomes(errors=1)
    assert "no gsm8k data here" in "\n".join(result.outlines)
    assert log == [], log
    result = _run(pytester, monkeypatch, TESTS.replace('"gsm8k", "recall"', '"recall"')
                  .replace('baseline("gsm8k").what == "gsm8k"', 'True'), "1p1d", "-k", "test_c")
    result.assert_outcomes(passed=1)
    assert ("start", "1") in log, log


def test_reading_what_the_test_did_not_declare_is_an_error(pytester, monkeypatch, log):
    """The negative control of the declaration (what the session measures ahead comes from
    it): a test that reads another what, or takes the fixture with no marker, errors."""
    result = _run(pytester, monkeypatch, TESTS.replace('"gsm8k", "recall"', '"gsm8k"'), "1p1d")
    result.assert_outcomes(passed=1, failed=1)
    assert "reads baseline 'recall' but declares only ['gsm8k']" in "\n".join(result.outlines)
    result = _run(pytester, monkeypatch, TESTS.replace('@pytest.mark.baseline("name")\n', ""),
                  "1p1d", "-k", "test_b")
    result.assert_outcomes(errors=1)
    assert "the `baseline` fixture needs @pytest.mark.baseline" in "\n".join(result.outlines)


DISPOSABLE = '''
import pytest

@pytest.mark.topology_kinds("regular")
def test_a_breaks(disposable_cluster):
    disposable_cluster.broken = True

@pytest.mark.topology_kinds("regular")
def test_b_plain(cluster):
    assert not getattr(cluster, "broken", False)

@pytest.mark.topology_kinds("regular")
def test_c_breaks_too(disposable_cluster):
    assert not getattr(disposable_cluster, "broken", False)
'''


def test_a_breaking_test_takes_its_groups_topology_last_and_no_test_gets_it_after(
        pytester, monkeypatch, log):
    """disposable_cluster: the group's topology where the process holds it (the breaking
    tests run after the group's others, whatever the file's order), stopped after the test;
    a second breaking test of the group gets a fresh one."""
    result = _run(pytester, monkeypatch, DISPOSABLE, "1")
    result.assert_outcomes(passed=3)
    assert log == [("start", "1"), ("stop", "1"), ("start", "1"), ("stop", "1")], log
    # alone, a breaking test boots its own
    log.clear()
    result = _run(pytester, monkeypatch, DISPOSABLE, "1", "-k", "test_c")
    result.assert_outcomes(passed=1)
    assert log == [("start", "1"), ("stop", "1")], log


def test_evidence_the_model_cannot_give_is_neither_measured_nor_waited_for(
        pytester, monkeypatch, log):
    """image-prompts of a model that is not multimodal (the default SmolLM2): the test skips,
    naming why, and `1` is not booted for it."""
    tests = TESTS.replace('@pytest.mark.baseline("gsm8k", "recall")',
                          '@pytest.mark.baseline("image-prompts")').replace(
        'assert baseline("recall").what == "recall" and baseline("gsm8k").what == "gsm8k"',
        'baseline("image-prompts")')
    result = _run(pytester, monkeypatch, tests, "1p1d", "-k", "test_c", "-rs")
    result.assert_outcomes(skipped=1)
    assert "is not multimodal" in "\n".join(result.outlines)
    assert log == [], log
