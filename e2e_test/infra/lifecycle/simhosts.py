"""Simulated hosts on this machine: one network namespace per node, joined to the root
namespace through a bridge by veth pairs with private addresses, and a real Ray cluster on
them (the head in the first namespace, a worker node in each other one).

    with SimulatedHosts(2) as hosts:          # ns e2e-<id>-0 at 10.R.0.2, e2e-<id>-1 at .3
        hosts.start_ray()                     # `ray start --head` in ns 0, `--address` in 1..
        os.environ["E2E_RAY_ADDRESS"] = hosts.ray_client_address
        ...
    # Ray stopped on every node, namespaces, veths and the bridge removed (and checked)

The root namespace holds the bridge address (10.R.0.1), so the gateway and the test driver
reach every node. Nothing leaves the machine: the bridge has no uplink and no route out.
Everything needs root (`ip netns`); `available()` says whether it can be made here.

The command builders are pure (unit-tested); `SimulatedHosts` runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HarnessError

RAY_PORT = 6379
RAY_NODE_ENV = {"RAY_kill_child_processes_on_worker_exit": "0"}
CLIENT_PORT = 10001
# The head's GCS declares a node dead after this many failed health checks, one a second
# (Ray's defaults: 5 every 3 s after 5 s). A killed raylet refuses at once, so it is dead in
# about 3 s; a live but starved one answers within Ray's 10 s per-check timeout.
HEAD_SYSTEM_CONFIG = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                      "health_check_failure_threshold": 3}


@dataclass(frozen=True)
class SimNode:
    index: int
    netns: str
    address: str
    veth_host: str        # the end in the root namespace (on the bridge)
    veth_node: str        # the end inside the namespace


def layout(n: int, tag: str, subnet: int = 77) -> tuple[str, str, list[SimNode]]:
    """(bridge name, bridge address, nodes) for n simulated hosts; pure. Interface names
    stay within Linux's 15 characters."""
    if not 1 <= n <= 200:
        raise HarnessError(f"simulated hosts: 1..200 nodes, not {n}")
    tag = tag[:6]
    nodes = [SimNode(i, f"e2e-{tag}-{i}", f"10.{subnet}.0.{i + 2}", f"e2h{tag}{i}"[:15],
                     f"e2n{tag}{i}"[:15]) for i in range(n)]
    return f"e2b{tag}"[:15], f"10.{subnet}.0.1", nodes


def setup_commands(bridge: str, bridge_addr: str, nodes: list[SimNode]) -> list[list[str]]:
    cmds = [["ip", "link", "add", bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{bridge_addr}/24", "dev", bridge],
            ["ip", "link", "set", bridge, "up"]]
    for nd in nodes:
        cmds += [["ip", "netns", "add", nd.netns],
                 ["ip", "link", "add", nd.veth_host, "type", "veth", "peer", "name", nd.veth_node],
                 ["ip", "link", "set", nd.veth_node, "netns", nd.netns],
                 ["ip", "link", "set", nd.veth_host, "master", bridge],
                 ["ip", "link", "set", nd.veth_host, "up"],
                 ["ip", "netns", "exec", nd.netns, "ip", "addr", "add", f"{nd.address}/24",
                  "dev", nd.veth_node],
                 ["ip", "netns", "exec", nd.netns, "ip", "link", "set", nd.veth_node, "up"],
                 ["ip", "netns", "exec", nd.netns, "ip", "link", "set", "lo", "up"]]
    return cmds


def teardown_commands(bridge: str, nodes: list[SimNode]) -> list[list[str]]:
    # Deleting one end of a veth pair deletes both; deleting a namespace would too, but the
    # kernel does that asynchronously, after the namespace's last process is gone.
    return ([["ip", "link", "del", nd.veth_host] for nd in nodes]
            + [["ip", "netns", "del", nd.netns] for nd in nodes] + [["ip", "link", "del", bridge]])


def ray_start_argv(ray_bin: str, node: SimNode, head: SimNode, num_cpus: int,
                   temp_dir: str) -> list[str]:
    """`ray start` for one simulated node, run inside its namespace: the head with a Ray
    Client server (the driver in the root namespace is no Ray node), the dashboard off, a
    custom resource `e2e_node_K` naming the node, its own temp dir (all nodes share one file
    system, and Ray's socket names are fixed within a temp dir)."""
    argv = [ray_bin, "start", "--node-ip-address", node.address, "--num-cpus", str(num_cpus),
            "--num-gpus", "0", "--resources", json.dumps({f"e2e_node_{node.index}": 1}),
            "--temp-dir", f"{temp_dir}/n{node.index}",
            "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
    if node.index == head.index:
        argv += ["--head", "--port", str(RAY_PORT), "--ray-client-server-port",
                 str(CLIENT_PORT), "--include-dashboard=false",
                 "--system-config", json.dumps(HEAD_SYSTEM_CONFIG)]
    else:
        argv += ["--address", f"{head.address}:{RAY_PORT}"]
    return argv


def netns_exec(netns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv]


def available() -> str | None:
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "not root: `ip netns` needs root"
    if not shutil.which("ip"):
        return "no `ip` command (iproute2)"
    return None


def _run(argv: list[str], check: bool = True, timeout: float = 60, env=None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode:
        raise HarnessError(f"{' '.join(argv)}: exit {r.returncode}: "
                           f"{(r.stderr or r.stdout).strip()[-400:]}")
    return r.stdout


def used_subnets() -> set[int]:
    """K of every 10.K.0.0/24 route here (the subnets simulated hosts must not take)."""
    out = set()
    for line in _run(["ip", "-4", "route"], check=False).splitlines():
        parts = line.split()[0].split(".") if line.strip() else []
        if len(parts) == 4 and parts[0] == "10" and parts[1].isdigit():
            out.add(int(parts[1]))
    return out


def _stop_step(p) -> int:
    """When stop_ray stops a Ray process: 0 a raylet, 2 the GCS, 1 any other."""
    import psutil
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return 1
    exe = cmd[0] if cmd else ""
    return 0 if exe.endswith("raylet") else 2 if exe.endswith("gcs_server") else 1


def existing_namespaces() -> set[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@dataclass
class SimulatedHosts:
    n: int = 2
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000:05d}")
    subnet: int = 77
    log_dir: Path | None = None
    bridge: str = ""
    bridge_addr: str = ""
    nodes: list[SimNode] = field(default_factory=list)
    ray_started: list[SimNode] = field(default_factory=list)
    temp_dir: str = ""
    timing: dict = field(default_factory=dict)
    survivors: list[str] = field(default_factory=list)   # what stop_ray could not stop

    def __post_init__(self):
        self.bridge, self.bridge_addr, self.nodes = layout(self.n, self.tag, self.subnet)
        self.temp_dir = f"/tmp/e2eray-{self.tag}"

    @property
    def ray_address(self) -> str:
        return f"{self.nodes[0].address}:{RAY_PORT}"

    @property
    def ray_client_address(self) -> str:
        return f"ray://{self.nodes[0].address}:{CLIENT_PORT}"

    def __enter__(self) -> SimulatedHosts:
        why = available()
        if why:
            raise HarnessError(f"simulated hosts cannot be made: {why}")
        taken = used_subnets()
        if self.subnet in taken:       # another run's simulated hosts (or a real network)
            free = [k for k in range(77, 100) if k not in taken]
            if not free:
                raise HarnessError("simulated hosts: 10.77-99.0.0/24 are all in use")
            self.subnet = free[0]
            self.bridge, self.bridge_addr, self.nodes = layout(self.n, self.tag, self.subnet)
        t0 = time.monotonic()
        try:
            for argv in setup_commands(self.bridge, self.bridge_addr, self.nodes):
                _run(argv)
        except BaseException:
            self.remove()
            raise
        self.timing["network_s"] = round(time.monotonic() - t0, 2)
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def start_ray(self, num_cpus: int = 1, env: dict | None = None) -> None:
        """The head in node 0's namespace, then every other node joins it."""
        t0 = time.monotonic()
        ray_bin = str(Path(sys.executable).parent / "ray")
        Path(self.temp_dir).mkdir(parents=True, exist_ok=True)
        # A Ray worker that exits SIGKILLs its direct children (Ray's default): that would
        # take the harness's guardian with the actor and orphan the engine's own children.
        # Off, the guardian outlives its actor and stops the whole tree (reaper.py).
        full_env = {**os.environ, **RAY_NODE_ENV, **(env or {})}
        for nd in self.nodes:
            self.ray_started.append(nd)
            _run(netns_exec(nd.netns, ray_start_argv(ray_bin, nd, self.nodes[0], num_cpus,
                                                     self.temp_dir)), timeout=180, env=full_env)
        self.timing["ray_start_s"] = round(time.monotonic() - t0, 2)

    def raylet_pid(self, index: int) -> int | None:
        """The raylet of node `index` (its socket name is unique to the node)."""
        import psutil
        sock = f"{self.temp_dir}/n{index}/"
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd and cmd[0].endswith("raylet") and any(sock in a for a in cmd):
                return p.pid
        return None

    def ray_processes(self):
        """Every process inside this instance's namespaces (Ray's, and anything a Ray worker
        started there), found by the namespace's inode, never by name; plus any process that
        names this instance's temp dir on its command line."""
        import psutil
        inodes = set()
        for nd in self.nodes:
            try:
                inodes.add(os.stat(f"/run/netns/{nd.netns}").st_ino)
            except OSError:
                pass
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if os.stat(f"/proc/{p.pid}/ns/net").st_ino in inodes or any(
                        self.temp_dir in a for a in (p.info["cmdline"] or [])):
                    out.append(p)
            except (OSError, psutil.Error):
                continue
        return out

    def stop_ray(self, grace: float = 10.0) -> list[str]:
        """SIGTERM this cluster's Ray processes (found by their temp dir, never by name) in
        three steps, each once the one before is gone: the raylets, then every other process
        but the head's GCS, then the GCS; SIGKILL what is left after `grace` in all; returns
        the survivors (empty when all stopped). A raylet or the autoscaler's monitor stopped
        with or after the GCS keeps reconnecting to it until it is killed, the whole grace
        (the multi-node test's removal took 11.5-11.9 s so; about 4 s in this order)."""
        import psutil
        procs = self.ray_processes()
        steps = [(p, _stop_step(p)) for p in procs]
        deadline = time.monotonic() + grace
        alive = []
        for step in range(3):
            group = [p for p, s in steps if s == step]
            for p in group:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            _, left = psutil.wait_procs(group, timeout=max(0.0, deadline - time.monotonic()))
            alive += left
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        self.ray_started = []
        return [f"pid {p.pid}" for p in self.ray_processes()]

    def remove(self) -> None:
        t0 = time.monotonic()
        if self.ray_started:
            self.survivors = self.stop_ray()
        have = existing_namespaces()
        for argv in teardown_commands(self.bridge, self.nodes):
            if argv[:3] == ["ip", "netns", "del"] and argv[3] not in have:
                continue
            _run(argv, check=False)
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._keep_ray_logs()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.timing["remove_s"] = round(time.monotonic() - t0, 2)

    def _keep_ray_logs(self) -> None:
        """Each node's Ray logs into log_dir/ray/nK (when given) before the temp dir goes."""
        if not self.log_dir:
            return
        for logs in Path(self.temp_dir).glob("n*/session_*/logs"):
            try:
                shutil.copytree(logs, Path(self.log_dir) / "ray" / logs.parts[-3],
                                dirs_exist_ok=True)
            except (OSError, shutil.Error):
                pass

    def leftovers(self) -> list[str]:
        """Namespaces and links of this instance still present (empty after remove())."""
        left = [nd.netns for nd in self.nodes if nd.netns in existing_namespaces()]
        links = _run(["ip", "-br", "link"], check=False)
        names = {line.split()[0].split("@")[0] for line in links.splitlines() if line.strip()}
        left += [x for x in [self.bridge] + [nd.veth_host for nd in self.nodes] if x in names]
        return left
