"""The plugin's grouping of shared topologies (collection only, nothing boots): each key
(engine, topology, profile) is contiguous, so it boots once; a test marked `breaks_cluster`
runs last in its group whatever its place in the file; a profile is its own group; an
unknown profile is a usage error before anything starts."""

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["e2e_test.pytest_plugin"]\n'
TESTS = '''
import pytest

@pytest.mark.breaks_cluster
@pytest.mark.topology_kinds("regular")
def test_a_breaks(cluster):
    pass

@pytest.mark.topology_kinds("regular")
def test_b_plain(cluster):
    pass

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
@pytest.mark.breaks_cluster
def test_c_window_breaks(cluster):
    pass

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
def test_d_window(cluster):
    pass

@pytest.mark.topology_kinds("pd")
def test_e_pd_plain(cluster):
    pass

def test_f_own(own_cluster):
    pass

def test_g_no_cluster():
    pass
'''


def _collected(pytester, monkeypatch, tests):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=tests)
    return pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q",
                              "-W", "ignore::pytest.PytestUnknownMarkWarning",
                              "--engine", "vllm", "--topology", "1,1p1d")


def test_breaking_tests_last_in_their_group_and_profiles_apart(pytester, monkeypatch):
    result = _collected(pytester, monkeypatch, TESTS)
    ids = [line.split("::")[1] for line in result.outlines if line.startswith("test_x.py::")]
    assert ids == ["test_g_no_cluster",
                   "test_b_plain[vllm-1]", "test_a_breaks[vllm-1]",           # `1`
                   "test_e_pd_plain[vllm-1p1d]",                              # `1p1d`
                   "test_d_window[vllm-1p1d]", "test_c_window_breaks[vllm-1p1d]",  # window
                   "test_f_own"], ids


def test_file_order_without_the_marker(pytester, monkeypatch):
    # The negative control: without `breaks_cluster` the breaking test would run first and
    # the plain test after it would get a broken (or a second) topology.
    result = _collected(pytester, monkeypatch, TESTS.replace("@pytest.mark.breaks_cluster\n", ""))
    ids = [line.split("::")[1] for line in result.outlines if line.startswith("test_x.py::")]
    assert ids[1:3] == ["test_a_breaks[vllm-1]", "test_b_plain[vllm-1]"], ids


def test_unknown_profile_is_a_usage_error(pytester, monkeypatch):
    result = _collected(pytester, monkeypatch, TESTS.replace('cluster_profile("window")',
                                                             'cluster_profile("windw")'))
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*cluster_profile('windw'): no such profile (known: kv_corrupt, window)*"])
