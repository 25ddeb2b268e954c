"""The Ray launcher: a topology's roles on the nodes of a Ray cluster (`--launcher ray`).

Each role (worker) becomes a Ray actor (`RoleActor`) pinned to its plan node
(NodeAffinitySchedulingStrategy, hard): the actor runs the worker's command there as a
ManagedProcess (its own session, its own log, the node's reaper guardian), answers alive /
exit code / log / stop / kill, and nothing else. One `NodeAgent` actor per node allocates the
node's ports on the node's address and runs teardown verification there (processes, ports,
GPU memory, /dev/shm); the reports come back into one TeardownReport whose `nodes` names each
node (`merge_reports`). The gateway runs on this host (LocalLauncher).

A node's index is its `e2e_node_K` custom resource when every node has one (scripts and the
simulated hosts start nodes so), else the head first and then the others by address. Its
address is the raylet's node IP (`ray start --node-ip-address`): workers bind it, smg reaches
them there. Nodes with the same hostname share one machine's devices and cores (plan.py).

Every node must have this checkout and its venv at the same paths as the driver (the worker's
argv names the driver's interpreter), and e2e_test importable by Ray's workers (PYTHONPATH at
`ray start`): docs/multinode.md.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError
from ..specs.plan import Node, PlanEntry
from . import ports, teardown
from .launcher import Baseline, LocalLauncher, WorkerCommand
from .process import ManagedProcess, StopReport

STATUS_TIMEOUT_S = 5.0        # one status call waits this long for its answer
# A call that times out is silence, not loss: on a busy host (two engines compiling on two
# cores) Ray's own processes can stall for seconds. Loss is what Ray itself reports (the
# actor died or is unreachable, or the GCS declared the node dead: a killed raylet is seen so
# in 2.3-3.6 s, measured in the multi-node test and in CI) or a node silent for longer than
# this. This is looser than a 5 s rule, for a measured reason: the slowest answered
# call (RayHandle.slowest_answer_s, recorded by the test) is a fraction of a second with the
# machine to itself, but over 5 s, on both nodes at once, while two engines initialise on two
# cores, so a 5 s rule fails a healthy boot (docs/lifecycle.md, table "Lifecycle figures").
# The fallback takes the bound every other actor call
# already has (CALL_TIMEOUT_S: 9x the slowest answer seen); it only covers a node that
# neither answers nor is reported dead by Ray.
SILENT_LOST_S = 60.0
CALL_TIMEOUT_S = 60.0
CONNECT_S = 60.0              # how long ray.init may keep failing before it is an error
NODE_RESOURCE = re.compile(r"^e2e_node_(\d+)$")
# Ray sets these for its workers (OMP_NUM_THREADS=1 for a 0-CPU actor); an engine started by
# the actor must not inherit them.
RAY_WORKER_ENV = ("OMP_NUM_THREADS",)


# -- pure logic ------------------------------------------------------------------------------

def order_nodes(infos: list[dict]) -> list[tuple[Node, str]]:
    """(Node, Ray node id) for every alive node of `ray.nodes()`, in index order. Pure."""
    alive = [i for i in infos if i.get("Alive")]
    if not alive:
        raise ConfigError("the Ray cluster has no alive node")

    def tagged(i):
        ks = [int(m.group(1)) for r in i.get("Resources", {}) if (m := NODE_RESOURCE.match(r))]
        return ks[0] if ks else None

    tags = [tagged(i) for i in alive]
    if all(t is not None for t in tags):
        if len(set(tags)) != len(tags) or sorted(tags) != list(range(len(tags))):
            raise ConfigError(f"Ray nodes' e2e_node_K resources must be 0..{len(tags) - 1}, "
                              f"each once; found {sorted(tags)}")
        ordered = sorted(zip(tags, alive), key=lambda t: t[0])
        alive = [i for _, i in ordered]
    else:
        alive = sorted(alive, key=lambda i: ("node:__internal_head__" not in i.get("Resources", {}),
                                             tuple(int(x) if x.isdigit() else 0 for x in
                                                   i["NodeManagerAddress"].split("."))))
    return [(Node(k, i["NodeManagerAddress"], host_id=i.get("NodeManagerHostname") or
                  i["NodeManagerAddress"]), i["NodeID"]) for k, i in enumerate(alive)]


def node_dead(node_id: str) -> bool:
    """Whether Ray's GCS has declared the node dead (after its own health checks)."""
    import ray
    return any(i.get("NodeID") == node_id and not i.get("Alive") for i in ray.nodes())


def merge_reports(local: teardown.TeardownReport,
                  per_node: dict[str, teardown.TeardownReport]) -> teardown.TeardownReport:
    """One report: this host's (the gateway's) and each node's, every finding prefixed with
    the node that has it; `nodes` keeps each node's own report. Pure."""
    out = replace(local, escalated=list(local.escalated), survivors=list(local.survivors),
                  busy_ports=list(local.busy_ports), gpu_leaks=dict(local.gpu_leaks),
                  shm_removed=list(local.shm_removed), shm_left=list(local.shm_left),
                  unverified=list(local.unverified), escaped=list(local.escaped),
                  gpu_holders=dict(local.gpu_holders), nodes={"driver": local.to_dict()})
    for label, r in per_node.items():
        out.escalated += [f"{label}: {x}" for x in r.escalated]
        out.survivors += [f"{label}: {x}" for x in r.survivors]
        out.busy_ports += [p for p in r.busy_ports if p not in out.busy_ports]
        out.shm_removed += [f"{label}: {x}" for x in r.shm_removed]
        out.shm_left += [f"{label}: {x}" for x in r.shm_left]
        out.unverified += [f"{label}: {x}" for x in r.unverified]
        out.escaped += [f"{label}: {x}" for x in r.escaped]
        for d, mib in r.gpu_leaks.items():
            out.gpu_leaks[f"{label} gpu {d}"] = mib
        out.gpu_checked = out.gpu_checked or r.gpu_checked
        out.nodes[label] = r.to_dict()
    return out


def interface_of(address: str) -> str | None:
    """The network interface of this host (namespace) that holds `address`."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


# -- actors (their classes become Ray actors in RayLauncher; plain Python here) -----------------

class RoleActor:
    """One worker's process on this node."""

    def __init__(self, name: str, argv: list[str], env: dict, unset_env: tuple, log_path: str,
                 cores: tuple, metrics_dir: str | None, address: str, tmp_env: str = ""):
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            Path(metrics_dir).mkdir(parents=True)
        env = dict(env)
        if "UCX_TLS" in env and "UCX_NET_DEVICES" not in env:
            iface = interface_of(address)
            if iface:           # UCX over the node's own interface only (not lo, not others)
                env["UCX_NET_DEVICES"] = iface
        unset = tuple(unset_env) + tuple(v for v in RAY_WORKER_ENV if v not in env)
        self.proc = ManagedProcess(name, argv, env, Path(log_path), unset_env=unset,
                                   cpu_affinity=cores, tmp_env=tmp_env)

    def start(self) -> dict:
        self.proc.start()
        return {"pid": self.proc.pid, "host": socket.gethostname()}

    def status(self) -> tuple[bool, int | None]:
        return self.proc.alive(), self.proc.exit_code

    def remember_descendants(self) -> None:
        self.proc.remember_descendants()

    def log_text(self, max_bytes: int) -> str:
        return self.proc.log_text(max_bytes)

    def failure_summary(self) -> str:
        return self.proc.failure_summary()

    def tree_pids(self) -> list[int]:
        return [p.pid for p in self.proc.tree()]

    def stop(self, grace: float) -> StopReport:
        return self.proc.stop(grace)

    def kill(self) -> None:
        self.proc.kill()


class NodeAgent:
    """Per-node services: ports on the node's address, the baseline, teardown checks."""

    def __init__(self, address: str):
        self.address = address

    def info(self) -> dict:
        return {"hostname": socket.gethostname(), "pid": os.getpid(),
                "cores": sorted(os.sched_getaffinity(0))}

    def allocate(self, n: int) -> list[int]:
        return ports.allocate(n, host=self.address)

    def baseline(self, gpus: tuple) -> Baseline:
        return LocalLauncher().baseline(gpus)

    def verify(self, stops: list[StopReport], port_set: set, base: Baseline):
        rep = LocalLauncher().verify(stops, port_set, base)
        return rep


# -- the driver's side -----------------------------------------------------------------------

LOST = object()      # RayHandle._ask's answer when the node is lost or did not answer

@dataclass
class RayHandle:
    """A worker on a node, as the Cluster sees it (launcher.Handle)."""
    name: str
    argv: list[str]
    log_path: Path
    node: Node
    actor: object
    started_at: float | None = None
    worker_pid: int = -1
    up: bool = True
    code: int | None = None
    lost: str | None = None          # why the node or the actor stopped answering
    silent_since: float | None = None  # when the calls began to time out (None: answering)
    _tail: str = ""                   # the last log text fetched (kept for a lost node)
    report: StopReport | None = None
    node_dead: object = None            # () -> bool: Ray's GCS says the node is dead
    slowest_answer_s: float = 0.0       # the longest an answered call took (the noise that
                                        # SILENT_LOST_S must stay above; test records it)

    @property
    def where(self) -> str:
        return f", {self.node.label}"

    @property
    def pid(self) -> int:
        return self.worker_pid

    @property
    def exit_code(self) -> int | None:
        return self.code

    def ray_get(self, ref, timeout: float):
        import ray
        return ray.get(ref, timeout=timeout)

    def lose(self, e: BaseException, waited: float = 0.0) -> None:
        """Mark the node lost for a call that failed with `e` after `waited` s: at once when
        Ray says the actor is gone; a timeout only when the node has been silent (every call
        timing out) for SILENT_LOST_S."""
        import ray
        now = time.monotonic()
        if isinstance(e, ray.exceptions.GetTimeoutError):
            began = now - waited
            if self.silent_since is None or began < self.silent_since:
                self.silent_since = began
            if self.node_dead is not None and self._node_dead():
                why = (f"Ray reports the node dead (its actor silent for "
                       f"{now - self.silent_since:.0f} s)")
            elif now - self.silent_since < SILENT_LOST_S:
                return
            else:
                why = f"its actor has not answered for {now - self.silent_since:.0f} s"
        else:
            why = f"its actor died ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
        self.lost = f"{self.node.label} lost: {why}"
        self.up = False

    def _node_dead(self) -> bool:
        try:
            return bool(self.node_dead())
        except Exception:          # the GCS did not answer either: no verdict from it
            return False

    def _call(self, method: str, *args, timeout: float):
        """The actor's answer to `method`, or LOST (then `lose` has judged the failure)."""
        t0 = time.monotonic()
        try:
            out = self.ray_get(getattr(self.actor, method).remote(*args), timeout)
        except Exception as e:
            self.lose(e, timeout)
            return LOST
        self.slowest_answer_s = max(self.slowest_answer_s, time.monotonic() - t0)
        self.silent_since = None
        return out

    def _ask(self, method: str, *args, timeout: float = CALL_TIMEOUT_S):
        """Call the role actor's `method`; LOST when the node is lost or did not answer."""
        if self.lost:
            return LOST
        return self._call(method, *args, timeout=timeout)

    def alive(self) -> bool:
        if not self.up:
            return False
        got = self._call("status", timeout=STATUS_TIMEOUT_S)
        if got is not LOST:             # (silence keeps the last answer until it is loss)
            self.up, self.code = got
        return self.up

    def death_reason(self) -> str:
        if self.lost:
            return self.lost
        code = self.code
        return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"

    def remember_descendants(self) -> None:
        self._ask("remember_descendants", timeout=STATUS_TIMEOUT_S)

    def log_text(self, max_bytes: int = 2_000_000) -> str:
        text = self._ask("log_text", max_bytes)
        if text is not LOST:
            self._tail = text
        if text is LOST and not self._tail and self.log_path.exists():
            self._tail = self.log_path.read_text(errors="replace")[-max_bytes:]
        return self._tail

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text(200_000).splitlines()[-n:])

    def failure_summary(self) -> str:
        summary = self._ask("failure_summary")
        if summary is not LOST:
            return summary
        why = self.lost or f"its actor did not answer within {CALL_TIMEOUT_S:.0f} s"
        return (f"{self.name} on {self.node.label}: {why}\nargv: {' '.join(self.argv)}\n"
                f"log: {self.log_path}\nlog tail (last fetched):\n{self.log_tail(25)}")

    def tree_pids(self) -> list[int]:
        pids = self._ask("tree_pids")
        return [] if pids is LOST else pids

    def tree(self) -> list:
        """The worker's processes as psutil objects where its node is this machine (simulated
        hosts: stack dumps and the like work as on one host); [] for another machine."""
        import psutil
        if self.node.host_id != socket.gethostname():
            return []
        out = []
        for pid in self.tree_pids():
            try:
                out.append(psutil.Process(pid))
            except psutil.Error:
                pass
        return out

    def stop(self, grace: float = 15.0) -> StopReport:
        t0 = time.monotonic()
        if not self.lost:
            try:
                self.report = self.ray_get(self.actor.stop.remote(grace), grace + CALL_TIMEOUT_S)
                self.up, self.code = False, self.report.exit_code
                self._copy_log()
                return self.report
            except Exception as e:
                self.lose(e, grace + CALL_TIMEOUT_S)
        # Nothing could be stopped or checked there: verify() reports the node as unverified.
        self.report = StopReport(self.name, self.worker_pid, self.code, False,
                                 time.monotonic() - t0, [])
        return self.report

    def kill(self) -> None:
        self._ask("kill")

    def _copy_log(self) -> None:
        """The node's log into the driver's results (a no-op when both are one file)."""
        try:
            if self.log_path.exists():
                return
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text(self.log_text())
        except OSError:
            pass


@dataclass
class RayLauncher:
    """launcher.Launcher on a Ray cluster (see the module docstring)."""
    address: str = "auto"
    local: LocalLauncher = field(default_factory=LocalLauncher)
    _nodes: list[tuple[Node, str]] = field(default_factory=list)
    _agents: dict[int, object] = field(default_factory=dict)
    _ports: dict[int, set[int]] = field(default_factory=dict)
    _baselines: dict[int, Baseline] = field(default_factory=dict)
    handles: list[RayHandle] = field(default_factory=list)

    def _connect(self) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("--launcher ray needs Ray: pip install -e '.[multinode]' "
                              "(ray==2.60.0)") from None
        # A cluster that has just started can refuse the first connections (Ray Client's
        # proxy answers "Initialization failure from server" until its server is up): retry
        # for CONNECT_S, then one line.
        deadline = time.monotonic() + CONNECT_S
        while not ray.is_initialized():
            try:
                ray.init(address=self.address, log_to_driver=False, namespace="e2e",
                         logging_level="WARNING")
            except Exception as e:
                if time.monotonic() < deadline:
                    time.sleep(2.0)
                    continue
                text = " ".join(str(e).split()) or type(e).__name__
                raise ConfigError(f"E2E_RAY_ADDRESS={self.address!r}: cannot connect to the "
                                  f"Ray cluster within {CONNECT_S:.0f} s: {text[:300]}") from None

    def nodes(self) -> tuple[Node, ...]:
        if not self._nodes:
            self._connect()
            import ray
            self._nodes = order_nodes(ray.nodes())
        return tuple(n for n, _ in self._nodes)

    def _options(self, k: int) -> dict:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        return {"num_cpus": 0, "max_concurrency": 4, "scheduling_strategy":
                NodeAffinitySchedulingStrategy(self._nodes[k][1], soft=False)}

    def agent(self, k: int):
        if k not in self._agents:
            import ray
            self.nodes()
            node = self._nodes[k][0]
            a = ray.remote(NodeAgent).options(**self._options(k)).remote(node.address)
            try:
                ray.get(a.info.remote(), timeout=120)
            except Exception as e:
                raise ConfigError(f"{node.label}: its Ray node agent did not start: "
                                  f"{str(e).strip().splitlines()[0][:200]}") from None
            self._agents[k] = a
            self._ports[k] = set()
        return self._agents[k]

    def allocate_ports(self, entry: PlanEntry, n: int) -> list[int]:
        import ray
        out = ray.get(self.agent(entry.node).allocate.remote(n), timeout=CALL_TIMEOUT_S)
        self._ports[entry.node].update(out)
        return out

    def baseline(self, gpus: tuple[int, ...]) -> Baseline:
        import ray
        self.nodes()
        for k in range(len(self._nodes)):
            self._baselines[k] = ray.get(self.agent(k).baseline.remote(tuple(gpus)),
                                         timeout=CALL_TIMEOUT_S)
        return self.local.baseline(())       # the gateway holds no GPU

    def start(self, name: str, command: WorkerCommand, log_path: Path,
              cores: tuple[int, ...] = (), node: int | None = None):
        if node is None:
            return self.local.start(name, command, log_path, cores)
        import ray
        self.agent(node)
        nd = self._nodes[node][0]
        log_path = Path(log_path).resolve()     # the actor's working folder is Ray's
        actor = ray.remote(RoleActor).options(**self._options(node)).remote(
            f"{name} on {nd.label}", command.argv, command.env, tuple(command.unset_env),
            str(log_path), tuple(cores), command.metrics_dir, nd.address, command.tmp_env)
        h = RayHandle(name, list(command.argv), Path(log_path), nd, actor,
                      node_dead=functools.partial(node_dead, self._nodes[node][1]))
        try:
            h.worker_pid = ray.get(actor.start.remote(), timeout=120)["pid"]
        except Exception as e:
            h.lose(e, 120)
        h.started_at = time.monotonic()
        self.handles.append(h)
        return h

    def verify(self, stops: list[StopReport], port_set: set[int],
               baseline: Baseline) -> teardown.TeardownReport:
        import ray
        on_nodes = {id(h.report) for h in self.handles}
        node_ports = set().union(*self._ports.values()) if self._ports else set()
        local = self.local.verify([r for r in stops if id(r) not in on_nodes],
                                  port_set - node_ports, baseline)
        per_node: dict[str, teardown.TeardownReport] = {}
        for k, (nd, _) in enumerate(self._nodes):
            if k not in self._agents:
                continue
            mine = [h.report for h in self.handles if h.node.index == k and h.report]
            lost = [h for h in self.handles if h.node.index == k and h.lost]
            if lost:        # its agent went with the node: do not wait for it
                per_node[nd.label] = teardown.TeardownReport(unverified=[
                    f"{h.name} (pid {h.pid}): {h.lost}" for h in lost])
                continue
            try:
                rep = ray.get(self._agents[k].verify.remote(
                    mine, self._ports.get(k, set()), self._baselines.get(k, Baseline())),
                    timeout=CALL_TIMEOUT_S)
            except Exception as e:
                rep = teardown.TeardownReport(unverified=[
                    f"its node agent did not answer ({type(e).__name__})"])
            per_node[nd.label] = rep
        self.close()
        return merge_reports(local, per_node)

    def close(self) -> None:
        """End every actor of this launcher (their processes were stopped before)."""
        import ray
        for a in [h.actor for h in self.handles] + list(self._agents.values()):
            try:
                ray.kill(a)
            except Exception:
                pass
        self.handles, self._agents = [], {}
