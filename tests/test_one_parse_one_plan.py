"""On the pytest path each topology text is parsed once and placed once: the plugin parses the
selection, the Topology objects travel in the cluster keys, the collection check places each
(engine, topology) and the Cluster takes that Plan instead of placing again. Counted with
wrappers around the parser and plan.place, over a whole session (collection, the fixtures and
the Cluster's construction; the Cluster's start and stop are stubbed: nothing boots)."""

from collections import Counter

import pytest

from e2e_test.infra.cluster import cluster as cluster_mod
from e2e_test.infra.specs import plan, topology

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["e2e_test.pytest_plugin"]\n'
TESTS = '''
import pytest

@pytest.mark.topology_kinds("regular", "pd")
def test_one(cluster):
    assert cluster.plan.topology == cluster.topology.name

@pytest.mark.topology_kinds("regular", "pd")
def test_two(cluster):
    assert cluster.plan.entries

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
def test_profile(cluster):
    assert cluster.plan.entries
'''


@pytest.fixture
def counted(monkeypatch, tmp_path):
    parses: Counter = Counter()
    plans: Counter = Counter()
    real_parse, real_place = topology.parse_uncached, plan.place

    def parse(text):
        parses[text] += 1
        return real_parse(text)

    def place(topo, *a, **kw):
        plans[topo.name] += 1
        return real_place(topo, *a, **kw)

    topology.parse_cached.cache_clear()
    monkeypatch.setattr(topology, "parse_uncached", parse)
    monkeypatch.setattr(plan, "place", place)
    # The Cluster is built (weights looked up, ports and commands made) but never started.
    monkeypatch.setattr(cluster_mod, "weights_path", lambda spec: tmp_path)
    monkeypatch.setattr(cluster_mod.Cluster, "start", lambda self: self)
    monkeypatch.setattr(cluster_mod.Cluster, "stop", lambda self, **kw: None)
    yield parses, plans
    topology.parse_cached.cache_clear()


def _run(pytester, monkeypatch, *args):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    monkeypatch.setenv("E2E_IDLE_AFTER_TEST", "0")
    monkeypatch.delenv("E2E_TOPOLOGIES", raising=False)
    monkeypatch.delenv("E2E_DEVICES", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=TESTS)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-s",
                                        "-W", "ignore::pytest.PytestUnknownMarkWarning",
                                        "--engine", "vllm", "--topology", "1,1p1d,p.tp=1",
                                        *args)


def test_collection_parses_and_places_each_topology_once(pytester, monkeypatch, counted):
    parses, plans = counted
    result = _run(pytester, monkeypatch, "--collect-only")
    assert result.ret == 0, result.outlines
    assert parses == {"1": 1, "1p1d,p.tp=1": 1}, parses
    assert plans == {"1": 1, "1p1d,p.tp=1": 1}, plans


def test_a_session_parses_and_places_each_topology_once(pytester, monkeypatch, counted):
    """Collection, the cluster fixture's device check and the Cluster of every key (the
    profile's included: same placement) share the one parse and the one plan."""
    parses, plans = counted
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(passed=5)
    assert parses == {"1": 1, "1p1d,p.tp=1": 1}, parses
    assert plans == {"1": 1, "1p1d,p.tp=1": 1}, plans
