"""The launcher seam: how a WorkerCommand (what an engine builds for a worker) becomes a
running process, and how its host is checked afterwards.

The Cluster asks a Launcher to start each worker and the gateway and gets back a Handle
(alive, exit code, log, stop, kill). Teardown verification runs where the processes ran, so
the Launcher provides it too: `baseline()` before the first start, `verify()` after the last
stop. It also names the nodes workers may go on (`nodes()`, for plan.place) and allocates
each worker's ports on its node (`allocate_ports`). `LocalLauncher` runs processes on this
host (ManagedProcess); `ray_launcher.RayLauncher` runs each role as a Ray actor on its node
(`--launcher ray`, E2E_LAUNCHER / E2E_RAY_ADDRESS). The Cluster's logic is the same for both.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from ..engines import LAUNCHERS
from ..specs.plan import LOCAL_NODES, Node, PlanEntry
from . import ports, teardown
from .process import ManagedProcess, StopReport
from .readiness import Alive, HttpGet, Readiness
from .reaper import extend_pythonpath


@dataclass(frozen=True)
class WorkerCommand:
    """What a worker runs: an engine's builder (engines/) makes it, a Launcher starts it."""
    argv: list[str]
    env: dict[str, str]                # overrides on top of the inherited environment
    protocol: str = "http"             # http | grpc
    readiness: Readiness = Alive()     # noqa: RUF009  (frozen) how the Cluster tells it is up
    worker_type: str = "regular"       # as smg calls the role: regular | prefill | decode | encode
    bootstrap_port: int | None = None  # PD bootstrap port smg must know (TokenSpeed)
    kv_connector: str | None = None    # smg POST /workers kv_connector (vLLM NIXL)
    start_stage: int = 0               # workers start stage by stage, each stage all at once
    metrics_dir: str | None = None     # Prometheus multiprocess files instead of /metrics
    unset_env: tuple[str, ...] = ()    # dropped from the inherited environment
    owned_ports: tuple[int, ...] = ()  # ports it binds beyond Ports (checked at teardown)
    stop_grace_s: float | None = None  # SIGTERM -> SIGKILL at stop; None: the cluster's
    log_note: str = ""                 # one line the harness writes into its log at the start
    # A variable that points the worker at a folder of its own process's, made at its start
    # and removed at its stop (ManagedProcess.tmp_env): where an engine leaves files, such as
    # IPC sockets, that a stopped worker does not remove.
    tmp_env: str = ""

    @property
    def health_path(self) -> str | None:
        """The HTTP path its readiness asks, None when it is not an HTTP check."""
        return self.readiness.path if isinstance(self.readiness, HttpGet) else None


def held_command(command: WorkerCommand) -> WorkerCommand | None:
    """The same worker started ahead and held (launchers/e2e_warm_spawn.py `--hold`): its
    interpreter runs the imports of the module it would run, then waits for `go` on its
    standard input (Cluster.restart). None where that cannot be: a command that is not
    `PYTHON -m MODULE ...`, or one whose engine writes Prometheus multiprocess files
    (`metrics_dir`), which are per process in a folder the live worker still writes. Pure
    but for the inherited PYTHONPATH, which the launchers' folder goes ahead of. Its imports
    run with the garbage collector off, the launcher's default (a command that already runs
    through the launcher keeps its own flags)."""
    argv = command.argv
    if command.metrics_dir or len(argv) < 3 or argv[1] != "-m":
        return None
    if argv[2] == "e2e_warm_spawn":
        held = [*argv[:3], "--hold", *argv[3:]]
    else:
        held = [argv[0], "-m", "e2e_warm_spawn", "--hold", "--run", argv[2], "--", *argv[3:]]
    env = {**command.env,
           "PYTHONPATH": extend_pythonpath(LAUNCHERS, command.env.get("PYTHONPATH"))}
    return replace(command, argv=held, env=env)


class Handle(Protocol):
    """One launched process as the Cluster sees it (ManagedProcess implements it). Local
    handles also offer `tree()` (the psutil processes of the worker's session), which only
    the local tools use: stack dumps (diagnostics.py), `cycles`, the fault tests."""
    name: str
    argv: list[str]
    log_path: Path
    started_at: float | None
    where: str               # ", node K (address)" on another node; "" on this host

    @property
    def pid(self) -> int: ...

    @property
    def exit_code(self) -> int | None: ...

    def alive(self) -> bool: ...

    def log_text(self, max_bytes: int = ...) -> str: ...

    def log_tail(self, n: int = ...) -> str: ...

    def failure_summary(self) -> str: ...

    def death_reason(self) -> str: ...

    def remember_descendants(self) -> None: ...

    def stop(self, grace: float = ...) -> StopReport: ...

    def kill(self) -> None: ...


@dataclass
class Baseline:
    """What the host looked like before the start (compared at teardown).

    A topology that shares the devices with other processes' topologies (pytest-xdist workers:
    pytest_xdist.py) is `shared`: its teardown cannot compare device memory or /dev/shm with
    a baseline while the others run. It checks its own processes instead: none of `own_pids`
    (its processes and every descendant seen) may still hold memory on `own_gpus` (NVML's
    per-process list). The device-level check and the /dev/shm clean-up run once every worker
    has ended (pytest_xdist.devices_after), against the session's baseline."""
    shm: set[str] = field(default_factory=set)
    gpu_mib: dict[int, float] = field(default_factory=dict)
    shared: bool = False
    own_gpus: tuple[int, ...] = ()
    own_pids: set[int] = field(default_factory=set)
    gpus: tuple[int, ...] = ()        # the devices asked (gpu_mib is {} where NVML read none)


class Launcher(Protocol):
    def nodes(self) -> tuple[Node, ...]: ...

    def allocate_ports(self, entry: PlanEntry, n: int) -> list[int]: ...

    def baseline(self, gpus: tuple[int, ...]) -> Baseline: ...

    def start(self, name: str, command: WorkerCommand, log_path: Path,
              cores: tuple[int, ...] = (), node: int | None = None) -> Handle: ...
    # node None: this host (the gateway); else the plan's node index

    def verify(self, stops: list[StopReport], ports: set[int],
               baseline: Baseline) -> teardown.TeardownReport: ...


class LocalLauncher:
    """Processes on this host, each in its own session with its own log (process.py)."""

    def nodes(self) -> tuple[Node, ...]:
        return LOCAL_NODES

    def allocate_ports(self, entry: PlanEntry, n: int) -> list[int]:
        return ports.allocate(n)

    def baseline(self, gpus: tuple[int, ...]) -> Baseline:
        return Baseline(shm=teardown.shm_snapshot(),
                        gpu_mib=teardown.gpu_memory_mib(gpus) if gpus else {}, gpus=tuple(gpus))

    def start(self, name: str, command: WorkerCommand, log_path: Path,
              cores: tuple[int, ...] = (), node: int | None = None,
              held: bool = False) -> ManagedProcess:
        """`held`: started ahead, waiting for its release() (held_command; a held
        command has no metrics folder, which the live worker would still be writing)."""
        if command.metrics_dir:   # must exist, and start empty (a restart starts counters anew)
            if held:
                raise ValueError(f"{name}: a held command cannot have a metrics folder")
            shutil.rmtree(command.metrics_dir, ignore_errors=True)
            Path(command.metrics_dir).mkdir(parents=True)
        return ManagedProcess(name, command.argv, command.env, log_path,
                              unset_env=command.unset_env, cpu_affinity=cores,
                              held=held, note=command.log_note,
                              tmp_env=command.tmp_env).start()

    def verify(self, stops: list[StopReport], ports: set[int],
               baseline: Baseline) -> teardown.TeardownReport:
        t0 = time.monotonic()
        rep = teardown.TeardownReport()
        rep.escalated = [r.name for r in stops if r.escalated]
        rep.survivors = [s for r in stops for s in r.survivors]
        rep.escaped = [s for r in stops for s in r.escaped]
        busy = teardown.listening_ports(ports)
        if busy is None:
            rep.unverified.append(f"ports {sorted(ports)}: the listening sockets could not be "
                                  "listed")
        rep.busy_ports = busy or []
        if baseline.shared:           # booted with others on its devices: its own processes
            teardown.check_gpu_own(rep, baseline.own_gpus, baseline.own_pids)
        else:
            teardown.check_gpu(rep, baseline.gpu_mib)     # measured settle; names the holders
            missing = sorted(set(baseline.gpus) - set(baseline.gpu_mib))
            if missing:      # a GPU check over nothing: never clean
                rep.unverified.append(f"GPU memory of GPU(s) {missing}: NVML read nothing at "
                                      "the start, so there was no baseline to compare with")
            rep.shm_removed, rep.shm_left = teardown.clean_shm(baseline.shm)
        rep.seconds = round(time.monotonic() - t0, 2)
        return rep
