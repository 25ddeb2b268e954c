"""pytest glue for lanes: device shortfall (shared topologies: deselected at collection;
a test's own topology: skip, or fail under --e2e-no-skips), placeholder cases deselected, the
opt-in AFD profile check, selection accounting, --e2e-min-tests (tests that ran) and
--e2e-no-skips. Loaded by pytest_plugin.py (its `pytest_plugins`); the fixtures live there."""

from __future__ import annotations

import pytest

from .infra import startup
from .infra.engines import engine_names, for_topology, kind_engines
from .infra.errors import ConfigError
from .infra.lifecycle import simhosts
from .infra.specs import plan as planner
from .infra.specs import settings
from .infra.specs import topology as topologies
from .infra.specs.model_specs import get_spec
from .infra.specs.plan import LOCAL_NODES, Node, Plan, TooFewDevices
from .infra.specs.topology import Topology
from .pytest_state import DESELECT_WHY, state


def pytest_addoption(parser):
    g = parser.getgroup("e2e", "end-to-end harness")
    g.addoption("--e2e-min-tests", type=int, default=None, metavar="N",
                help="fail the session when fewer than N tests are selected, or when fewer "
                     "than N ran (skipped ones do not count; lanes set this)")
    g.addoption("--e2e-min-engine-tests", type=int, default=None, metavar="N",
                help="the same for the tests on an engine (marked vllm or tokenspeed) alone: "
                     "in a lane that runs unit tests too, they cannot make the count")
    g.addoption("--e2e-no-skips", action="store_true", default=False,
                help="any skipped test fails the session (GPU and opt-in lanes set this)")


def _placed(model: str, topo: Topology, backend: str, devices: str | None,
            engine: str | None) -> Plan | str | None:
    """plan.place for this machine: the Plan, or the TooFewDevices line, or None where the
    nodes are another launcher's (the Cluster's own plan checks them then)."""
    if settings.get("E2E_LAUNCHER") != "local":
        return None
    driver = for_topology(engine or kind_engines()[topo.kind][0], topo)
    # Roles pinned to nodes (`d.node=1`): as many nodes on this one machine (simulated hosts),
    # so the question stays whether this machine's devices hold the topology.
    pins = [g.node for g in topo.roles if g.node is not None]
    nodes = tuple(Node(k, "127.0.0.1") for k in range(max(pins) + 1)) if pins else LOCAL_NODES
    try:
        return planner.place(topo, get_spec(model), backend,
                             startup.machine_devices(topo, backend, devices), driver,
                             nodes=nodes)
    except TooFewDevices as e:
        return e.summary


def device_shortfall(model: str, topology, backend: str, devices: str | None,
                     engine: str | None = None) -> str | None:
    """One line when this machine has too few devices for `topology` (plan.place's
    TooFewDevices: the planner cannot place it, or the engine's workers would have to share a
    GPU they cannot share); None when it fits. `engine`: the --engine name (default: the
    first that runs this topology kind). Other configuration errors (a bad device list, an
    unknown model, no GPU at all on cuda) propagate."""
    got = _placed(model, topologies.parse(topology), backend, devices, engine)
    return got if isinstance(got, str) else None


def session_plan(config, topology: Topology, backend: str,
                 engine: str | None = None) -> Plan | str | None:
    """The session's one placement of (model, topology, backend, devices, engine): placed the
    first time it is asked (the collection check), the same answer after (the fixture's check,
    then the Cluster, which takes the Plan instead of placing again)."""
    cache = state(config).plans
    key = (config.getoption("--model"), topology, backend, config.getoption("--devices"),
           engine)
    if key not in cache:
        cache[key] = _placed(*key)
    return cache[key]


def reusable_plan(config, topology: Topology, backend: str, engine: str | None) -> Plan | None:
    """The session's Plan when a Cluster on the local launcher can take it as it is (no role
    pinned to a simulated node: those the Cluster's launcher places); else None."""
    if any(g.node is not None for g in topology.roles):
        return None
    got = session_plan(config, topology, backend, engine)
    return got if isinstance(got, Plan) else None


def require_devices(config, topology, backend: str, engine: str | None = None) -> None:
    """An engine that does not run on this backend: the test is skipped. Too few devices:
    skipped in ordinary lanes, fails under --e2e-no-skips."""
    topology = topologies.parse(topology)
    if engine is not None:
        driver = for_topology(engine, topology)
        if backend not in driver.backends:
            pytest.skip(f"{engine} ({driver.name}) runs on {' or '.join(driver.backends)} "
                        f"only (backend is {backend})")
    why = session_plan(config, topology, backend, engine)
    if isinstance(why, str):
        if config.getoption("--e2e-no-skips"):
            pytest.fail(f"too few devices (--e2e-no-skips): {why}", pytrace=False)
        pytest.skip(f"too few devices: {why}")


def require_multinode() -> None:
    """The simulated-hosts tests' guard: skip with the reason where network namespaces or Ray
    are missing, fail instead under E2E_REQUIRE_MULTINODE=1 (`.ci/run` as root)."""
    why = simhosts.available()
    if why is None:
        try:
            import ray  # noqa: F401
        except ImportError:
            why = "ray is not installed (pip install -e '.[multinode]')"
    if why:
        if settings.get("E2E_REQUIRE_MULTINODE"):
            pytest.fail(f"multi-node test required (E2E_REQUIRE_MULTINODE=1): {why}",
                        pytrace=False)
        pytest.skip(why)


def _runner_deselection(item, config, backend: str | None) -> str | None:
    """Why this machine cannot run the item, decided at collection: a placeholder case (no
    selected engine/topology fits the test) or a shared topology the devices present cannot
    hold (a fact about the runner, not a test outcome). None: keep it. A topology whose
    placement cannot be judged here (cuda with no GPU seen) stays: its fixture says why."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if ("cluster_key" in params and params["cluster_key"] is None) or \
            ("engine_name" in params and params["engine_name"] is None):
        return "no selected engine/topology fits the test"
    model = config.getoption("--model")
    lacks = [f for f in getattr(item.module, "NEEDS_FEATURES", ())
             if f not in get_spec(model).features]
    if lacks:
        return f"the session's model ({model}) is not {', '.join(lacks)}"
    only = item.get_closest_marker("backends")
    if only is not None and backend is not None and backend not in only.args:
        return f"runs on backend {' or '.join(only.args)} only (measured there)"
    ck = params.get("cluster_key")
    if not ck or backend is None:
        return None
    engine, topo = ck[0], ck[1]
    try:
        # an engine off its backend (TokenSpeed on cpu) stays a skip (require_devices)
        if backend not in for_topology(engine, topo).backends:
            return None
        why = session_plan(config, topo, backend, engine)
    except ConfigError:
        return None
    return f"too few devices: {why}" if isinstance(why, str) else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Cases this runner cannot run are deselected (named in the selection report), so a lane
    neither skips them nor counts them: --e2e-min-tests then says the lane ran too little."""
    try:
        backend = startup.resolve_backend(config.getoption("--backend"))
    except Exception:   # startup already named a bad --backend
        backend = None
    keep, drop = [], []
    for item in items:
        why = _runner_deselection(item, config, backend)
        if why:
            item.stash[DESELECT_WHY] = why
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _deselect_reason(item, config) -> str:
    if DESELECT_WHY in item.stash:
        return item.stash[DESELECT_WHY]
    kexpr = (getattr(config.option, "keyword", "") or "").strip()
    mexpr = (getattr(config.option, "markexpr", "") or "").strip()
    try:
        from _pytest.mark import KeywordMatcher, MarkMatcher
        from _pytest.mark.expression import Expression
        if kexpr and not Expression.compile(kexpr).evaluate(KeywordMatcher.from_item(item)):
            return f"-k {kexpr!r}"
        if mexpr and not Expression.compile(mexpr).evaluate(
                MarkMatcher.from_markers(item.iter_markers())):
            return f"-m {mexpr!r}"
    except Exception:   # pytest internals moved: still say which options were given
        if kexpr or mexpr:
            return " / ".join(x for x in (kexpr and f"-k {kexpr!r}",
                                          mexpr and f"-m {mexpr!r}") if x)
    return "other (--deselect, --lf or a plugin)"


def pytest_deselected(items):
    if not items:
        return
    config = items[0].config
    by_reason = state(config).deselected
    for item in items:
        by_reason.setdefault(_deselect_reason(item, config), []).append(item)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if rep.skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        state(collector.config).collect_skips.append(f"{rep.nodeid or '.'}: {reason}")
    return rep


def _engine_of(item) -> str:
    return next((e for e in engine_names() if item.get_closest_marker(e)), "none")


def _engine_counts(items) -> str:
    counts: dict[str, int] = {}
    for item in items:
        e = _engine_of(item)
        counts[e] = counts.get(e, 0) + 1
    return " ".join(f"{e}={n}" for e, n in sorted(counts.items())) or "-"


def selection_report(session) -> list[str]:
    config = session.config
    by_reason: dict = state(config).deselected
    deselected = [i for items in by_reason.values() for i in items]
    lane = settings.get("E2E_LANE")
    lines = [f"e2e selection{f' (lane {lane})' if lane else ''}: {len(session.items)} "
             f"selected, {len(deselected)} deselected"]
    for reason, items in by_reason.items():
        lines.append(f"  deselected {len(items)} by {reason}")
    lines.append(f"  selected by engine: {_engine_counts(session.items)}")
    if deselected:
        lines.append(f"  deselected by engine: {_engine_counts(deselected)}")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    config = session.config
    if getattr(config, "workerinput", None) is not None:
        return
    tr = config.pluginmanager.get_plugin("terminalreporter")
    write = tr.write_line if tr is not None else print
    for line in selection_report(session):
        write(line)
    skips = state(config).collect_skips
    if config.getoption("--e2e-no-skips") and skips:
        pytest.exit(f"--e2e-no-skips: {len(skips)} skipped at collection: " + "; ".join(skips),
                    returncode=pytest.ExitCode.TESTS_FAILED)
    lane = settings.get("E2E_LANE")
    for opt, n in (("--e2e-min-tests", len(session.items)),
                   ("--e2e-min-engine-tests",
                    sum(_engine_of(i) != "none" for i in session.items))):
        need = config.getoption(opt)
        if need is not None and n < need:   # fewer selected: fewer can run
            pytest.exit(f"{f'lane {lane}: ' if lane else ''}{n} test(s) selected, fewer than "
                        f"{opt} {need} (check paths, -m, E2E_ENGINES, E2E_TOPOLOGIES)",
                        returncode=pytest.ExitCode.TESTS_FAILED)


def pytest_runtest_logreport(report):
    """A test ran when its body ran (the call phase), whatever its outcome; a skip never runs
    its body. Under xdist the controller sees every worker's reports here."""
    if report.when == "call" and (not report.skipped or hasattr(report, "wasxfail")):
        _RAN.add(report.nodeid)
        if any(e in report.keywords for e in engine_names()):
            _RAN_ENGINE.add(report.nodeid)


_RAN: set = set()
_RAN_ENGINE: set = set()      # of those, the tests on an engine (marked vllm/tokenspeed)


def ran_count(config) -> int:
    return len(_RAN)


def pytest_sessionstart(session):
    _RAN.clear()
    _RAN_ENGINE.clear()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """--e2e-min-tests counts the tests that ran: a lane whose selection was skipped away
    (or deselected for this runner) fails instead of going green."""
    config = session.config
    if (getattr(config, "workerinput", None) is not None or config.getoption("collectonly")
            or session.shouldstop or exitstatus == pytest.ExitCode.INTERRUPTED):
        return
    lane = settings.get("E2E_LANE")
    for opt, ran, what in (("--e2e-min-tests", ran_count(config), "test(s)"),
                           ("--e2e-min-engine-tests", len(_RAN_ENGINE), "test(s) on an engine")):
        need = config.getoption(opt)
        if need is None or ran >= need:
            continue
        line = (f"{f'lane {lane}: ' if lane else ''}{ran} {what} ran, fewer than {opt} {need} "
                f"({len(session.items)} selected; skipped tests do not count)")
        st = state(config)
        st.min_tests_line = f"{st.min_tests_line}; {line}" if st.min_tests_line else line
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = getattr(state(config), "min_tests_line", None)
    if line:
        terminalreporter.write_line(line, red=True, bold=True)


@pytest.hookimpl(wrapper=True, trylast=True, specname="pytest_runtest_makereport")
def pytest_runtest_makereport_no_skips(item, call):
    """--e2e-no-skips: a skipped test (not an xfail) is reported as failed, with its reason."""
    rep = yield
    if (rep.skipped and not hasattr(rep, "wasxfail")
            and item.config.getoption("--e2e-no-skips")):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"--e2e-no-skips: a skipped test fails this lane: {reason}"
    return rep
