"""pytest glue of the baseline evidence (infra/verdicts/baseline.py): the `baseline` fixture,
what the collected tests need of each baseline topology, and its measurement right after
that topology boots. Loaded by pytest_plugin.py (its `pytest_plugins`).

A test judged against a baseline says which evidence with `@pytest.mark.baseline(*whats)`
(an argument that names one of the test's parameters stands for that parameter's value) and
takes the `baseline` fixture: `baseline(what)` is the Evidence of `what` for the test's
engine. Before the test's own topology is asked for, each of its whats is stored already,
or claimed by another live process (pytest-xdist worker) that measures it, or measured here:
the pool boots the baseline topology (stopping the one it held), and the process measures
every what that the session's tests need of it, so it boots once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest

from .infra.errors import HarnessError
from .infra.specs import settings
from .infra.specs.model_specs import get_spec
from .infra.verdicts import baseline as evidence
from .pytest_state import state

# How long a test waits for evidence another live process claimed, at most. The claimant's own
# bounds end a stuck measurement first (each pass's watchdog, E2E_WATCHDOG_S; the boot's
# readiness timeouts), with an error that is stored and raised here; this one only ends a
# wait on a claimant that hangs outside them.
WAIT_S = 3 * 3600


def whats_of(item) -> list[str]:
    """The evidence a test declares (marker `baseline`), its parameters resolved."""
    m = item.get_closest_marker("baseline")
    if m is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    out = []
    for a in m.args:
        w = params.get(a, a)
        if w not in evidence.WHATS:
            raise pytest.UsageError(f"{item.nodeid}: baseline({a!r}): no such evidence "
                                    f"(known: {', '.join(evidence.WHATS)})")
        if w not in out:
            out.append(w)
    return out


def engine_and_topology(item):
    """The test's engine and the Topology it runs on (None for a test that makes its own)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    ck = params.get("cluster_key")
    if ck:
        return ck[0], ck[1]
    return params.get("engine_name"), None


class Baselines:
    """This process's view of the session's baseline evidence (one per pytest config)."""

    def __init__(self, config):
        self.config = config
        self._cache: evidence.EvidenceCache | None = None
        self.worker = getattr(config, "workerinput", {}).get("workerid", "main")
        # (engine, baseline topology name) -> whats the collected tests need, in test order
        self.needs: dict = {}

    @property
    def cache(self) -> evidence.EvidenceCache:
        if self._cache is None:         # the folder only once evidence is asked for
            self._cache = evidence.EvidenceCache(scratch_dir(self.config) / "evidence")
        return self._cache

    def collected(self, items, selected) -> None:
        self.needs = {}
        spec = get_spec(self.config.getoption("--model"))
        for item in items:
            engine, judged = engine_and_topology(item)
            for what in whats_of(item):
                if evidence.unavailable(what, spec):
                    continue            # the test skips, naming why; nothing to measure
                topo = evidence.baseline_topology(what, judged, selected)
                whats = self.needs.setdefault((engine, topo), [])
                if what not in whats:
                    whats.append(what)

    def _key(self, engine: str, topo: str, what: str) -> str:
        return self.cache.key(engine, self.config.getoption("--model"), topo, what)

    @staticmethod
    def _claim(engine: str, topo: str) -> str:
        return f"{engine}/{topo}"

    # -- measuring -------------------------------------------------------------------------------
    def booting(self, key, start):
        """start() the shared topology of `key` and return its Cluster; where it is a baseline
        topology whose evidence the session's tests need, that evidence is claimed before the
        boot and measured right after it (a failed boot is stored as each one's error)."""
        engine, topo, *profile = key
        whats = [] if profile else self.needs.get((engine, topo.name), [])
        claim = self._claim(engine, topo.name)
        if not whats or not self.cache.claim(claim, self.worker):
            return start()
        try:
            try:
                c = start()
            except HarnessError as e:
                for what in whats:
                    self._store_error(engine, topo.name, what, e)
                raise
            self._measure(c, whats)
            return c
        finally:
            self.cache.release(claim)

    def _store_error(self, engine, topo, what, err) -> None:
        def fail():
            raise err
        with contextlib.suppress(Exception):    # stored: every test that needs it raises it
            self.cache.get(self._key(engine, topo, what), fail)

    def _measure(self, c, whats) -> None:
        t0 = time.time()
        for what in whats:
            with contextlib.suppress(Exception):    # stored: every test that needs it raises it
                self.cache.get(self._key(c.engine, c.topology.name, what),
                               lambda w=what: evidence.compute(c, w))
        # traffic in the time report, as a test body's (it runs in a test's set-up)
        state(self.config).calls.append((t0, time.time()))

    def ensure(self, pool, engine: str, what: str, judged) -> None:
        """`what` stored, or claimed by another live process; else measured here now: the
        pool gets the baseline topology (booting it: `booting` measures it then)."""
        topo = evidence.baseline_topology(what, judged, state(self.config).topologies or ())
        key = self._key(engine, topo, what)
        claim = self._claim(engine, topo)
        if self.cache.has(key):
            return
        owner = self.cache.claimed_by(claim)
        if owner is not None and owner["pid"] != os.getpid():
            return              # waited for when the test reads it
        c = pool.get_baseline(engine, topo)
        if not self.cache.has(key):    # it was up already: measured here, under the claim
            whats = self.needs.get((engine, topo), [])
            whats = whats + [what] if what not in whats else whats
            if self.cache.claim(claim, self.worker):
                try:
                    self._measure(c, whats)
                finally:
                    self.cache.release(claim)

    def read(self, engine: str, what: str, judged) -> evidence.Evidence:
        topo = evidence.baseline_topology(what, judged, state(self.config).topologies or ())
        key = self._key(engine, topo, what)
        got = self.cache.peek(key)
        if got is evidence.MISSING:
            got = self.cache.wait(key, self._claim(engine, topo), WAIT_S)
        if got is evidence.MISSING:
            raise evidence.EvidenceError(f"{key}: not measured (the process that claimed it "
                                         "ended without storing it)")
        return got


SCRATCH = pytest.StashKey[Path]()


def scratch_dir(config) -> Path:
    """The session's scratch folder, shared by its pytest-xdist workers (the controller's,
    handed over in `workerinput`): the evidence cache and the device lock. Inside the
    session's results folder; removed at the session's end (pytest_sessionfinish)."""
    if SCRATCH not in config.stash:
        folder = getattr(config, "workerinput", {}).get("e2e_scratch")
        if folder is None:
            folder = settings.results_dir() / ".session" / f"{os.getpid()}-{id(config):x}"
        config.stash[SCRATCH] = Path(folder)
        config.stash[SCRATCH].mkdir(parents=True, exist_ok=True)
    return config.stash[SCRATCH]


def baselines_of(config) -> Baselines:
    st = state(config)
    if st.baselines is None:
        st.baselines = Baselines(config)
    return st.baselines


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: every worker shares the controller's scratch folder."""
    node.workerinput["e2e_scratch"] = str(scratch_dir(node.config))


@pytest.fixture
def baseline(request, e2e_backend, cluster_pool):
    """`baseline(what)` -> the Evidence of `what` (infra/verdicts/baseline.py) for this
    test's engine; the test declares its whats with `@pytest.mark.baseline(...)`."""
    whats = whats_of(request.node)
    if not whats:
        raise pytest.UsageError(f"{request.node.nodeid}: the `baseline` fixture needs "
                                "@pytest.mark.baseline(what, ...)")
    engine, judged = engine_and_topology(request.node)
    spec = get_spec(request.config.getoption("--model"))
    b = baselines_of(request.config)
    for what in whats:
        why = evidence.unavailable(what, spec)
        if why:
            pytest.skip(why)
    if {"gsm8k", "mmlu"} & set(whats):     # their data checked before `1` boots for them
        request.getfixturevalue("eval_data")
    for what in whats:
        b.ensure(cluster_pool, engine, what, judged)

    def get(what: str) -> evidence.Evidence:
        if what not in whats:
            raise pytest.UsageError(f"{request.node.nodeid} reads baseline {what!r} but "
                                    f"declares only {whats} (@pytest.mark.baseline)")
        return b.read(engine, what, judged)
    return get


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The scratch folder is the session's, not a result: removed at its end (by the
    controller under pytest-xdist, after every worker)."""
    config = session.config
    if getattr(config, "workerinput", None) is None and SCRATCH in config.stash:
        shutil.rmtree(config.stash[SCRATCH], ignore_errors=True)
        with contextlib.suppress(OSError):      # the parent, where no other session has one
            config.stash[SCRATCH].parent.rmdir()
