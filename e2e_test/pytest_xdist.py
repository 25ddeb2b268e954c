"""pytest glue for running a session's topologies in parallel under pytest-xdist:
`pytest -n auto --dist loadgroup e2e_test/router`. Loaded by pytest_plugin.py.

- `-n auto` with `--dist loadgroup` asks the harness how many topologies may run at once
  (infra/specs/coboot.py: memory shares of the GPUs, the cores; one on CPU, where no worker
  process is started at all). Each worker runs one topology at a time, the tests of a
  topology on one worker (their xdist group: pytest_plugin.py); pytest-xdist hands out the
  groups in the collected order (no reordering by size: a baseline topology first).
- Each worker gets the session's scratch folder (evidence, device lock) and the assignment:
  its topologies take the devices as they are (not a slice of them), booted beside the
  others' (Engine.beside), and check at their teardown only their own processes.
- The groups travel from the workers to the controller's scheduler in a file of the scratch
  folder: pytest-xdist's own channel, a suffix on each node id, is lost with pytest 9.2, whose
  node ids are structured (pytest-xdist issue 1386: loadgroup then groups nothing, silently).
- The workers' records and topologies are sent to the controller, which writes the session's
  result files once; after every worker has ended it checks the devices against what they
  held before the session (GPU memory back, /dev/shm segments nobody holds removed), so no
  worker removes a segment another worker's engine is about to map.

With explicit `-n N` (no assignment) each worker gets its slice of the devices or cores
(devices.xdist_share): topologies in parallel on disjoint devices.
"""

from __future__ import annotations

import json

import pytest

from .infra import startup
from .infra.engines import for_topology, kind_engines
from .infra.errors import HarnessError
from .infra.lifecycle import reaper, teardown
from .infra.lifecycle.launcher import LocalLauncher
from .infra.reports.index import plain_nodeid
from .infra.specs import coboot, devices, settings
from .infra.specs import topology as topologies
from .infra.specs.model_specs import get_spec
from .infra.specs.plan import Plan
from .pytest_baseline import scratch_dir
from .pytest_lanes import session_plan
from .pytest_state import state


def worker(config) -> bool:
    """Whether this process is a pytest-xdist worker."""
    return getattr(config, "workerinput", None) is not None


def parallel(config) -> bool:
    """Whether this process is the controller of pytest-xdist workers."""
    return not worker(config) and bool(getattr(config.option, "tx", None))


def decide(config) -> coboot.Assignment:
    """The assignment for the session's options: every (engine, topology) it selects, placed
    on this machine (profiles and disposable topologies are the same topologies)."""
    if settings.get("E2E_LAUNCHER") != "local":
        return coboot.Assignment(1, "the topologies are placed when they boot (launcher "
                                    f"{settings.get('E2E_LAUNCHER')}): one at a time")
    backend = startup.resolve_backend(config.getoption("--backend"))
    spec = get_spec(config.getoption("--model"))
    keyed = []
    for engine in [e.strip() for e in config.getoption("--engine").split(",") if e.strip()]:
        for text in topologies.split_list(config.getoption("--topology")):
            topo = topologies.parse(text)
            if (engine not in kind_engines().get(topo.kind, ())
                    or not spec.supports(engine, topo.kind)):
                continue
            plan = session_plan(config, topo, backend, engine)
            if isinstance(plan, Plan):
                keyed.append(((engine, topo), plan))
    gpus = sorted({g for _, p in keyed for g in p.devices}) if backend == "cuda" else []
    free = devices.gpu_free_share(gpus) if backend == "cuda" else None
    drivers = {k: for_topology(k[0], k[1]) for k, _ in keyed}
    return coboot.assign(keyed, backend, free, len(devices.affinity()),
                         alone={k: drivers[k].alone_reason(spec) for k, _ in keyed},
                         held={k: h for k, p in keyed if (h := drivers[k].held_share(p))})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto --dist loadgroup`: the device-aware count; 0 (no worker processes: this one
    runs every test) where one topology at a time is the answer. Any other `-n auto`:
    pytest-xdist's own count."""
    if config.getoption("dist", None) != "loadgroup":
        return None
    try:
        a = decide(config)
    except Exception as e:    # noqa: BLE001 - bad input: pytest_configure names it, exit 2
        a = coboot.Assignment(1, f"not decided ({str(e).splitlines()[0]})")
    state(config).assignment = a
    return a.workers if a.workers > 1 else 0


def _groups_file(config, name: str):
    return scratch_dir(config) / f"groups-{name}.json"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """A worker, before it tells the controller what it collected: each test's xdist group
    (pytest_plugin marks them), for the controller's scheduler."""
    config = session.config
    if not worker(config) or not config.getvalue("loadgroup"):
        return
    groups = {}
    for item in session.items:
        m = item.get_closest_marker("xdist_group")
        if m is not None:
            groups[plain_nodeid(item.nodeid)] = m.kwargs.get("name") or m.args[0]
    path = _groups_file(config, config.workerinput["workerid"])
    path.with_suffix(".tmp").write_text(json.dumps(groups))
    path.with_suffix(".tmp").replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: pytest-xdist's LoadGroupScheduling with the groups the workers
    wrote (every worker collects the same tests: any worker's file holds them all)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroups(LoadGroupScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                found = sorted(scratch_dir(config).glob("groups-*.json"))
                if not found:
                    raise RuntimeError("no worker wrote its xdist groups")
                self.groups = json.loads(found[0].read_text())
            return self.groups.get(plain_nodeid(nodeid), nodeid)

    return FileGroups(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    a = state(node.config).assignment
    if a is not None:
        node.workerinput["e2e_assignment"] = json.dumps(a.to_dict())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """A worker's records and topologies, for the controller's result files."""
    part = getattr(node, "workeroutput", {}).get("e2e")
    if part:
        state(node.config).worker_parts.append(json.loads(part))


def pytest_configure(config):
    st = state(config)
    if getattr(config.option, "dist", None) == "loadgroup":
        # groups in the collected order (pytest_plugin: baseline topologies first), not by size
        config.option.loadscopereorder = False
    if worker(config):
        a = config.workerinput.get("e2e_assignment")
        if a:
            st.assignment = coboot.Assignment.from_dict(json.loads(a))
            devices.share_between_workers()
    elif parallel(config):
        gpus = tuple(devices.nvml_inventory()) if startup.resolve_backend(
            config.getoption("--backend")) == "cuda" else ()
        # what an earlier run left, and GPU memory held by others, once for every worker: a
        # worker's own preflight cannot tell the others' engines from a stranger's
        try:
            reaper.preflight(gpus)
        except HarnessError as e:
            pytest.exit(str(e), returncode=2)
        st.devices_before = LocalLauncher().baseline(gpus)


def cluster_kw(config, engine: str, topology, plan) -> dict:
    """What a worker's Cluster takes beyond the plain one: it shares the devices with the
    other workers' topologies (its teardown checks its own processes; the controller checks
    the devices at the session's end), its plan at the share they may hold together."""
    if not worker(config):
        return {}
    a = state(config).assignment
    if plan is not None and a is not None and a.shares:
        plan = for_topology(engine, topology).beside(plan, a.shares)
    return {"shared_devices": True, "plan": plan}


def devices_after(config) -> str | None:
    """The controller, after every worker ended: GPU memory back at what it was before the
    session, /dev/shm segments that appeared and that no process holds removed. The
    verdict's line where it is not clean, else None; the report in the session's state."""
    st = state(config)
    base = st.devices_before
    if base is None:
        return None
    rep = teardown.TeardownReport()
    teardown.check_gpu(rep, base.gpu_mib)
    rep.shm_removed, rep.shm_left = teardown.clean_shm(base.shm)
    st.devices_report = rep
    return None if rep.ok else f"devices after every worker: {rep.verdict()}"

