"""pytest glue over the library: options, the parametrized cluster fixture with engine/topology
markers per case, the tests' order and their pytest-xdist groups, the topologies of a process
(one at a time), the fixtures a test takes them by, and signal handling.
Lanes: pytest_lanes.py; the baseline's evidence: pytest_baseline.py; pytest-xdist:
pytest_xdist.py; records and result files: pytest_results.py (all loaded from here).
Session state: `config.stash` (pytest_state.py)."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

pytest.register_assert_rewrite("e2e_test.pytest_lanes", "e2e_test.pytest_baseline",
                               "e2e_test.pytest_xdist", "e2e_test.pytest_results")

from .infra import startup
from .infra.cluster import signals as lifecycle
from .infra.cluster.cluster import Cluster
from .infra.cluster.idle import IdleError
from .infra.engines import DEFAULT_ENGINE, EngineOptions, engine_names, kind_engines
from .infra.errors import HarnessError
from .infra.lifecycle import exclusive as device_lock
from .infra.specs import settings
from .infra.specs import topology as topologies
from .infra.specs.model_specs import DEFAULT_MODEL, get_spec
from .infra.specs.settings import options_from_env
from .infra.specs.topology import Topology
from .infra.verdicts import datasets
from .pytest_baseline import baselines_of, scratch_dir
from .pytest_lanes import device_shortfall, require_devices, reusable_plan  # noqa: F401  (public helpers)
from .pytest_state import RECORD, state
from .pytest_xdist import cluster_kw

pytest_plugins = ["e2e_test.pytest_lanes", "e2e_test.pytest_baseline", "e2e_test.pytest_xdist",
                  "e2e_test.pytest_results"]
DEFAULT_TOPOLOGIES = ",".join(settings.SETTINGS["E2E_TOPOLOGIES"].default)


def pytest_addoption(parser):
    g = parser.getgroup("e2e", "end-to-end harness")
    # Defaults are the variables' raw text; pytest_configure validates them (settings.py).
    g.addoption("--engine", default=settings.raw("E2E_ENGINES") or ",".join(engine_names()),
                help="engines to parametrize over (comma list; env E2E_ENGINES)")
    g.addoption("--topology", default=settings.raw("E2E_TOPOLOGIES") or DEFAULT_TOPOLOGIES,
                help="topologies to parametrize over (comma list; an option such as p.node=0 "
                     "belongs to the topology before it; env E2E_TOPOLOGIES)")
    g.addoption("--model", default=settings.raw("E2E_MODEL") or DEFAULT_MODEL,
                help="model id from the registry (env E2E_MODEL)")
    g.addoption("--devices", default=settings.raw("E2E_DEVICES"),
                help="ordered device list, e.g. 0,1 (env E2E_DEVICES)")
    g.addoption("--backend", default=settings.raw("E2E_BACKEND"),
                help="cpu or cuda (default: cuda when NVML sees a GPU)")
    g.addoption("--e2e-shuffle", type=int, default=None, metavar="SEED",
                help="run the tests of each topology's group (and those with none) in a random "
                     "order from SEED: the check that no test leans on another's leftovers")
    g.addoption("--launcher", default=None,
                help="local (processes on this host) or ray (roles as Ray actors on the nodes "
                     "of the Ray cluster at E2E_RAY_ADDRESS; docs/multinode.md); env "
                     "E2E_LAUNCHER")


def _csv(v: str) -> list[str]:
    return [x.strip() for x in (v or "").split(",") if x.strip()]


def _topologies(config) -> list[Topology]:
    """--topology as Topologies, parsed once per session (options stay with their topology:
    topology.split_list); these objects travel in the cluster keys to the Cluster."""
    st = state(config)
    if st.topologies is None:
        st.topologies = [topologies.parse(t)
                         for t in topologies.split_list(config.getoption("--topology"))]
    return st.topologies


def _given(config, option: str, var: str) -> str | None:
    """The option's value when it was given on the command line (an error then names the
    option); None when it is the variable's value or the default (settings names the variable)."""
    v = config.getoption(option)
    if v is None or v == settings.raw(var) or v == _DEFAULTS.get(option):
        return None
    return v


_DEFAULTS = {"--engine": ",".join(engine_names()), "--topology": DEFAULT_TOPOLOGIES,
             "--model": settings.DEFAULT_MODEL}


def pytest_configure(config):
    lifecycle.install()
    state(config)
    # Bad input: one line per problem, exit 2, before anything starts (settings.py).
    try:
        startup.startup(backend=_given(config, "--backend", "E2E_BACKEND"),
                         devices=_given(config, "--devices", "E2E_DEVICES"),
                         model=_given(config, "--model", "E2E_MODEL"),
                         engines=_given(config, "--engine", "E2E_ENGINES"),
                         topologies=_given(config, "--topology", "E2E_TOPOLOGIES"))
        if getattr(config, "workerinput", None) is None:
            settings.results_dir()     # this session's own folder (xdist workers inherit it)
        if config.getoption("--launcher"):    # every Cluster of the session reads it
            os.environ["E2E_LAUNCHER"] = settings.value(
                "E2E_LAUNCHER", config.getoption("--launcher"), "--launcher")
        if settings.get("E2E_DATASET_DIR"):
            for name in ("gsm8k", "mmlu"):
                datasets.dataset_dir(name)
    except HarnessError as e:
        pytest.exit(str(e), returncode=2)


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
    selected = _topologies(metafunc.config)
    m_kinds = metafunc.definition.get_closest_marker("topology_kinds")
    m_engines = metafunc.definition.get_closest_marker("engines")
    m_profile = metafunc.definition.get_closest_marker("cluster_profile")
    m_no_native = metafunc.definition.get_closest_marker("not_native_baseline")
    profile = cluster_profile(m_profile.args[0]).name if m_profile else None
    spec = get_spec(metafunc.config.getoption("--model"))
    params = []
    for engine in engines:
        if m_engines and engine not in m_engines.args:
            continue
        for topo in selected:
            if m_kinds and topo.kind not in m_kinds.args:
                continue
            if m_no_native and topo.native_baseline:
                continue     # nothing to check on AFD's native baseline: never selected there
            if engine not in kind_engines().get(topo.kind, ()):
                continue
            if not spec.supports(engine, topo.kind):
                continue     # the model's registry entry does not run this pair
            marks = [getattr(pytest.mark, engine)]
            if topo.kind != "regular":
                marks.append(getattr(pytest.mark, topo.kind))
            key = (engine, topo) + ((profile,) if profile else ())
            params.append(pytest.param(key, id=f"{engine}-{topo.name}", marks=marks))
    if not params:
        params = [pytest.param(None, id="no-topology", marks=pytest.mark.skip(
            reason="no selected engine/topology fits this test"))]
    metafunc.parametrize("cluster_key", params, indirect=True, scope="session")


@pytest.fixture(scope="session")
def cluster_key(request):
    return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Every test of a shared topology joins its pytest-xdist group (the key's name): under
    `--dist loadgroup` one worker runs them all, so each key boots once per session. Marked
    first: xdist's worker names the groups in the node ids from these marks."""
    for item in items:
        ck = _shared_key(item)
        if ck:
            item.add_marker(pytest.mark.xdist_group(name=group_name(ck)))


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_order(session, config, items):
    """The order a process runs the tests in (and the order of the groups pytest-xdist hands
    out): tests with no topology, then the shared topologies, those whose evidence other tests
    need (a baseline topology: pytest_baseline.py) first, then the rest in the selected
    order, each profile of a topology after its plain group; within a group the tests judged
    against a baseline after the others and those that break it (disposable_cluster) last;
    then the tests with topologies of their own (own_cluster). Only
    efficiency hangs on it (each key boots once, a baseline before its judges): no test
    reads what another left. --e2e-shuffle SEED shuffles the tests within each group (the
    shuffle check, e2e_test/router/test_shuffle.py)."""
    selected = _topologies(config)
    engines = _csv(config.getoption("--engine"))
    b = baselines_of(config)
    b.collected(items, selected)
    pos = {id(i): n for n, i in enumerate(items)}
    # pytest's fixture reordering may move a whole module ahead within a group; file order
    # (module path, then position) is what the suites are written for.
    modules = sorted({str(i.path) for i in items})
    mod = {id(i): modules.index(str(i.path)) for i in items}

    def key(item):
        ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key")
        at = (mod[id(item)], pos[id(item)])
        if "own_cluster" in getattr(item, "fixturenames", ()):
            return (2, 0, 0, 0, "", 0, 0, *at)
        if not ck:
            return (0, 0, 0, 0, "", 0, 0, *at)
        engine, topo, *profile = ck
        return (1, engines.index(engine) if engine in engines else 99,
                0 if not profile and (engine, topo.name) in b.needs else 1,
                selected.index(topo) if topo in selected else 99, profile[0] if profile else "",
                1 if "disposable_cluster" in item.fixturenames else 0,
                1 if item.get_closest_marker("baseline") else 0, *at)

    items.sort(key=key)
    seed = config.getoption("--e2e-shuffle")
    if seed is not None:
        rng = random.Random(seed)
        out = []
        for _, group in itertools.groupby(items, key=lambda i: key(i)[:5]):
            group = list(group)
            rng.shuffle(group)
            out += group
        items[:] = out


def _shared_key(item):
    """The key of a test's topology (engine, topology, profile...): its group's, which a
    test that breaks it (disposable_cluster) takes last; None for a test with no topology or
    with topologies of its own (own_cluster)."""
    ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key")
    if not ck or "own_cluster" in getattr(item, "fixturenames", ()):
        return None
    return ck


def group_name(key) -> str:
    """engine/topology[/profile]: the pytest-xdist group of a shared key (no `]`: xdist reads
    the group after the last `@` of a node id only where it follows the parameters' `]`)."""
    engine, topo, *profile = key
    return "/".join([engine, topo.name, *profile])


@dataclass(frozen=True)
class ClusterProfile:
    """A named variant of a shared topology for the tests that ask for it with
    `@pytest.mark.cluster_profile(NAME)`: booted once for all of them, like a plain one."""
    name: str
    why: str
    options: Callable[[], EngineOptions]      # read when the topology boots (settings)


PROFILES = {p.name: p for p in [
    ClusterProfile(
        "window", "the engine's running window (--max-num-seqs) at E2E_BURST_WINDOW, booted "
        "eager: the small-window bursts, and the fault tests that break a topology after "
        "them (little traffic: eager is cheaper end to end, docs/lanes.md)",
        lambda: options_from_env(max_num_seqs=settings.get("E2E_BURST_WINDOW"),
                                 enforce_eager=True)),
    ClusterProfile(
        "kv_corrupt", "the decode worker's KV connector corrupts what it received, the kind "
        "switched at run time by the test (engines/kv_corrupt.py): the negative controls of "
        "the PD verdicts (test_kv_corrupt.py); otherwise booted as the plain topology",
        lambda: options_from_env(engine_opts={"kv_corrupt": "runtime"})),
]}


def cluster_profile(name: str) -> ClusterProfile:
    if name not in PROFILES:
        raise pytest.UsageError(f"cluster_profile({name!r}): no such profile "
                                f"(known: {', '.join(sorted(PROFILES))})")
    return PROFILES[name]


@pytest.fixture(scope="session")
def e2e_backend(request) -> str:
    return startup.resolve_backend(request.config.getoption("--backend"))


class ClusterPool:
    """The shared topologies of this process, one at a time: a test gets its key's topology,
    booted where another key's was up (that one is stopped first), and the topology stops
    after its group's last test here (pytest_runtest_teardown). A key whose start failed fails
    its other tests at once with the same error instead of booting again. Under pytest-xdist
    each worker has its own pool; a key's group runs on one worker (`--dist loadgroup`)."""

    def __init__(self, config):
        self.config = config
        self.key = None
        self.current: Cluster | None = None
        self.failed: dict = {}

    def get(self, key, make=None) -> Cluster:
        if key in self.failed:
            raise self.failed[key]
        if self.current is not None and self.key == key and not self.current.stopped:
            try:
                self.current.check_alive()      # a worker died since the last test
            except HarnessError as e:
                self.failed[key] = e
                self.release()
                raise
            return self.current
        self.release()
        c = (make or (lambda: _make_for_key(self.config, key)))()
        state(self.config).clusters[c.name] = c
        try:
            baselines_of(self.config).booting(key, c.start)   # its evidence, if a baseline
        except BaseException as e:
            c.stop(verify_strict=False)
            if isinstance(e, HarnessError):
                self.failed[key] = e
            raise
        self.key, self.current = key, c
        print(f"\n{c.plan.describe()}\nready: {c.timing}")
        return c

    def get_baseline(self, engine: str, topology: str) -> Cluster:
        """The baseline topology `topology` of `engine` (its evidence: pytest_baseline.py),
        as a shared topology: the one this pool holds, or booted now."""
        topo = next((t for t in _topologies(self.config) if t.name == topology),
                    None) or topologies.parse(topology)
        backend = startup.resolve_backend(self.config.getoption("--backend"))
        require_devices(self.config, topo, backend, engine)
        return self.get((engine, topo))

    def take(self, key) -> Cluster:
        """The topology of `key` out of the pool, for a test that breaks it (the caller stops
        it): the current one, else one booted now, on a GPU with its restarts held (their
        imports done with the boot: 9 s of an 18 s restart on an H200; not on CPU, whose cores
        a held interpreter would take)."""
        backend = startup.resolve_backend(self.config.getoption("--backend"))
        c = self.get(key, lambda: _make_for_key(self.config, key,
                                                hold_restarts=backend == "cuda"))
        self.current, self.key = None, None
        return c

    def release(self):
        """Stop the current topology; its teardown report (None when none was up)."""
        if self.current is not None:
            c, self.current, self.key = self.current, None, None
            return c.stop(verify_strict=False)      # violations fail the session at its end
        return None


@pytest.fixture(scope="session")
def cluster_pool(request):
    pool = state(request.config).pool = ClusterPool(request.config)
    yield pool
    pool.release()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's fixtures are torn down: the shared topology is stopped where the next
    test of this process asks for another (or none): its group ended here."""
    pool = state(item.config).pool
    if pool is not None and pool.key is not None and (
            nextitem is None or _shared_key(nextitem) != pool.key):
        pool.release()


def _make_for_key(config, key, **kw) -> Cluster:
    """The Cluster of a shared key (engine, topology, profile...), as the `cluster` fixture
    makes it."""
    engine, topo, *profile = key
    if profile:
        kw["options"] = cluster_profile(profile[0]).options()
    backend = startup.resolve_backend(config.getoption("--backend"))
    return make_cluster(config, engine, topo, backend, **kw)


def make_cluster(config, engine: str, topology: Topology | str, backend: str,
                 **kw) -> Cluster:
    """A Cluster of the session's model and devices; on the local launcher it takes the plan
    the session placed already (pytest_lanes.session_plan) instead of placing again."""
    opts = kw.pop("options", None) or options_from_env()
    topology = topologies.parse(topology)
    if "launcher" not in kw and settings.get("E2E_LAUNCHER") == "local":
        kw.setdefault("plan", reusable_plan(config, topology, backend, engine))
    kw.update(cluster_kw(config, engine, topology, kw.get("plan")))
    return Cluster(model=config.getoption("--model"), engine=engine, topology=topology,
                   backend=backend, devices=config.getoption("--devices"), options=opts, **kw)


@pytest.fixture
def cluster(request, cluster_key, e2e_backend, cluster_pool):
    """A running topology behind the gateway, shared by every test of the same key."""
    if cluster_key is None:
        pytest.skip("no topology")
    if "baseline" in request.fixturenames:      # its evidence first: booting the baseline
        request.getfixturevalue("baseline")     # topology would stop this test's
    engine, topo, *_ = cluster_key
    require_devices(request.config, topo, e2e_backend, engine)
    c = cluster_pool.get(cluster_key)
    # For the idle check after the test (_idle_after): by then this fixture is torn down and
    # pytest (8 and later) refuses its value ("not available ... already been torn down").
    request.node._e2e_cluster = c
    return c


@pytest.fixture
def disposable_cluster(request, cluster_key, e2e_backend, cluster_pool):
    """A topology of the test's key that no test gets after it: for a test that breaks it.
    The group's topology where this process holds it (such a test runs after its group's
    other tests), else one booted for it; stopped after the test either way (the test may
    stop it first, to judge its teardown)."""
    if cluster_key is None:
        pytest.skip("no topology")
    engine, topo, *_ = cluster_key
    require_devices(request.config, topo, e2e_backend, engine)
    c = cluster_pool.take(cluster_key)
    request.node._e2e_cluster = c           # for its record
    yield c
    if not c.stopped:
        c.stop(verify_strict=False)


@pytest.fixture(autouse=True)
def _e2e_idle_after(request):
    """After each test on a shared topology, every role must be idle again (infra/cluster/idle.py):
    a leaked request fails the test that leaked it. The leaking topology is then stopped, so
    the next test gets a fresh one instead of inheriting the leak."""
    yield
    if "cluster" in request.fixturenames:
        _idle_after(request)


@pytest.fixture(autouse=True)
def _e2e_device_shared(request):
    """Every test on a device (a topology or the baseline's evidence) holds the session's
    device lock shared for its setup, call and teardown; a test that takes `exclusive` holds
    it alone (infra/lifecycle/exclusive.py)."""
    names = set(request.fixturenames)
    if "exclusive" in names or not {"cluster", "baseline", "own_cluster",
                                    "disposable_cluster"} & names:
        yield
        return
    with device_lock.DeviceLock(scratch_dir(request.config)).shared():
        yield


@pytest.fixture
def exclusive(request):
    """The device to this test alone: no other process's test runs (or boots) during its
    call, for what is timed against an engine's own pace (a cancel, an idle check). Its own
    topology is booted first, beside the others."""
    for name in ("cluster", "disposable_cluster"):
        if name in request.fixturenames:
            request.getfixturevalue(name)
    with device_lock.DeviceLock(scratch_dir(request.config)).exclusive():
        yield


def _idle_after(request) -> None:
    if not settings.get("E2E_IDLE_AFTER_TEST"):
        return
    # The test's topology, as its `cluster` fixture handed it out. Asking the fixture again
    # here (getfixturevalue) raised on pytest 8+, since it is torn down before this autouse
    # fixture, and the error reads as a topology that never started, so the check would
    # never run (tests/test_idle_after_test.py).
    c = getattr(request.node, "_e2e_cluster", None)
    if c is None or c.stopped or c.gateway is None:
        return              # the topology did not start (or was skipped): nothing to check
    try:
        rep = c.wait_idle()
    except IdleError as e:
        request.getfixturevalue("cluster_pool").release()
        pytest.fail(f"after {request.node.name}: {e}", pytrace=False)
    rec = request.node.stash.get(RECORD, None)
    if rec is not None:     # the evidence that the check ran, in the result files
        rec["idle_after_s"] = round(rep.seconds, 3)


@pytest.fixture
def own_cluster(request, e2e_backend, cluster_pool):
    """For tests that break their topology (fault injection): the shared one is stopped
    first; returns a factory; every cluster it made is stopped after the test."""
    if "baseline" in request.fixturenames:      # its evidence first (it may boot `1`)
        request.getfixturevalue("baseline")
    cluster_pool.release()
    made: list[Cluster] = []

    def factory(topology: str, engine: str = DEFAULT_ENGINE, **kw) -> Cluster:
        topology = topologies.parse(topology)
        require_devices(request.config, topology, e2e_backend, engine)
        c = make_cluster(request.config, engine, topology, e2e_backend, **kw)
        state(request.config).clusters[c.name] = c
        made.append(c)
        return c

    yield factory
    for c in made:
        c.stop(verify_strict=False)


@pytest.fixture(scope="session")
def eval_data():
    """The GSM8K/MMLU folders, checked before any topology is started for an eval."""
    try:
        return {name: datasets.dataset_dir(name) for name in ("gsm8k", "mmlu")}
    except HarnessError as e:
        pytest.fail(str(e), pytrace=False)


