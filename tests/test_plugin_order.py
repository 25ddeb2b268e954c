"""The plugin's grouping of shared topologies (collection only, nothing boots): each key
(engine, topology, profile) is contiguous, so it boots once; a test that breaks its topology
(disposable_cluster) runs last in its group whatever its place in the file; a profile is its
own group; an unknown profile is a usage error before anything starts."""

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["e2e_test.pytest_plugin"]\n'
TESTS = '''
import pytest

@pytest.mark.topology_kinds("regular")
def test_a_breaks(disposable_cluster):
    pass

@pytest.mark.topology_kinds("regular")
def test_b_plain(cluster):
    pass

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
def test_c_window_breaks(disposable_cluster):
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


def test_file_order_without_the_fixture(pytester, monkeypatch):
    # The negative control: taking `cluster` instead, the breaking test would run first and
    # the plain test after it would get a broken (or a second) topology.
    result = _collected(pytester, monkeypatch, TESTS.replace("(disposable_cluster)", "(cluster)"))
    ids = [line.split("::")[1] for line in result.outlines if line.startswith("test_x.py::")]
    assert ids[1:3] == ["test_a_breaks[vllm-1]", "test_b_plain[vllm-1]"], ids


def test_unknown_profile_is_a_usage_error(pytester, monkeypatch):
    result = _collected(pytester, monkeypatch, TESTS.replace('cluster_profile("window")',
                                                             'cluster_profile("windw")'))
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*cluster_profile('windw'): no such profile (known: kv_corrupt, window)*"])


BASELINE_TESTS = '''
import pytest

@pytest.mark.topology_kinds("pd")
@pytest.mark.baseline("gsm8k")
def test_a_pd_judged(baseline, cluster):
    pass

@pytest.mark.topology_kinds("pd")
def test_b_pd_plain(cluster):
    pass

@pytest.mark.topology_kinds("regular")
def test_c_regular(cluster):
    pass

@pytest.mark.topology_kinds("pd")
def test_d_pd_disposable(disposable_cluster):
    pass

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
def test_e_window(cluster):
    pass
'''


def _ids(pytester, monkeypatch, tests, topologies):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    pytester.makeconftest(CONFTEST + GROUPS)
    pytester.makepyfile(test_x=tests)
    result = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q",
                                "-W", "ignore::pytest.PytestUnknownMarkWarning",
                                "--engine", "vllm", "--topology", topologies)
    ids = [line.split("::")[1] for line in result.outlines if line.startswith("test_x.py::")]
    groups = dict(line.split(" GROUP ")[1].split("=") for line in result.outlines
                  if " GROUP " in line)
    return ids, groups


# what each test's xdist_group mark names, printed by the nested session
GROUPS = '''
def pytest_collection_finish(session):
    for item in session.items:
        m = item.get_closest_marker("xdist_group")
        print(" GROUP " + item.name + "=" + (m.kwargs["name"] if m else "-"))
'''


def test_a_baseline_topology_boots_first_and_its_judges_come_late(pytester, monkeypatch):
    """`1` listed after 1p1d still comes first where a collected test needs its evidence
    (its group boots it, so the judged test's own group does not boot it in between); within
    1p1d the judged test comes after the plain one, and the test that breaks it last."""
    ids, _ = _ids(pytester, monkeypatch, BASELINE_TESTS, "1p1d,1")
    assert ids == ["test_c_regular[vllm-1]", "test_b_pd_plain[vllm-1p1d]",
                   "test_a_pd_judged[vllm-1p1d]", "test_d_pd_disposable[vllm-1p1d]",
                   "test_e_window[vllm-1p1d]"], ids
    # the negative control: with no test judged against `1`, the selected order holds
    ids, _ = _ids(pytester, monkeypatch,
                  BASELINE_TESTS.replace('@pytest.mark.baseline("gsm8k")\n', "")
                  .replace("(baseline, cluster)", "(cluster)"), "1p1d,1")
    assert ids[0] == "test_a_pd_judged[vllm-1p1d]" and ids[-1] == "test_c_regular[vllm-1]", ids


def test_each_shared_key_is_one_xdist_group(pytester, monkeypatch):
    """A shared topology's tests form one pytest-xdist group (`--dist loadgroup` runs it on
    one worker: one boot), the test that breaks it (disposable_cluster) included: it takes
    the group's topology last."""
    _, groups = _ids(pytester, monkeypatch, BASELINE_TESTS, "1,1p1d")
    assert groups == {"test_c_regular[vllm-1]": "vllm/1",
                      "test_a_pd_judged[vllm-1p1d]": "vllm/1p1d",
                      "test_b_pd_plain[vllm-1p1d]": "vllm/1p1d",
                      "test_e_window[vllm-1p1d]": "vllm/1p1d/window",
                      "test_d_pd_disposable[vllm-1p1d]": "vllm/1p1d"}, groups


def test_shuffle_moves_tests_only_within_their_group(pytester, monkeypatch):
    """--e2e-shuffle SEED: the same tests, each group where it was, in a seeded order within
    it (the shuffle check's tool); the same seed gives the same order."""
    default, groups = _ids(pytester, monkeypatch, BASELINE_TESTS, "1,1p1d")

    def shuffled(seed):
        result = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q",
                                    "-W", "ignore::pytest.PytestUnknownMarkWarning",
                                    "--engine", "vllm", "--topology", "1,1p1d",
                                    "--e2e-shuffle", str(seed))
        return [ln.split("::")[1] for ln in result.outlines if ln.startswith("test_x.py::")]

    orders = [shuffled(seed) for seed in range(6)]
    assert orders[0] == shuffled(0)
    for ids in orders:
        assert sorted(ids) == sorted(default)
        assert [groups[i] for i in ids] == [groups[i] for i in default], ids
    assert any(ids != default for ids in orders), orders     # some seed moved something
