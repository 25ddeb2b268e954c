"""pytest glue, a few lines over the library: options, parametrized cluster fixture with
engine/topology markers per case, result records, signal handling and the summary table."""

from __future__ import annotations

import os
import time

import pytest

from .infra import lifecycle, results
from .infra.cluster import Cluster, default_backend
from .infra.engines import options_from_env
from .infra.errors import HarnessError
from .infra.topology import parse as parse_topology

ENGINES = ("vllm", "tokenspeed")
DEFAULT_TOPOLOGIES = "1,dp2,1p1d"


def pytest_addoption(parser):
    g = parser.getgroup("e2e", "end-to-end harness")
    g.addoption("--engine", default=os.environ.get("E2E_ENGINES", ",".join(ENGINES)),
                help="engines to parametrize over (comma list; env E2E_ENGINES)")
    g.addoption("--topology", default=os.environ.get("E2E_TOPOLOGIES", DEFAULT_TOPOLOGIES),
                help="topologies to parametrize over (comma list; env E2E_TOPOLOGIES)")
    g.addoption("--model", default=os.environ.get("E2E_MODEL", "SmolLM2-135M-Instruct"),
                help="model id from the registry (env E2E_MODEL)")
    g.addoption("--devices", default=os.environ.get("E2E_DEVICES"),
                help="ordered device list, e.g. 0,1 (env E2E_DEVICES)")
    g.addoption("--backend", default=os.environ.get("E2E_BACKEND"),
                help="cpu or cuda (default: cuda when NVML sees a GPU)")
    g.addoption("--e2e-min-tests", type=int, default=None, metavar="N",
                help="fail the session when fewer than N tests are selected (lanes set this)")
    g.addoption("--e2e-no-skips", action="store_true", default=False,
                help="any skipped test fails the session (opt-in lanes set this)")


def _csv(v: str) -> list[str]:
    return [x.strip() for x in (v or "").split(",") if x.strip()]


def pytest_configure(config):
    lifecycle.install()
    config._e2e_records = []
    config._e2e_clusters = {}
    config._e2e_t0 = time.monotonic()
    # Bad input: one line before anything starts.
    try:
        if os.environ.get("E2E_DATASET_DIR"):
            from .infra import datasets
            for name in ("gsm8k", "mmlu"):
                datasets.dataset_dir(name)
        for t in _csv(config.getoption("--topology")):
            parse_topology(t)
        for e in _csv(config.getoption("--engine")):
            if e not in ENGINES + ("sglang",):
                raise HarnessError(f"unknown engine {e!r} (known: {', '.join(ENGINES)})")
    except HarnessError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_generate_tests(metafunc):
    if "engine_name" in metafunc.fixturenames:
        m_engines = metafunc.definition.get_closest_marker("engines")
        engines = [e for e in _csv(metafunc.config.getoption("--engine"))
                   if not m_engines or e in m_engines.args]
        metafunc.parametrize("engine_name", [
            pytest.param(e, id=e, marks=getattr(pytest.mark, e)) for e in engines] or [
            pytest.param(None, id="no-engine", marks=pytest.mark.skip(
                reason="no selected engine fits this test"))])
    if "cluster_key" not in metafunc.fixturenames:
        return
    engines = _csv(metafunc.config.getoption("--engine"))
    topologies = [parse_topology(t) for t in _csv(metafunc.config.getoption("--topology"))]
    m_kinds = metafunc.definition.get_closest_marker("topology_kinds")
    m_engines = metafunc.definition.get_closest_marker("engines")
    params = []
    for engine in engines:
        if m_engines and engine not in m_engines.args:
            continue
        for topo in topologies:
            if m_kinds and topo.kind not in m_kinds.args:
                continue
            if engine not in _allowed_engines(topo):
                continue
            marks = [getattr(pytest.mark, engine)]
            if topo.kind != "regular":
                marks.append(getattr(pytest.mark, topo.kind))
            params.append(pytest.param((engine, topo.name), id=f"{engine}-{topo.name}",
                                       marks=marks))
    if not params:
        params = [pytest.param(None, id="no-topology", marks=pytest.mark.skip(
            reason="no selected engine/topology fits this test"))]
    metafunc.parametrize("cluster_key", params, indirect=True, scope="session")


def _allowed_engines(topo) -> tuple[str, ...]:
    from .infra.topology import KIND_ENGINES
    return KIND_ENGINES[topo.kind]


@pytest.fixture(scope="session")
def cluster_key(request):
    return request.param


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Tests that bring up their own topology (own_cluster) run after every shared one, so
    the shared topologies boot once each and never overlap with a private one."""
    topologies = _csv(config.getoption("--topology"))
    engines = _csv(config.getoption("--engine"))
    pos = {id(i): n for n, i in enumerate(items)}
    # pytest's fixture reordering may move a whole module ahead within a group; file order
    # (module path, then position) is what the suites are written for.
    modules = sorted({str(i.path) for i in items})
    mod = {id(i): modules.index(str(i.path)) for i in items}

    def key(item):
        ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key")
        if "own_cluster" in getattr(item, "fixturenames", ()):
            return (2, 0, 0, mod[id(item)], pos[id(item)])
        if not ck:
            return (0, 0, 0, mod[id(item)], pos[id(item)])
        engine, topo = ck
        # Shared topologies in the selected order (so `1` has run before a test compares
        # with it), each group in file order.
        return (1, engines.index(engine) if engine in engines else 99,
                topologies.index(topo) if topo in topologies else 99, mod[id(item)],
                pos[id(item)])

    items.sort(key=key)


@pytest.fixture(scope="session")
def e2e_backend(request) -> str:
    return request.config.getoption("--backend") or default_backend()


class ClusterPool:
    """At most one shared topology alive at a time (memory and cores are scarce): tests are
    grouped by their session-scoped `cluster_key`, so each key boots once. A key whose start
    failed fails its other tests at once with the same error instead of booting again."""

    def __init__(self, config):
        self.config = config
        self.key = None
        self.current: Cluster | None = None
        self.failed: dict = {}

    def get(self, key, make) -> Cluster:
        if key in self.failed:
            raise self.failed[key]
        if self.current is not None and self.key == key and not self.current._stopped:
            return self.current
        self.release()
        c = make()
        self.config._e2e_clusters[c.name] = c
        try:
            c.start()
        except BaseException as e:
            c.stop(verify_strict=False)
            if isinstance(e, HarnessError):
                self.failed[key] = e
            raise
        self.key, self.current = key, c
        print(f"\n{c.plan.describe()}\nready: {c.timing}")
        return c

    def release(self) -> None:
        if self.current is not None:
            c, self.current, self.key = self.current, None, None
            c.stop(verify_strict=False)   # violations fail the session at its end


@pytest.fixture(scope="session")
def cluster_pool(request):
    pool = ClusterPool(request.config)
    yield pool
    pool.release()


def make_cluster(config, engine: str, topology: str, backend: str, **kw) -> Cluster:
    opts = kw.pop("options", None) or options_from_env()
    return Cluster(model=config.getoption("--model"), engine=engine, topology=topology,
                   backend=backend, devices=config.getoption("--devices"), options=opts, **kw)


@pytest.fixture
def cluster(request, cluster_key, e2e_backend, cluster_pool):
    """A running topology behind the gateway, shared by every test of the same key."""
    if cluster_key is None:
        pytest.skip("no topology")
    engine, topo = cluster_key
    if engine == "tokenspeed" and e2e_backend != "cuda":
        pytest.skip("TokenSpeed needs a GPU (backend is cpu)")
    require_devices(request.config, topo, e2e_backend)
    return cluster_pool.get(cluster_key, lambda: make_cluster(request.config, engine, topo,
                                                              e2e_backend))


@pytest.fixture(autouse=True)
def _e2e_idle_after(request):
    """After each test on a shared topology, every role must be idle again (infra/idle.py):
    a leaked request fails the test that leaked it. The leaking topology is then stopped, so
    the next test gets a fresh one instead of inheriting the leak."""
    yield
    if "cluster" not in request.fixturenames or os.environ.get("E2E_IDLE_AFTER_TEST") == "0":
        return
    try:
        c = request.getfixturevalue("cluster")
    except (Exception, pytest.skip.Exception, pytest.fail.Exception):
        return              # the topology did not start (or was skipped): nothing to check
    if c is None or c._stopped or c.gateway is None:
        return
    from .infra.idle import IdleError
    try:
        rep = c.wait_idle()
    except IdleError as e:
        request.getfixturevalue("cluster_pool").release()
        pytest.fail(f"after {request.node.name}: {e}", pytrace=False)
    request.node._e2e_idle_s = round(rep.seconds, 3)


@pytest.fixture
def own_cluster(request, e2e_backend, cluster_pool):
    """For tests that break their topology (fault injection): the shared one is stopped
    first; returns a factory; every cluster it made is stopped after the test."""
    cluster_pool.release()
    made: list[Cluster] = []

    def factory(topology: str, engine: str = "vllm", **kw) -> Cluster:
        if engine == "tokenspeed" and e2e_backend != "cuda":
            pytest.skip("TokenSpeed needs a GPU (backend is cpu)")
        require_devices(request.config, topology, e2e_backend)
        c = make_cluster(request.config, engine, topology, e2e_backend, **kw)
        request.config._e2e_clusters[c.name] = c
        made.append(c)
        return c

    yield factory
    for c in made:
        c.stop(verify_strict=False)


@pytest.fixture(scope="session")
def eval_data():
    """The GSM8K/MMLU folders, checked before any topology is started for an eval."""
    from .infra import datasets
    try:
        return {name: datasets.dataset_dir(name) for name in ("gsm8k", "mmlu")}
    except HarnessError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture
def record(request):
    """A dict the test fills; written as results/tests/<test>.json with the cluster's facts."""
    rec: dict = {"test": request.node.nodeid, "started": time.time()}
    request.node._e2e_recorded = True
    yield rec
    rec["outcome"] = getattr(request.node, "_e2e_outcome", "unknown")
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        rec.setdefault("cluster", c.name)
        rec.update(results.cluster_facts(c))
    request.config._e2e_records.append(rec)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        item._e2e_outcome = rep.outcome
    if (rep.when == "setup" and rep.failed and "record" in getattr(item, "fixturenames", ())
            and not getattr(item, "_e2e_recorded", False)):
        # A fixture before `record` failed (a topology that did not start): still leave a
        # result record, so the failure is in the result files and not only in the log.
        ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key") or ()
        item.config._e2e_records.append({
            "test": item.nodeid, "outcome": "error", "started": time.time(),
            **({"engine": ck[0], "topology": ck[1]} if len(ck) == 2 else {}),
            "error": _error_line(rep)})


def _error_line(rep) -> str:
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(rep.longrepr)
    return text.strip().splitlines()[0][:500] if text and text.strip() else ""


def pytest_sessionfinish(session, exitstatus):
    lifecycle.teardown_all()
    config = session.config
    bad = [f"{n}: {c.teardown_report.verdict()}" for n, c in config._e2e_clusters.items()
           if c.teardown_report is not None and not c.teardown_report.ok]
    config._e2e_teardown_violations = bad
    if bad and os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not config._e2e_records and not config._e2e_clusters:
        return   # nothing end-to-end ran (e.g. unit tests only): no summary to write
    out = results.write_session(config._e2e_records, config._e2e_clusters,
                                wall_s=time.monotonic() - config._e2e_t0)
    config._e2e_summary = out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in getattr(config, "_e2e_teardown_violations", []):
        terminalreporter.write_line(f"TEARDOWN VIOLATION {line}", red=True, bold=True)
    out = getattr(config, "_e2e_summary", None)
    if out and out.get("table"):
        terminalreporter.section("e2e results")
        terminalreporter.write_line(out["table"])
        terminalreporter.write_line(f"results: {out['dir']}")


# -- lanes: device shortfall, opt-in profile, selection accounting, --e2e-min-tests/-no-skips --

def device_shortfall(model: str, topology, backend: str, devices: str | None) -> str | None:
    """One line when this machine has too few devices for `topology` (the planner cannot place
    it, or an AFD topology would have to pack attention and FFN together); None when it fits.
    Other configuration errors (a bad device list, an unknown model) propagate."""
    from .infra.errors import ConfigError
    from .infra.model_specs import get_spec
    from .infra.plan import cpu_cores, make_plan, parse_device_list, resolve_devices
    topo = parse_topology(topology)
    spec = get_spec(model)
    if backend == "cuda":
        devs = resolve_devices(topo, devices)
        need = topo.num_devices * spec.tp
        present = f"{len(devs)} present" + (f" ({','.join(map(str, devs))})" if devs else "")
        try:
            plan = make_plan(topo, spec, "cuda", devices=devs)
        except ConfigError:
            if not devs or len(devs) >= need:   # cuda asked for, no GPU at all: a real error
                raise
            return (f"topology {topo.name!r} with {spec.id} needs {need} GPU(s) at memory "
                    f"fraction {spec.gpu_memory_fraction:g}; {present}")
        if topo.kind == "afd" and plan.packed:
            return (f"topology {topo.name!r} (AFD) needs {need} separate GPU(s) for attention "
                    f"and FFN; {present}")
        return None
    cores = parse_device_list(devices, "--devices") if devices else cpu_cores()
    if topo.num_workers > len(cores):
        return (f"topology {topo.name!r} needs {topo.num_workers} worker(s) with their own "
                f"cores; {len(cores)} core(s) present")
    return None


def require_devices(config, topology, backend: str) -> None:
    """Too few devices: the test is skipped in ordinary lanes, fails under --e2e-no-skips."""
    cache = config.__dict__.setdefault("_e2e_shortfall", {})
    key = (config.getoption("--model"), str(topology), backend, config.getoption("--devices"))
    if key not in cache:
        cache[key] = device_shortfall(*key)
    why = cache[key]
    if why:
        if config.getoption("--e2e-no-skips"):
            pytest.fail(f"too few devices (--e2e-no-skips): {why}", pytrace=False)
        pytest.skip(f"too few devices: {why}")


def pytest_sessionstart(session):
    """The opt-in AFD large-model profile is checked before anything is collected or started:
    every missing prerequisite is one line of the usage error."""
    if os.environ.get("AFD_E2E_LARGE_MODEL") != "1":
        return
    from .infra.engines import afd
    problems = afd.check_profile(afd.profile_from_env(), need_devices=8, large_model=True)
    if problems:
        raise pytest.UsageError("\n".join(f"opt-in AFD large-model profile "
                                          f"(AFD_E2E_LARGE_MODEL=1): {p}" for p in problems))


def _deselect_reason(item, config) -> str:
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
    by_reason = config.__dict__.setdefault("_e2e_deselected", {})
    for item in items:
        by_reason.setdefault(_deselect_reason(item, config), []).append(item)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if rep.skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        collector.config.__dict__.setdefault("_e2e_collect_skips", []).append(
            f"{rep.nodeid or '.'}: {reason}")
    return rep


def _engine_of(item) -> str:
    return next((e for e in ENGINES + ("sglang",) if item.get_closest_marker(e)), "none")


def _engine_counts(items) -> str:
    counts: dict[str, int] = {}
    for item in items:
        e = _engine_of(item)
        counts[e] = counts.get(e, 0) + 1
    return " ".join(f"{e}={n}" for e, n in sorted(counts.items())) or "-"


def selection_report(session) -> list[str]:
    config = session.config
    by_reason: dict = getattr(config, "_e2e_deselected", {})
    deselected = [i for items in by_reason.values() for i in items]
    lane = os.environ.get("E2E_LANE")
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
    skips = getattr(config, "_e2e_collect_skips", [])
    if config.getoption("--e2e-no-skips") and skips:
        pytest.exit(f"--e2e-no-skips: {len(skips)} skipped at collection: " + "; ".join(skips),
                    returncode=pytest.ExitCode.TESTS_FAILED)
    need = config.getoption("--e2e-min-tests")
    if need is not None and len(session.items) < need:
        lane = os.environ.get("E2E_LANE")
        pytest.exit(f"{f'lane {lane}: ' if lane else ''}{len(session.items)} test(s) selected, "
                    f"fewer than --e2e-min-tests {need} (check paths, -m, E2E_ENGINES, "
                    "E2E_TOPOLOGIES)", returncode=pytest.ExitCode.TESTS_FAILED)


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
