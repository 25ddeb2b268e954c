"""pytest glue, a few lines over the library: options, parametrized cluster fixture with
engine/topology markers per case, result records, signal handling and the summary table.
Lane guards and selection accounting: pytest_lanes.py (loaded from here). Session state:
`config.stash` (pytest_state.py)."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

pytest.register_assert_rewrite("e2e_test.pytest_lanes", "e2e_test.pytest_baseline")

from .infra import startup
from .infra.cluster import progress
from .infra.cluster import signals as lifecycle
from .infra.cluster.cluster import Cluster, waiting_on_boot
from .infra.cluster.idle import IdleError
from .infra.engines import (
    DEFAULT_ENGINE,
    EngineOptions,
    engine_names,
    for_topology,
    kind_engines,
)
from .infra.errors import HarnessError
from .infra.lifecycle import teardown
from .infra.lifecycle.launcher import Baseline, LocalLauncher
from .infra.reports import results, time_report
from .infra.specs import coboot, devices, settings
from .infra.specs import topology as topologies
from .infra.specs.model_specs import DEFAULT_MODEL, get_spec
from .infra.specs.settings import options_from_env
from .infra.specs.topology import Topology
from .infra.verdicts import datasets
from .pytest_baseline import baselines_of
from .pytest_lanes import device_shortfall, require_devices, reusable_plan  # noqa: F401  (public helpers)
from .pytest_state import OUTCOME, RECORD, RECORDED, state

pytest_plugins = ["e2e_test.pytest_lanes", "e2e_test.pytest_baseline"]
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


_PENDING: list[tuple] = []     # (config, line) of other threads, for the main thread to write


def _live_lines(config):
    """Progress lines (infra/cluster/progress.py) past pytest's output capture: a lane's log shows
    them while a topology boots or an eval runs, not only when a test fails. Only the main
    thread may suspend the capture (pytest's capture is not thread-safe): a line from a boot
    or a pass ahead waits in _PENDING until the main thread writes it (flush_lines: at each
    test's start and end, and every second while it waits for a boot or a pass)."""
    def write(line: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            _PENDING.append((config, line))
            return
        flush_lines()
        _write_line(config, line)
    return write


def flush_lines() -> None:
    """Write the other threads' pending progress lines (main thread only)."""
    while _PENDING:
        _write_line(*_PENDING.pop(0))


def wait_flushing(fut):
    """fut.result(), writing the other threads' progress lines every second meanwhile."""
    while True:
        try:
            return fut.result(timeout=1.0)
        except FutureTimeout:
            if threading.current_thread() is threading.main_thread():
                flush_lines()


def _write_line(config, line: str) -> None:
    capman = config.pluginmanager.get_plugin("capturemanager")
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if capman is None or tr is None:
        print(line, file=sys.stderr, flush=True)
        return
    with capman.global_and_fixture_disabled():
        tr.write_line(line)


def pytest_runtest_logstart(nodeid, location):
    flush_lines()


def pytest_runtest_logfinish(nodeid, location):
    flush_lines()


def pytest_configure(config):
    lifecycle.install()
    state(config)
    previous = progress.sink            # a nested session (pytester) gives it back at its end
    progress.set_sink(_live_lines(config))
    config.add_cleanup(lambda: progress.set_sink(previous))
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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Tests on a shared topology run grouped by its key (engine, topology, profile), so each
    key boots once; within a group, tests marked `breaks_cluster` run last (after them the
    topology is stopped), after a test marked `restarting` (it leaves a worker restarting in
    the background for them). Tests that bring up their own topology (own_cluster) run after
    every shared one, so a private topology never overlaps with a shared one."""
    selected = _topologies(config)
    engines = _csv(config.getoption("--engine"))
    pos = {id(i): n for n, i in enumerate(items)}
    # pytest's fixture reordering may move a whole module ahead within a group; file order
    # (module path, then position) is what the suites are written for.
    modules = sorted({str(i.path) for i in items})
    mod = {id(i): modules.index(str(i.path)) for i in items}

    def key(item):
        ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key")
        if "own_cluster" in getattr(item, "fixturenames", ()):
            return (2, 0, 0, "", 0, mod[id(item)], pos[id(item)])
        if not ck:
            return (0, 0, 0, "", 0, mod[id(item)], pos[id(item)])
        engine, topo, *profile = ck
        # Shared topologies in the selected order (so `1` has run before a test compares
        # with it), each profile of a topology right after its plain group, each group in
        # file order with the tests that break it at its end.
        breaks = 1 if item.get_closest_marker("breaks_cluster") else 0
        restarting = 1 if item.get_closest_marker("restarting") else 0
        return (1, engines.index(engine) if engine in engines else 99,
                selected.index(topo) if topo in selected else 99,
                profile[0] if profile else "", breaks, restarting, mod[id(item)], pos[id(item)])

    items.sort(key=key)
    # The shared topologies in the order their tests run: what the lane-level placement
    # (coboot.py, decide_schedule) decides over.
    keys = []
    for item in items:
        ck = _shared_key(item)
        if ck and ck not in keys:
            keys.append(ck)
    st = state(config)
    st.cluster_keys = keys
    st.restarting_keys = {ck for i in items
                          if (ck := _shared_key(i)) and i.get_closest_marker("restarting")}
    baselines_of(config).collected(items, selected)
    if not keys:
        return
    try:
        st.schedule = decide_schedule(config)
    except HarnessError:    # e.g. cuda asked of a machine with no GPU: the tests' own fixtures
        return              # say it (the pool decides again at the first test, and raises)
    st.key_items = {}
    for item in items:
        if (ck := _shared_key(item)):
            st.key_items.setdefault(ck, []).append(item.nodeid)


def _shared_key(item):
    """The shared topology's key of a test (engine, topology, profile...); None for a test
    with no shared topology or with its own (own_cluster)."""
    ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key")
    if not ck or "own_cluster" in getattr(item, "fixturenames", ()):
        return None
    return ck


def decide_held(config, sched: coboot.BootSchedule) -> tuple[tuple, str]:
    """Which shared topologies start their workers' restarts ahead, held (coboot.
    held_restarts; Cluster.hold_restarts), and why; E2E_HOLD_RESTARTS=0 says none."""
    st = state(config)
    if not settings.get("E2E_HOLD_RESTARTS"):
        return (), "E2E_HOLD_RESTARTS=0"
    if settings.get("E2E_LAUNCHER") != "local":
        return (), "a held interpreter starts on this host only (E2E_LAUNCHER=local)"
    backend = startup.resolve_backend(config.getoption("--backend"))
    keyed = []
    for k in st.cluster_keys:
        engine, topo, *_ = k
        plan = reusable_plan(config, topologies.parse(topo), backend, engine)
        if plan is not None:
            keyed.append((k, plan))
    return coboot.held_restarts(sched, keyed, st.restarting_keys, backend,
                                len(devices.affinity()))


def decide_schedule(config) -> coboot.BootSchedule:
    """The lane-level placement of the session's shared topologies (coboot.py), from the keys
    collected, their plans, the backend, the GPUs' free memory and the cores;
    E2E_BOOT_SCHEDULE overrides. Decided at collection: the order of the tests follows it."""
    keys = list(state(config).cluster_keys)
    backend = startup.resolve_backend(config.getoption("--backend"))
    how = settings.get("E2E_BOOT_SCHEDULE")
    if how == "serial":
        return coboot.serial(keys, "E2E_BOOT_SCHEDULE=serial")
    keyed = []
    for k in keys:
        engine, topo, *_ = k
        plan = None
        if settings.get("E2E_LAUNCHER") == "local":
            plan = reusable_plan(config, topologies.parse(topo), backend, engine)
        if plan is None:
            return coboot.serial(keys, f"{coboot.key_name(k)} is placed when it boots "
                                       "(nodes, launcher or too few devices): one at a time")
        keyed.append((k, plan))
    cores = len(devices.affinity())
    if how == "together":
        return coboot.BootSchedule("together", (tuple(keys),) if keys else (),
                                   "E2E_BOOT_SCHEDULE=together")
    gpus = sorted({g for _, p in keyed for g in p.devices}) if backend == "cuda" else []
    free = devices.gpu_free_share(gpus) if backend == "cuda" else None
    spec = get_spec(config.getoption("--model"))
    drivers = {k: for_topology(k[0], topologies.parse(k[1])) for k in keys}
    alone = {k: why for k in keys if (why := drivers[k].alone_reason(spec))}
    held = {k: h for k, p in keyed if (h := drivers[k].held_share(p))}
    return coboot.schedule(keyed, backend, free, cores, alone=alone, held=held)


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
    """The session's shared topologies. Tests are grouped by their session-scoped
    `cluster_key`, so each key boots once. A key whose start failed fails its other tests at
    once with the same error instead of booting again.

    How they boot is the lane-level placement's (coboot.py, decided at the first request from
    every key the session collected, their plans, the backend, the GPUs' free memory and the
    cores; E2E_BOOT_SCHEDULE overrides): serial keeps one topology alive at a time (memory and
    cores are scarce, the CPU lane); together or in waves, the first request of a wave starts
    every topology of that wave at once, each in its own thread, and each test waits only for
    its own topology, which fails alone with its own error. A topology is stopped when the
    tests move on to the next key, as in serial; the next wave starts once the earlier ones
    are stopped, and once a wave's last topology has stopped its devices must be back at the
    wave's baseline (each topology's own teardown checked only its own processes)."""

    def __init__(self, config):
        self.config = config
        self.key = None
        self.current: Cluster | None = None
        self.failed: dict = {}
        self.schedule: coboot.BootSchedule | None = None
        self.boots: dict = {}             # key -> (Cluster, Future) booting or up, co-booted
        self.waves_started: set[int] = set()
        self.wave_base: dict[int, Baseline] = {}
        self.wave_left: dict[int, set] = {}      # wave -> keys not yet stopped
        self._executor: ThreadPoolExecutor | None = None
        self.measured: set = set()        # co-booted clusters whose evidence was measured

    # -- the schedule ---------------------------------------------------------------------------
    def boot_schedule(self) -> coboot.BootSchedule:
        if self.schedule is None:
            st = state(self.config)
            if st.schedule is None:        # keys known only now (a nested or partial session)
                st.schedule = decide_schedule(self.config)
            self.schedule = st.schedule
            st.boot_schedule = self.schedule.to_dict()
            st.held_keys, why = decide_held(self.config, self.schedule)
            st.boot_schedule["held"] = {"keys": [coboot.key_name(k) for k in st.held_keys],
                                        "reason": why}
            print(f"\nboot schedule: {self.schedule.mode}: {self.schedule.reason}; "
                  f"restarts {why}")
        return self.schedule

    def _cobooted(self, key) -> bool:
        sched = self.boot_schedule()
        return sched.together and any(key in w and len(w) > 1 for w in sched.waves)

    # -- getting a topology -----------------------------------------------------------------------
    def get(self, key, make) -> Cluster:
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
        if self._cobooted(key) and self._wave_open(key):
            self._set_aside()
            return self._get_cobooted(key)
        self.release()
        self._stop_waves_before(None)
        c = make()
        state(self.config).clusters[c.name] = c
        try:
            baselines_of(self.config).booting(key, c.start)
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
        key = (engine, topo)
        return self.get(key, lambda: _make_for_key(self.config, key))

    def _wave_open(self, key) -> bool:
        """Its wave is still to start, or something of it is still up (a topology stopped
        after a test broke it is then booted again beside the others; when nothing of its
        wave is up any more it boots alone, as in serial)."""
        w = self.schedule.wave_of(key)
        return w not in self.waves_started or bool(self.wave_left.get(w))

    def tests_left(self, key) -> bool:
        """Whether a test of `key` is still to run (the plugin's final order)."""
        st = state(self.config)
        return any(n not in st.finished for n in st.key_items.get(key, ()))

    def _set_aside(self) -> None:
        """Moving to another co-booted topology: the current one stays up while a test of it
        is still to come (a wave's tests interleave where passes run ahead), else stopped."""
        if self.current is not None and not self.current.stopped and self.tests_left(self.key):
            self.current, self.key = None, None
        else:
            self.release()

    def finished(self, item) -> None:
        """After each test: a shared topology whose last test this was is stopped now."""
        st = state(self.config)
        st.finished.add(item.nodeid)
        key = _shared_key(item)
        if key is None or self.tests_left(key):
            return
        if self.key == key:
            self.release()
        elif key in self.boots and not self.boots[key][0].stopped:
            c, fut = self.boots[key]
            if fut.done():
                self._stop(key, c)

    def _get_cobooted(self, key) -> Cluster:
        w = self.schedule.wave_of(key)
        if w not in self.waves_started:
            self._start_wave(w)
        c, fut = self.boots[key]
        if not c.stopped and fut.done() and fut.exception() is None and c.gateway is not None:
            try:                        # up since an earlier test of it: a worker may have died
                c.check_alive()
            except HarnessError as e:
                self.failed[key] = e
                self._stop(key, c)
                raise
        if c.stopped:      # stopped after a test broke it or leaked: a fresh one, beside the rest
            c = _make_for_key(self.config, key, shared_devices=True,
                              plan=self._wave_plan(key, w))
            state(self.config).clusters[c.name] = c
            fut = self._executor.submit(c.start)
            self.boots[key] = (c, fut)
            self.wave_left[w].add(key)
        try:
            with waiting_on_boot(c.timing):
                wait_flushing(fut)
        except BaseException as e:
            self._stop(key, c)
            if isinstance(e, HarnessError):
                self.failed[key] = e
            raise
        self.key, self.current = key, c
        if c.name not in self.measured:    # its evidence, where it is a baseline topology
            self.measured.add(c.name)
            baselines_of(self.config).booting(key, lambda: c)
        print(f"\n{c.plan.describe()}\nready: {c.timing} (booted with "
              f"{', '.join(coboot.key_name(k) for k in self.schedule.waves[w] if k != key)})")
        return c

    def _wave_plan(self, key, w: int):
        """The session's plan of `key`, as its engine takes it beside the rest of wave `w`
        (Engine.beside: e.g. TokenSpeed's utilization is the wave's total share)."""
        engine, topo, *_ = key
        t = topologies.parse(topo)
        backend = startup.resolve_backend(self.config.getoption("--backend"))
        plan = reusable_plan(self.config, t, backend, engine)
        if plan is None:
            return None
        return for_topology(engine, t).beside(plan, self.schedule.shares.get(w, {}))

    def _start_wave(self, w: int) -> None:
        """Every topology of wave `w` at once: constructed here (ports, plans), started each
        in a thread. Earlier waves are stopped first: the waves were packed to fit one by one."""
        self._stop_waves_before(w)
        self.waves_started.add(w)
        keys = self.schedule.waves[w]
        st = state(self.config)
        clusters = []
        for k in keys:
            c = _make_for_key(self.config, k, shared_devices=True, plan=self._wave_plan(k, w))
            st.clusters[c.name] = c
            clusters.append((k, c))
        gpus = tuple(sorted({g for _, c in clusters for g in
                             (c.plan.devices if c.backend == "cuda" else ())}))
        self.wave_base[w] = LocalLauncher().baseline(gpus)
        self.wave_left[w] = set(keys)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="e2e-boot")
        for k, c in clusters:
            self.boots[k] = (c, self._executor.submit(c.start))
        print(f"\nbooting together: {', '.join(coboot.key_name(k) for k in keys)}")

    # -- stopping -----------------------------------------------------------------------------------
    def _stop(self, key, c: Cluster):
        """Stop one topology; for a co-booted one, once its wave's last is down, the wave's
        devices against the wave's baseline (added to this last topology's report)."""
        rep = c.stop(verify_strict=False)     # violations fail the session at its end
        if key in self.boots:
            w = self.schedule.wave_of(key)
            left = self.wave_left.get(w, set())
            left.discard(key)
            if not left and w in self.wave_base:
                self._check_wave(w, c)
        return rep

    def _check_wave(self, w: int, last: Cluster) -> None:
        base = self.wave_base.pop(w)
        rep = last.teardown_report
        if rep is None:
            return
        wave = teardown.TeardownReport()
        teardown.check_gpu(wave, base.gpu_mib)
        missing = sorted(set(base.gpus) - set(base.gpu_mib))
        if missing:          # a GPU check over nothing: never clean
            wave.unverified.append(f"GPU memory of GPU(s) {missing}: NVML read nothing before "
                                   "the wave, so there was no baseline to compare with")
        rep.unverified = rep.unverified + wave.unverified
        removed, left = teardown.clean_shm(base.shm)
        rep.shm_removed, rep.shm_left = rep.shm_removed + removed, rep.shm_left + left
        if wave.gpu_checked:
            rep.gpu_checked, rep.gpu_wait_s = True, wave.gpu_wait_s
            rep.gpu_settle_s = wave.gpu_settle_s
            rep.gpu_leaks = {**rep.gpu_leaks, **wave.gpu_leaks}
            rep.gpu_holders = {**(rep.gpu_holders or {}), **(wave.gpu_holders or {})}

    def _stop_waves_before(self, w: int | None) -> None:
        """Stop what is still up of the waves before `w` (None: of every wave)."""
        for k, (c, fut) in list(self.boots.items()):
            if (w is None or self.schedule.wave_of(k) < w) and not c.stopped:
                try:
                    fut.result()              # still booting: let it finish, then stop it
                except BaseException:         # noqa: BLE001 - its own test names it
                    pass
                self._stop(k, c)

    def release(self):
        """Stop the current topology; its teardown report (None when none was up)."""
        if self.current is not None:
            c, key, self.current, self.key = self.current, self.key, None, None
            return self._stop(key, c)
        return None

    def release_all(self):
        self.release()
        self._stop_waves_before(None)
        if self._executor is not None:
            self._executor.shutdown(wait=True)


@pytest.fixture(scope="session")
def cluster_pool(request):
    pool = ClusterPool(request.config)
    yield pool
    pool.release_all()


def _make_for_key(config, key, **kw) -> Cluster:
    """The Cluster of a shared key (engine, topology, profile...), as the `cluster` fixture
    makes it."""
    engine, topo, *profile = key
    if profile:
        kw["options"] = cluster_profile(profile[0]).options()
    kw.setdefault("hold_restarts", key in state(config).held_keys)
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
    c = cluster_pool.get(cluster_key, lambda: _make_for_key(request.config, cluster_key))
    # For the idle check after the test (_idle_after): by then this fixture is torn down and
    # pytest (8 and later) refuses its value ("not available ... already been torn down").
    request.node._e2e_cluster = c
    if request.node.get_closest_marker("quiet"):
        # timed against an engine's own pace: no worker boots beside it (a fault test's
        # restart in the background, marker `restarting`)
        Cluster.settle_restarts()
    return c


@pytest.fixture(autouse=True)
def _e2e_idle_after(request):
    """After each test on a shared topology, every role must be idle again (infra/cluster/idle.py):
    a leaked request fails the test that leaked it. The leaking topology is then stopped, so
    the next test gets a fresh one instead of inheriting the leak."""
    yield
    if "cluster" in request.fixturenames:
        try:
            _idle_after(request)
        finally:       # the topology's last test: it is stopped now (its order: the plugin's)
            request.getfixturevalue("cluster_pool").finished(request.node)


def _idle_after(request) -> None:
    if request.node.get_closest_marker("restarting"):
        return      # a worker of its topology boots again in the background: not idle-able
    if request.node.get_closest_marker("breaks_cluster"):
        # It broke its topology on purpose (and may have stopped it to check the teardown):
        # no idle check; stopped here in any case, so the next test gets a fresh one.
        request.getfixturevalue("cluster_pool").release()
        return
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


@pytest.fixture
def record(request):
    """A dict the test fills; written as results/tests/<test>.json with the cluster's facts."""
    rec: dict = {"test": request.node.nodeid, "started": time.time()}
    request.node.stash[RECORDED] = True
    request.node.stash[RECORD] = rec
    yield rec
    rec["outcome"] = request.node.stash.get(OUTCOME, "unknown")
    if "cluster" in request.fixturenames:
        # as handed out (torn down already where the test named `record` first)
        c = getattr(request.node, "_e2e_cluster", None) or request.getfixturevalue("cluster")
        rec.setdefault("cluster", c.name)
        rec.update(results.cluster_facts(c))
    state(request.config).records.append(rec)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        item.stash[OUTCOME] = rep.outcome
    if rep.when == "call":     # the test body's interval, for the time report
        state(item.config).calls.append((rep.start, rep.stop))
    if rep.when == "teardown" and rep.failed and RECORD in item.stash:
        # Failed after its record was taken (the idle check after the test, which runs last):
        # the result files say so too, not only pytest's exit code and junit.
        rec = item.stash[RECORD]
        rec["outcome"] = "error"
        rec["teardown_error"] = _error_line(rep)
    if (rep.when == "setup" and rep.failed and "record" in getattr(item, "fixturenames", ())
            and not item.stash.get(RECORDED, False)):
        # A fixture before `record` failed (a topology that did not start): still leave a
        # result record, so the failure is in the result files and not only in the log.
        ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key") or ()
        state(item.config).records.append({
            "test": item.nodeid, "outcome": "error", "started": time.time(),
            **({"engine": ck[0], "topology": str(ck[1])} if len(ck) == 2 else {}),
            "error": _error_line(rep)})


def _error_line(rep) -> str:
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(rep.longrepr)
    return text.strip().splitlines()[0][:500] if text and text.strip() else ""


def pytest_sessionfinish(session, exitstatus):
    lifecycle.teardown_all()
    st = state(session.config)
    bad = [f"{n}: {c.teardown_report.verdict()}" for n, c in st.clusters.items()
           if c.teardown_report is not None and not c.teardown_report.ok]
    st.teardown_violations = bad
    if bad and settings.ci():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not st.records and not st.clusters:
        return   # nothing end-to-end ran (e.g. unit tests only): no summary to write
    st.summary = results.write_session(st.records, st.clusters,
                                       wall_s=time.monotonic() - st.t0)
    st.time_report = time_report.with_schedule(
        time_report.compute([time_report.cluster_entry(c) for c in st.clusters.values()],
                            st.calls, st.t0_epoch, time.time()),
        st.boot_schedule)
    time_report.write(st.time_report, Path(st.summary["dir"]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    st = state(config)
    for line in st.teardown_violations:
        terminalreporter.write_line(f"TEARDOWN VIOLATION {line}", red=True, bold=True)
    out = st.summary
    if out and out.get("table"):
        terminalreporter.section("e2e results")
        terminalreporter.write_line(out["table"])
        terminalreporter.write_line(f"results: {out['dir']}")
    if st.time_report:
        terminalreporter.write_line(f"time: {time_report.headline(st.time_report)}", bold=True)
        if st.time_report.get("boot_schedule"):
            terminalreporter.write_line(f"boot schedule: {st.time_report['boot_schedule']['reason']}")
            held = st.time_report["boot_schedule"].get("held")
            if held and held.get("keys"):
                terminalreporter.write_line(f"restarts: {held['reason']}")
        for line in (time_report.phases_line(st.time_report),
                     time_report.warm_line(st.time_report)):
            if line:
                terminalreporter.write_line(line)
