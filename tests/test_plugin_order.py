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


def _collected(pytester, monkeypatch, tests, *args):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(pytester.path / "res"))
    monkeypatch.setenv("E2E_BACKEND", "cpu")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_x=tests)
    return pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q",
                              "-W", "ignore::pytest.PytestUnknownMarkWarning",
                              "--engine", "vllm", "--topology", "1,1p1d", *args)


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


# Traffic ahead (coboot.py): booted together, `1`'s passes run from a thread while the other
# topologies' tests run; the order is what makes that overlap and keeps it safe.
AHEAD_TESTS = '''
import pytest

def _pass(cluster, store):
    return 1

@pytest.mark.topology_kinds("regular")
@pytest.mark.ahead.with_args(_pass)
def test_a_regular_pass(cluster, ahead):
    pass

@pytest.mark.topology_kinds("regular")
def test_b_regular_plain(cluster):
    pass

@pytest.mark.topology_kinds("pd")
@pytest.mark.needs_baseline
def test_c_pd_judged(cluster):
    pass

@pytest.mark.topology_kinds("pd")
@pytest.mark.breaks_cluster
def test_d_pd_breaks(cluster):
    pass

@pytest.mark.topology_kinds("pd")
def test_e_pd_plain(cluster):
    pass

@pytest.mark.topology_kinds("pd")
@pytest.mark.quiet
def test_ea_pd_timed(cluster):
    pass

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
@pytest.mark.breaks_cluster
def test_f_window_breaks(cluster):
    pass

@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
def test_g_window(cluster):
    pass
'''


def _order(pytester, monkeypatch, tests, schedule=None):
    """The collected order; `schedule`: --e2e-boot-schedule."""
    result = _collected(pytester, monkeypatch, tests,
                        *(("--e2e-boot-schedule", schedule) if schedule else ()))
    return [line.split("::")[1] for line in result.outlines if line.startswith("test_x.py::")]


TODAY = ["test_a_regular_pass[vllm-1]", "test_b_regular_plain[vllm-1]",
         "test_c_pd_judged[vllm-1p1d]", "test_e_pd_plain[vllm-1p1d]",
         "test_ea_pd_timed[vllm-1p1d]", "test_d_pd_breaks[vllm-1p1d]",
         "test_g_window[vllm-1p1d]", "test_f_window_breaks[vllm-1p1d]"]


def test_booted_together_the_regular_passes_run_ahead_of_its_tests(pytester, monkeypatch):
    ids = _order(pytester, monkeypatch, AHEAD_TESTS, schedule="together")
    assert ids == ["test_e_pd_plain[vllm-1p1d]", "test_g_window[vllm-1p1d]",   # beside the passes
                   "test_c_pd_judged[vllm-1p1d]",     # its own traffic beside them, then judged
                   "test_a_regular_pass[vllm-1]", "test_b_regular_plain[vllm-1]",  # `1`, after them
                   "test_ea_pd_timed[vllm-1p1d]",                     # timed: nothing beside
                   "test_d_pd_breaks[vllm-1p1d]", "test_f_window_breaks[vllm-1p1d]"], ids
    # every topology's breaking test is its last: nothing runs on a broken topology
    for topo in ("[vllm-1p1d]",):
        mine = [i for i in ids if i.endswith(topo) and not i.startswith(("test_f", "test_g"))]
        assert mine[-1] == "test_d_pd_breaks[vllm-1p1d]", mine


def test_serial_keeps_todays_order(pytester, monkeypatch):
    # The negative control: the same tests, booted serially, run in today's order (grouped by
    # topology, `1` first, breaking tests last).
    assert _order(pytester, monkeypatch, AHEAD_TESTS, schedule="serial") == TODAY


def test_nothing_ahead_without_passes_marked_ahead(pytester, monkeypatch):
    ids = _order(pytester, monkeypatch, AHEAD_TESTS.replace("@pytest.mark.ahead.with_args(_pass)\n", ""),
                 schedule="together")
    assert ids == TODAY, ids


RESTARTING = AHEAD_TESTS + '''
@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
@pytest.mark.restarting
def test_h_window_restarting(cluster):
    pass
'''


def test_booted_together_a_restarting_test_runs_first_and_its_breaking_test_last(pytester,
                                                                                  monkeypatch):
    """The window's lost leg restarts in the background (marker `restarting`): its topology's
    tests up to it run first, so the restart boots beside the other tests; the window's
    breaking test (the rejoin) stays last."""
    ids = _order(pytester, monkeypatch, RESTARTING, schedule="together")
    assert ids == ["test_g_window[vllm-1p1d]", "test_h_window_restarting[vllm-1p1d]",
                   "test_e_pd_plain[vllm-1p1d]", "test_c_pd_judged[vllm-1p1d]",
                   "test_a_regular_pass[vllm-1]", "test_b_regular_plain[vllm-1]",
                   "test_ea_pd_timed[vllm-1p1d]",
                   "test_d_pd_breaks[vllm-1p1d]", "test_f_window_breaks[vllm-1p1d]"], ids
    # serially: today's order, the restarting test after its group's others, before the
    # breaking one
    serial = _order(pytester, monkeypatch, RESTARTING, schedule="serial")
    assert serial == TODAY[:-1] + ["test_h_window_restarting[vllm-1p1d]", TODAY[-1]], serial
    # the negative control: without the marker it is a plain test, after the pd tests, so a
    # restart it started would boot after them
    plain = _order(pytester, monkeypatch, RESTARTING.replace("@pytest.mark.restarting\n", ""),
                   schedule="together")
    assert plain.index("test_h_window_restarting[vllm-1p1d]") > plain.index(
        "test_e_pd_plain[vllm-1p1d]"), plain


def test_the_cpu_lane_decides_serial_and_keeps_todays_order(pytester, monkeypatch):
    # auto on a CPU backend: serial (coboot.py), so no pass runs ahead
    assert _order(pytester, monkeypatch, AHEAD_TESTS) == TODAY


def test_an_unknown_boot_schedule_is_a_usage_error(pytester, monkeypatch):
    result = _collected(pytester, monkeypatch, AHEAD_TESTS, "--e2e-boot-schedule", "waves")
    assert result.ret == 4, result.outlines     # pytest's usage error, before any collection
    assert "invalid choice: 'waves'" in "\n".join(result.errlines), result.errlines
