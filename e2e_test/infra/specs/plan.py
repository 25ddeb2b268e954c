"""The device planner: topology x model spec x devices -> one PlanEntry per worker process.

Order (documented contract): roles are assigned in the topology's role order (encode, prefill,
decode; attention before FFN; the AFD native baseline on the first devices), workers of a role
in index order, each taking the next devices of the ordered device list. The list comes from
`--devices`/E2E_DEVICES, for AFD topologies AFD_E2E_DEVICES, else CUDA_VISIBLE_DEVICES, else
the NVML inventory. When there are fewer devices than workers need, workers are packed onto a
device as long as their memory fractions add up to at most 1.0, each worker on the devices with
the most room left (the earlier ones on a tie), spreading them over the listed devices.

On CPU each worker gets its own cores (E2E_CPU_CORES or this process's affinity), split evenly.

Which devices or cores this machine offers is startup.py's (`startup.machine_devices`: the
variables, CUDA_VISIBLE_DEVICES, NVML through devices.py, the affinity mask, the xdist split);
the planner takes them as data.

Nodes (multi-node launchers, launcher.py / ray_launcher.py): every entry is on one node and gets
that node's address (`node`, `host`). A role pinned with `ROLE.node=K` goes to node K; the
other workers spread over the nodes in plan order (worker k of the unpinned ones on node
k mod N). Devices and cores are planned per host: nodes on one machine (simulated hosts, same
hostname) share its inventory and split it as above; each other machine plans its own workers
on its own inventory (the same device list on every machine: homogeneous nodes).
Pure: no process is started, no environment variable and no NVML is read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..errors import ConfigError
from .devices import parse_device_list, xdist_share  # noqa: F401 (re-exported)
from .model_specs import ModelSpec
from .topology import Topology


@dataclass(frozen=True)
class PlanEntry:
    name: str                  # "prefill-0"
    role: str                  # worker | encode | prefill | decode | attention | ffn
    index: int
    tp: int
    dp: int
    gpus: tuple[int, ...] = ()  # physical GPU ids (empty on CPU)
    cores: tuple[int, ...] = ()  # CPU cores (empty on GPU)
    mem_fraction: float = 0.0  # the memory share the engine is given
    start_stage: int = 0       # workers start stage by stage (engines/*.packed_schedule)
    node: int = 0              # index into the launcher's nodes
    host: str = "127.0.0.1"    # the node's address: the worker binds it, smg reaches it there


@dataclass(frozen=True)
class Node:
    """One machine (or simulated host) a launcher can start workers on."""
    index: int
    address: str               # what its servers bind and others connect to
    host_id: str = "local"     # nodes with the same host_id share one machine's devices/cores
    name: str = ""             # for messages: "node 1 (10.77.0.3)"

    @property
    def label(self) -> str:
        return self.name or f"node {self.index} ({self.address})"


LOCAL_NODES = (Node(0, "127.0.0.1"),)


@dataclass(frozen=True)
class Plan:
    topology: str
    backend: str               # "cpu" | "cuda"
    entries: tuple[PlanEntry, ...]
    devices: tuple[int, ...] = ()
    packed: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def multinode(self) -> bool:
        return any(e.node or e.host != "127.0.0.1" for e in self.entries)

    def by_role(self, role: str) -> list[PlanEntry]:
        return [e for e in self.entries if e.role == role]

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        lines = [f"plan {self.topology} on {self.backend}"
                 + (f" devices {','.join(map(str, self.devices))}" if self.devices else "")
                 + (" (packed)" if self.packed else "")]
        for e in self.entries:
            where = (f"gpu {','.join(map(str, e.gpus))} mem {e.mem_fraction:.2f}" if e.gpus
                     else f"cores {','.join(map(str, e.cores))}")
            stage = f" start stage {e.start_stage}" if e.start_stage else ""
            node = f" node {e.node} {e.host}" if self.multinode else ""
            lines.append(f"  {e.name:<12} tp={e.tp} dp={e.dp} {where}{stage}{node}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class TooFewDevices(ConfigError):
    """This machine has too few devices (or cores) for the topology: the pytest plugin skips
    on it in ordinary lanes; everything else is a plain ConfigError."""


def devices_needed(topology: Topology, spec: ModelSpec) -> int:
    """GPUs a topology needs with this model when no worker shares one."""
    return topology.num_devices * spec.tp


def _workers(topology: Topology, only: set | None = None):
    for g in topology.roles:
        for i in range(g.count):
            if only is None or (g.role, i) in only:
                yield g, i


def plan_cpu(topology: Topology, cores: tuple[int, ...], only: set | None = None) -> Plan:
    """Each worker gets its own cores: at least one per rank (tp x dp: a tp=2 prefill two),
    the cores beyond that shared out evenly, the first workers taking one more on a remainder."""
    workers = list(_workers(topology, only))
    n = len(workers)
    need = sum(g.devices_per_worker for g, _ in workers)
    if need > len(cores):
        have = f"only {len(cores)} core(s) available ({','.join(map(str, cores))})"
        if need == n:
            raise TooFewDevices(f"topology {topology.name!r} needs {n} worker(s) with their "
                                f"own cores; {have}")
        ranks = ", ".join(f"{g.role}-{i} {g.devices_per_worker}" for g, i in workers)
        raise TooFewDevices(f"topology {topology.name!r} needs {need} cores, one per rank of "
                            f"each worker ({ranks}); {have}")
    share, extra = divmod(len(cores) - need, n)
    entries, pos = [], 0
    for k, (g, i) in enumerate(workers):
        take = g.devices_per_worker + share + (1 if k < extra else 0)
        entries.append(PlanEntry(f"{g.role}-{i}", g.role, i, g.tp, g.dp,
                                 cores=tuple(cores[pos:pos + take])))
        pos += take
    return Plan(topology.name, "cpu", tuple(entries), devices=())


def plan_gpu(topology: Topology, spec: ModelSpec, devices: tuple[int, ...],
             only: set | None = None) -> Plan:
    if not devices:
        raise ConfigError(f"topology {topology.name!r} needs GPUs but none were found "
                          "(set E2E_DEVICES or CUDA_VISIBLE_DEVICES)")
    dup = sorted({d for d in devices if devices.count(d) > 1})
    if dup:
        raise ConfigError(f"device list {','.join(map(str, devices))}: duplicate device(s) {dup}")
    frac = spec.gpu_memory_fraction
    workers = list(_workers(topology, only))
    need = sum(g.devices_per_worker * spec.tp for g, _ in workers)
    entries: list[PlanEntry] = []
    if need <= len(devices):
        pos = 0
        for g, i in workers:
            k = g.devices_per_worker * spec.tp
            entries.append(PlanEntry(f"{g.role}-{i}", g.role, i, g.tp * spec.tp, g.dp,
                                     gpus=tuple(devices[pos:pos + k]), mem_fraction=frac))
            pos += k
        return Plan(topology.name, "cuda", tuple(entries), devices=tuple(devices))
    # Pack: each worker takes the run of k consecutive devices with room for `frac` that has
    # the most memory left (the earliest on a tie), so every listed device gets used.
    free = [1.0] * len(devices)
    for g, i in workers:
        k = g.devices_per_worker * spec.tp
        fits = [range(start, start + k) for start in range(len(devices) - k + 1)
                if all(free[j] + 1e-9 >= frac for j in range(start, start + k))]
        if not fits:
            raise TooFewDevices(
                f"topology {topology.name!r} with model {spec.id!r} needs {need} GPU(s) at "
                f"memory fraction {frac:g}; {len(devices)} device(s) "
                f"({','.join(map(str, devices))}) cannot hold it even packed")
        window = max(fits, key=lambda w: (round(min(free[j] for j in w), 6), -w.start))
        for j in window:
            free[j] -= frac
        entries.append(PlanEntry(f"{g.role}-{i}", g.role, i, g.tp * spec.tp, g.dp,
                                 gpus=tuple(devices[j] for j in window), mem_fraction=frac))
    return Plan(topology.name, "cuda", tuple(entries), devices=tuple(devices), packed=True,
                notes=(f"{need} device(s) wanted, {len(devices)} available: packed by "
                       f"memory fraction {frac}",))


def node_of_workers(topology: Topology, nodes: tuple[Node, ...]) -> dict[tuple[str, int], int]:
    """(role, index) -> node index: pinned roles (`ROLE.node=K`) on their node, the others
    spread in plan order (the k-th unpinned worker on node k mod N). Pure."""
    if not nodes:
        raise ConfigError("no nodes to place workers on")
    out, k = {}, 0
    for g, i in _workers(topology):
        if g.node is not None:
            if g.node >= len(nodes):
                raise ConfigError(
                    f"topology {topology.name!r}: {g.role} pinned to node {g.node}, but the "
                    f"launcher has {len(nodes)} node(s) "
                    f"({', '.join(n.label for n in nodes)})")
            out[(g.role, i)] = g.node
        else:
            out[(g.role, i)] = k % len(nodes)
            k += 1
    return out


def make_plan(topology: Topology, spec: ModelSpec, backend: str,
              devices: tuple[int, ...] | None = None,
              cores: tuple[int, ...] | None = None,
              nodes: tuple[Node, ...] = LOCAL_NODES) -> Plan:
    """Plan per host (see the module docstring); one host = the single-machine plan."""
    if backend not in ("cpu", "cuda"):
        raise ConfigError(f"unknown backend {backend!r} (cpu or cuda)")
    where = node_of_workers(topology, nodes)
    hosts: dict[str, set] = {}
    for key, k in where.items():
        hosts.setdefault(nodes[k].host_id, set()).add(key)
    parts = []
    if (cores if backend == "cpu" else devices) is None:
        raise ConfigError(f"plan of {topology.name!r} on {backend}: no "
                          f"{'cores' if backend == 'cpu' else 'devices'} given "
                          "(startup.machine_devices gives this machine's)")
    for host_id, only in hosts.items():
        sub = None if len(hosts) == 1 else only
        if backend == "cpu":
            parts.append(plan_cpu(topology, cores, sub))
        else:
            parts.append(plan_gpu(topology, spec, devices, sub))
    by_key = {(e.role, e.index): e for p in parts for e in p.entries}
    entries = []
    for g, i in _workers(topology):
        nd = nodes[where[(g.role, i)]]
        entries.append(replace(by_key[(g.role, i)], node=nd.index, host=nd.address))
    first = parts[0]
    notes = tuple(n for p in parts for n in p.notes)
    if len(hosts) > 1:
        notes += (f"{len(hosts)} hosts, each planned on its own "
                  f"{'cores' if backend == 'cpu' else 'devices'}",)
    return replace(first, entries=tuple(entries), packed=any(p.packed for p in parts),
                   notes=notes)


def place(topology: Topology, spec: ModelSpec, backend: str,
          devices: tuple[int, ...] | str, engine=None,
          nodes: tuple[Node, ...] = LOCAL_NODES) -> Plan:
    """The one placement check, used by the Cluster, the pytest plugin and the CLI: plan on
    `devices` (the ordered GPU ids on cuda, the cores on cpu: data, e.g. what
    startup.machine_devices found; a text is parsed as a device list), refuse packing for an
    engine whose workers cannot share a GPU, and give workers that share one their start stage
    and memory share when the engine asks (`engine.packed_schedule`). Too few devices is a
    TooFewDevices error. Reads no environment and no NVML."""
    if isinstance(devices, str):
        devices = parse_device_list(devices, "--devices")
    if engine is not None and len(nodes) > 1 and not getattr(engine, "multinode", False):
        raise ConfigError(f"engine {engine.name!r} cannot place workers on other nodes yet "
                          f"(its workers bind 127.0.0.1); use --launcher local")
    if backend == "cuda":
        plan = make_plan(topology, spec, "cuda", devices=tuple(devices), nodes=nodes)
        if plan.packed and engine is not None and not engine.packable:
            need = devices_needed(topology, spec)
            raise TooFewDevices(f"topology {topology.name!r} ({engine.name}) needs {need} "
                                f"separate GPU(s), its workers cannot share one; "
                                f"{len(plan.devices)} device(s) present")
        schedule = (engine.packed_schedule(plan.entries, spec) if engine is not None
                    else None)
        if schedule:
            plan = replace(plan, entries=tuple(
                replace(e, start_stage=schedule[e.name][0], mem_fraction=schedule[e.name][1])
                if e.name in schedule else e for e in plan.entries))
        return plan
    if backend == "cpu":
        return make_plan(topology, spec, "cpu", cores=tuple(devices), nodes=nodes)
    raise ConfigError(f"unknown backend {backend!r} (cpu or cuda)")
