"""Cluster: one context manager that owns a topology's whole life.

    with Cluster(model=DEFAULT_MODEL, engine=DEFAULT_ENGINE, topology="1p1d") as c:
        c.chat("Say hi")
        gsm8k.run(c.gateway_url, c.model_name, n=32)

Construction validates everything (registry, topology x engine, weights, devices) and raises a
one-line ConfigError before any process starts. `start()` launches every worker of a start
stage at once, waits for each one's readiness AND liveness (a worker that exits fails the
topology at once, naming role, argv, exit code, error line and log tail), then starts the
gateway and probes it with a real completion. `stop()` stops everything in parallel and
verifies teardown.

The Cluster orchestrates only: what a worker runs, how it is ready, which ports it binds and
which counters show it working come from its engine (engines.for_topology -> Engine); how a
command becomes a process, and what the host looks like afterwards, from its launcher
(launcher.LocalLauncher by default); where it goes from plan.place.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from .. import engines, startup
from ..engines import (
    DEFAULT_ENGINE,
    Engine,
    EngineOptions,
    KnownCrash,
    Ports,
)
from ..errors import ConfigError, StartupError, UpstreamBug, WorkerDied
from ..lifecycle import ports, reaper, teardown
from ..lifecycle.launcher import (
    Baseline,
    Handle,
    Launcher,
    LocalLauncher,
    WorkerCommand,
    held_command,
)
from ..lifecycle.process import StopReport, classify_log
from ..lifecycle.ray_launcher import RayLauncher
from ..lifecycle.readiness import (
    GATEWAY_READY_S,
    POLL_S,
    AllOf,
    HttpGet,
    ModelServed,
    Step,
    legs_to_warm,
)
from ..load.load import Watchdog
from ..specs import plan as planner
from ..specs import settings
from ..specs import topology as topologies
from ..specs.model_specs import DEFAULT_MODEL, ModelSpec, get_spec
from ..specs.models import cache_dir, check_config_json, weights_path
from ..specs.plan import Plan, PlanEntry
from ..specs.topology import Topology
from . import gateway as gw
from . import hostload, idle, metrics, progress
from .diagnostics import diagnose_stall, stack_dumps

PORT_RETRIES = 2
STOP_GRACE_S = 15.0
REQUEST_TIMEOUT_S = 120.0     # one request of Cluster.client (chat, evals through it)
# How long the watchdog's engine poll waits for a worker's /metrics. On a 2-core runner,
# during a 1p1d cross_request recall pass in float32, the API servers answer in up to about
# 10 s (the prefill's engine on 1.3 cores, the decode's on 0.6 while it holds KV); a 2 s poll
# makes a slow answer no answer and the work done meanwhile no progress.
WORK_SCRAPE_S = 15.0

_ids = itertools.count(1)


def results_root() -> Path:
    """This run's results folder (settings.results_dir: E2E_RESULTS_DIR, or one of its own)."""
    return settings.results_dir()


def make_launcher(name: str | None = None, address: str | None = None) -> Launcher:
    """The launcher E2E_LAUNCHER (or `--launcher`) names: local, or ray on the cluster at
    E2E_RAY_ADDRESS."""
    name = name or settings.get("E2E_LAUNCHER")
    if name == "ray":
        return RayLauncher(address or settings.get("E2E_RAY_ADDRESS"))
    return LocalLauncher()


def default_backend() -> str:
    return startup.resolve_backend(None)


@dataclass
class Worker:
    entry: PlanEntry
    ports: Ports
    command: WorkerCommand
    process: Handle | None = None
    ready_s: float | None = None
    restarts: int = 0
    # Its next restart's process, started ahead with the boot and held (Cluster.hold_restarts).
    held: Handle | None = None
    held_at: float | None = None       # epoch seconds of that start

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def url(self) -> str:
        scheme = "grpc" if self.command.protocol == "grpc" else "http"
        return f"{scheme}://{self.entry.host}:{self.ports.api}"

    @property
    def http_url(self) -> str:
        return f"http://{self.entry.host}:{self.ports.api}"

    def metrics(self, timeout: float = 5.0) -> dict:
        if self.command.metrics_dir:      # no /metrics endpoint, multiprocess files instead
            return metrics.read_multiproc_dir(self.command.metrics_dir)
        return metrics.scrape(f"{self.http_url}/metrics", timeout=timeout)


@dataclass(frozen=True)
class ExtraGateway:
    """A second gateway of a running topology (Cluster.extra_gateway)."""
    name: str
    url: str
    metrics_url: str
    argv: list[str]
    process: Handle


@dataclass
class Timing:
    workers: dict[str, float] = field(default_factory=dict)   # name -> seconds to ready
    topology_ready_s: float | None = None                     # first start -> last worker ready
    gateway_ready_s: float | None = None
    # The gateway's readiness probes that failed once it listed the model, each {"after_s",
    # "error"} (readiness.ModelServed.failures): why a gateway took long to be ready.
    gateway_probe_failures: list = field(default_factory=list)
    # [name, seconds from launch to ready] of every second gateway (extra_gateway; pinned ones
    # included): what a pass through one of them paid before its first request.
    extra_gateways: list = field(default_factory=list)
    total_ready_s: float | None = None
    teardown_s: float | None = None
    # Epoch seconds, for the lane's time report (time_report.py): when the boot and the
    # teardown began, and [start, seconds] of every restarted worker's boot.
    boot_started: float | None = None
    teardown_started: float | None = None
    restart_boots: list = field(default_factory=list)
    # [start, seconds] of every time the session's main thread was blocked on this cluster's
    # boots (a boot or restart it ran itself, or a wait for one booting in a thread): what the
    # lane waited on, against boots that ran beside its tests (time_report `boot_waited_s`).
    boot_waits: list = field(default_factory=list)
    # Per worker boot (a restart as NAME#N): seconds after its launch when each boot state of
    # its log (progress.py's markers) was first seen, and `ready` (time_report.boot_phases).
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # [start, seconds] of every held interpreter's imports (Cluster.hold_restarts): boot
    # seconds of their own, wherever they fall (time_report), besides the restart's own boot
    # from its release; `held` what became of each: {name: "released" | why not}.
    held_imports: list = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)


# The line a held interpreter prints once its imports are done (launchers/e2e_warm_spawn.py).
HELD_LINE = re.compile(r"e2e_warm_spawn \(pid \d+\): held: imports ([0-9.]+) s")


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def waiting_on_boot(timing: Timing):
    """Record the block's span in `timing.boot_waits` where the session's main thread runs
    it: the lane waits on a boot there."""
    epoch, t0 = time.time(), time.monotonic()
    try:
        yield
    finally:
        if _on_main_thread():
            timing.boot_waits.append([epoch, round(time.monotonic() - t0, 2)])


class Cluster:
    live: set[Cluster] = set()
    live_lock = threading.Lock()

    def __init__(self, model: str | ModelSpec = DEFAULT_MODEL, engine: str = DEFAULT_ENGINE,
                 topology: str | Topology = "1", backend: str | None = None,
                 devices: str | None = None, options: EngineOptions | None = None,
                 admission: gw.Admission | None = None, policy: str = "round_robin",
                 startup_timeout: float | None = None, results_dir: Path | str | None = None,
                 name: str | None = None, gateway_args: tuple[str, ...] = (),
                 launcher: Launcher | None = None, plan: Plan | None = None,
                 shared_devices: bool = False, hold_restarts: bool = False,
                 need_weights: bool = True, model_path: Path | str | None = None):
        self.spec: ModelSpec = model if isinstance(model, ModelSpec) else get_spec(model)
        self.engine = engine
        self.topology = topologies.parse(topology)     # a Topology is taken as it is
        self.driver: Engine = engines.for_topology(engine, self.topology)
        self.spec.require(engine, self.topology.kind)
        self.backend = startup.resolve_backend(backend, source="backend")
        if self.backend not in self.driver.backends:
            why = "" if backend or settings.raw("E2E_BACKEND") else \
                " (no backend given and NVML sees no GPU here)"
            raise ConfigError(f"engine {engine!r} ({self.driver.name}) runs on "
                              f"{' or '.join(self.driver.backends)} only; backend is "
                              f"{self.backend}{why}")
        if devices:
            startup.check_devices(devices, self.backend, "devices")
        # need_weights=False: a plan only (`python -m e2e_test plan`), whose commands name the
        # folder the weights will be in
        # `model_path`: a folder to load instead of the registry's, served under the model's
        # name (a perturbed copy of its weights: test_perturbed.py)
        if model_path is not None:
            self.model_path = Path(model_path)
            check_config_json(self.spec, self.model_path, f"model_path={model_path}")
        else:
            self.model_path = (weights_path(self.spec) if need_weights
                               else weights_path(self.spec, must_exist=False))
        self.launcher: Launcher = launcher or make_launcher()
        # `plan`: placed already by the caller (the pytest plugin's check at collection, with
        # the same model, backend, devices, engine and this launcher's nodes): not placed again.
        if plan is not None and (plan.topology != self.topology.name
                                 or plan.backend != self.backend):
            raise ConfigError(f"plan {plan.topology!r} on {plan.backend} given for topology "
                              f"{self.topology.name!r} on {self.backend}")
        self.plan: Plan = plan if plan is not None else planner.place(
            self.topology, self.spec, self.backend,
            startup.machine_devices(self.topology, self.backend, devices), self.driver,
            nodes=self.launcher.nodes())
        self.admission = admission
        self.policy = policy
        self.gateway_args = tuple(gateway_args)
        self.startup_timeout = startup_timeout or self.spec.startup_timeout_s
        self.name = name or f"{self.engine}-{self.topology.name}-{os.getpid()}-{next(_ids)}"
        self.dir = Path(results_dir) if results_dir else results_root() / "clusters" / self.name
        opts = replace(options or EngineOptions(), backend=self.backend)
        if not opts.state_dir:
            opts = replace(opts, state_dir=str(self.dir.resolve() / "state"))
        if not opts.compile_cache_dir and settings.get("E2E_COMPILE_CACHE") == "shared":
            # Booted together with others (shared_devices): a cache of its own topology, so
            # two compiles of the same graphs never write one folder at once.
            sub = f"{self.engine}-{self.topology.name}" if shared_devices else ""
            opts = replace(opts, compile_cache_dir=str(cache_dir() / "compile" / sub))
        self.options = self.driver.prepare(self.topology, self.spec, opts, self.dir,
                                           ports.allocate_block)
        self.workers: list[Worker] = [self._make_worker(e) for e in self.plan.entries]
        self.gateway_port, self.prometheus_port = ports.allocate(2)
        self.gateway: Handle | None = None
        self.gateway_argv: list[str] | None = None
        self.timing = Timing()
        self.teardown_report: teardown.TeardownReport | None = None
        self.stop_reports: list[StopReport] = []
        self._baseline = Baseline()
        # Sharing the devices with other processes' topologies (pytest-xdist workers): teardown
        # checks this topology's own processes, not the devices' memory, which the others
        # still hold (launcher.Baseline).
        self.shared_devices = shared_devices
        # Each worker's next restart started ahead, with the boot, and held until restart()
        # releases it (launcher.held_command: its imports done beside the boot, not after the
        # loss). Chosen by the caller where restarts will come and cores are to spare; on this
        # host only.
        self.hold_restarts = hold_restarts and isinstance(self.launcher, LocalLauncher)
        self.stopped = False
        self._client: httpx.Client | None = None
        self._work_seen: dict[str, float] = {}     # engine_work: each worker's last answer
        self._extra_ports: set[int] = set()          # extra_gateway's
        self._extra_gateways: list[Handle] = []      # ... running
        self._extra_stops: list[StopReport] = []     # ... stopped

    # -- construction helpers -----------------------------------------------------------------
    def _make_worker(self, entry: PlanEntry) -> Worker:
        names = self.driver.aux_ports(self.topology, entry, self.options)
        preset = self.driver.fixed_ports(self.options)
        spans = {n: self.driver.aux_port_span(n, entry) for n in names if n not in preset}
        # A port that stands for several (the worker binds the ones above it too): a block of
        # free ports on the local launcher, so nothing else of the session gets one of them.
        blocks = {n: ports.allocate_block(k) for n, k in spans.items()
                  if k > 1 and isinstance(self.launcher, LocalLauncher)}
        fresh = [n for n in names if n not in preset and n not in blocks]
        allocated = self.launcher.allocate_ports(entry, 1 + len(fresh))
        aux = {**dict(zip(fresh, allocated[1:])), **blocks,
               **{n: preset[n] for n in names if n in preset}}
        p = Ports(api=allocated[0], aux=aux)
        cmd = self.driver.worker_command(self.spec, self.topology, entry, p,
                                         str(self.model_path), self.options, self.dir)
        return Worker(entry, p, cmd)

    @property
    def allocated_ports(self) -> set[int]:
        out = {self.gateway_port, self.prometheus_port, *self._extra_ports}
        for w in self.workers:
            out.add(w.ports.api)
            out.update(w.ports.aux.values())
            out.update(w.command.owned_ports)
        return out

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def gateway_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    @property
    def model_name(self) -> str:
        return self.spec.id

    def role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.entry.role == role]

    def describe(self) -> dict:
        return {
            "name": self.name, "engine": self.engine, "model": self.spec.id,
            "topology": self.topology.name, "backend": self.backend,
            "plan": self.plan.to_dict(),
            "workers": [{"name": w.name, "url": w.url, "argv": w.command.argv,
                         "env": w.command.env, "ready_s": w.ready_s, "restarts": w.restarts,
                         "log": str(w.process.log_path) if w.process else None,
                         "held": {"pid": w.held.pid, "log": str(w.held.log_path)}
                         if w.held else None}
                        for w in self.workers],
            "gateway": {"url": self.gateway_url, "metrics": self.gateway_metrics_url,
                        "argv": self.gateway_argv},
            "timing": vars(self.timing),
            "teardown": self.teardown_report.to_dict() if self.teardown_report else None,
        }

    # -- life ---------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop(verify_strict=False)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop(verify_strict=None if exc[0] is None else False)

    def start(self) -> Cluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        # What a dead earlier run left, and GPU memory held by others: before anything starts.
        # (GPU memory held by others: not checked where other processes' topologies share the
        # devices by design, pytest-xdist workers; their controller checked it before them)
        reaper.preflight(self.plan.devices if self.backend == "cuda" and not self.shared_devices
                         else (), self.dir)
        (self.dir / "plan.txt").write_text(self.plan.describe() + "\n")
        with Cluster.live_lock:
            Cluster.live.add(self)
        gpus = self.plan.devices if self.backend == "cuda" else ()
        if self.shared_devices:
            self._baseline = replace(self.launcher.baseline(()), shared=True, own_gpus=gpus)
        else:
            self._baseline = self.launcher.baseline(gpus)
        t0 = time.monotonic()
        self.timing.boot_started = time.time()
        with waiting_on_boot(self.timing), self._host_load_named():
            self._start_workers(t0)
            self.timing.topology_ready_s = round(time.monotonic() - t0, 2)
            self._start_gateway()
        self.timing.total_ready_s = round(time.monotonic() - t0, 2)
        (self.dir / "cluster.json").write_text(json.dumps(self.describe(), indent=2, default=str))
        return self

    def _host_load_named(self):
        """A boot's StartupError names the processes outside this session that were busy
        meanwhile (hostload.py), where the workers run on this host."""
        return hostload.named_on_failure((StartupError,), isinstance(self.launcher, LocalLauncher))

    def _log_path(self, w: Worker, restarts: int) -> Path:
        return self.dir / "logs" / f"{w.name}{'.' + str(restarts) if restarts else ''}.log"

    def _launch(self, w: Worker) -> None:
        w.process = self.launcher.start(w.name, w.command, self._log_path(w, w.restarts),
                                        cores=w.entry.cores, node=w.entry.node)

    def _hold(self, w: Worker) -> None:
        """Start `w`'s next restart ahead, held (hold_restarts)."""
        cmd = held_command(w.command)
        if cmd is None:
            self.timing.held[w.name] = "not held: its command cannot be (launcher.held_command)"
            return
        w.held_at = time.time()
        w.held = self.launcher.start(w.name, cmd, self._log_path(w, w.restarts + 1),
                                     cores=w.entry.cores, node=w.entry.node, held=True)

    def _held_done(self, w: Worker, outcome: str) -> Handle | None:
        """Take `w`'s held process off it, recording its imports as boot seconds (to the line
        it printed, or to now where it printed none) and what became of it."""
        h, w.held = w.held, None
        if h is None:
            return None
        m = HELD_LINE.search(h.log_text(200_000))
        took = float(m.group(1)) if m else max(0.0, time.time() - w.held_at)
        self.timing.held_imports.append([w.held_at, round(took, 2)])
        self.timing.held[w.name] = outcome
        return h

    def _start_workers(self, t0: float) -> None:
        stages = sorted({w.command.start_stage for w in self.workers})
        deadline = t0 + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            for stage in stages:
                group = [w for w in self.workers if w.command.start_stage == stage]
                for w in group:        # all at once: launching returns immediately
                    self._launch(w)
                if self.hold_restarts:
                    for w in group:
                        self._hold(w)
                self._wait_ready(group, client, deadline)

    def _wait_ready(self, group: list[Worker], client: httpx.Client, deadline: float) -> None:
        pending = list(group)
        boot = progress.BootProgress(self.topology.name, group)   # a line every ~10 s
        while pending:
            boot.tick(pending)
            for w in list(pending):
                if not w.process.alive():
                    self._handle_early_exit(w)
                    continue
                if w.command.readiness.ready(client):
                    w.ready_s = round(time.monotonic() - w.process.started_at, 2)
                    self.timing.workers[w.name] = w.ready_s
                    key = f"{w.name}#{w.restarts}" if w.restarts else w.name
                    self.timing.phases[key] = {**boot.phases.get(w.name, {}), "ready": w.ready_s}
                    pending.remove(w)
                else:
                    w.process.remember_descendants()
            self._check_others_alive(group)
            if pending and time.monotonic() > deadline:
                names = ", ".join(w.name for w in pending)
                tails = "\n".join(f"--- {w.name} ({w.process.log_path}): "
                                  f"{w.command.readiness.pending()}\n"
                                  f"{w.process.log_tail(15)}" for w in pending)
                # where each one was when time ran out (a worker stuck in its first CUDA-graph
                # capture says nothing in its log; its stack does)
                where = self.dir / "boot-stall"
                dumps = stack_dumps(self, where, workers=pending)
                raise StartupError(f"topology {self.topology.name}: {names} not ready within "
                                   f"{self.startup_timeout:.0f} s",
                                   f"{tails}\nstack dumps ({len(dumps)}) in {where}")
            if pending:
                time.sleep(POLL_S)

    def _check_others_alive(self, group: list[Worker]) -> None:
        """A worker that was ready earlier and died fails the start too."""
        for w in self.workers:
            if w.process and w not in group and not w.process.alive():
                head, _, details = w.process.failure_summary().partition("\n")
                raise StartupError(head, details)

    def _handle_early_exit(self, w: Worker) -> None:
        hit = classify_log(w.process.log_text())
        if hit and hit[0] == "address_in_use" and w.restarts < PORT_RETRIES:
            # Another process took one of our ports between allocation and bind: move.
            w.process.stop(grace=2)
            w.restarts += 1
            new = self._make_worker(w.entry)
            w.ports, w.command = new.ports, new.command
            self._launch(w)
            return
        summary = w.process.failure_summary()
        head, _, details = summary.partition("\n")
        raise StartupError(f"topology {self.topology.name} ({self.engine}): {head}", details)

    def _start_gateway(self) -> None:
        t0 = time.monotonic()
        self.gateway_argv, self.gateway, dynamic = self._spawn_gateway(
            self.gateway_port, self.prometheus_port, self.admission, "gateway")
        self.timing.gateway_probe_failures = self._await_gateway(
            self.gateway_port, self.gateway, "gateway", dynamic)
        self.timing.gateway_ready_s = round(time.monotonic() - t0, 2)

    def _gateway_worker(self, w: Worker) -> gw.GatewayWorker:
        return gw.GatewayWorker(url=w.url, worker_type=w.command.worker_type,
                                bootstrap_port=w.command.bootstrap_port,
                                kv_connector=w.command.kv_connector,
                                runtime_type=self.driver.gateway_runtime)

    def _gateway_config(self, port: int, prometheus_port: int,
                        admission: gw.Admission | None) -> gw.GatewayConfig:
        gws = tuple(self._gateway_worker(w) for w in self.workers
                    if w.command.worker_type != "none")
        return gw.GatewayConfig(kind=self.topology.kind, workers=gws, port=port,
                                prometheus_port=prometheus_port, policy=self.policy,
                                dp_aware=self.topology.engine_dp, admission=admission,
                                extra_args=(*self.driver.gateway_args(self.topology),
                                            *self.gateway_args),
                                model_path=str(self.model_path))

    def _spawn_gateway(self, port: int, prometheus_port: int, admission: gw.Admission | None,
                       name: str, only: Worker | None = None) -> tuple[list[str], Handle, list]:
        """A gateway in front of every serving worker (`only`: that one alone, gateway.pinned),
        started: (argv, handle, the workers it must be sent through POST /workers)."""
        cfg = self._gateway_config(port, prometheus_port, admission)
        if only is not None:
            cfg = gw.pinned(cfg, only.url)
        argv = gw.build_argv(cfg)
        handle = self.launcher.start(name, WorkerCommand(argv, {}),
                                     self.dir / "logs" / f"{name}.log")
        return argv, handle, cfg.dynamic()

    def _await_gateway(self, port: int, handle: Handle, name: str, dynamic: list,
                       pinned: bool = False) -> list:
        """Until the gateway is ready: workers registered where the mode registers them, the
        model served; StartupError when it dies or the time is up. Returns the probes that
        failed on the way (readiness.ModelServed.failures). `pinned`: it fronts one worker,
        which one probe reaches."""
        t0 = time.monotonic()
        url = f"http://127.0.0.1:{port}"
        served = ModelServed(url, self.model_name, 1 if pinned else legs_to_warm(
            w.command.worker_type for w in self.workers if w.command.worker_type != "none"))
        ready = AllOf(HttpGet(port, "/health"),
                      *([Step("registering workers", lambda: gw.register_workers(
                          url, dynamic, timeout=GATEWAY_READY_S,
                          alive=handle.alive))] if dynamic else []),
                      served)
        deadline = t0 + GATEWAY_READY_S
        with httpx.Client(timeout=30.0) as client:
            while True:
                if not handle.alive():
                    head, _, details = handle.failure_summary().partition("\n")
                    raise StartupError(head, details)
                self._check_others_alive([])
                if ready.ready(client):
                    return list(served.failures)
                if time.monotonic() > deadline:
                    raise StartupError(f"{name} not ready within {GATEWAY_READY_S:.0f} s: "
                                       f"{ready.pending()}", handle.log_tail(20))
                time.sleep(POLL_S)

    @contextmanager
    def extra_gateway(self, admission: gw.Admission | None, name: str = "gateway-2",
                      only: str | None = None):
        """A second gateway in front of the same running workers, configured differently
        (admission, for the window bursts), or in front of worker `only` alone (pinned): the
        workers need no restart for a gateway setting. Yields an ExtraGateway; stopped at the
        end, and its stop report and ports join this topology's teardown verification."""
        one = self.worker(only) if only is not None else None
        port, prom = ports.allocate(2)
        self._extra_ports.update((port, prom))
        argv, handle, dynamic = self._spawn_gateway(port, prom, admission, name, one)
        self._extra_gateways.append(handle)          # stop() stops it if we never get back
        try:
            t0 = time.monotonic()
            self._await_gateway(port, handle, name, dynamic, pinned=one is not None)
            self.timing.extra_gateways.append([name, round(time.monotonic() - t0, 2)])
            yield ExtraGateway(name, f"http://127.0.0.1:{port}",
                               f"http://127.0.0.1:{prom}/metrics", argv, handle)
        finally:
            if handle in self._extra_gateways:        # (not when stop() has stopped it)
                self._extra_gateways.remove(handle)
                self._extra_stops.append(handle.stop(grace=STOP_GRACE_S))

    @contextmanager
    def pinned(self, worker: str):
        """A gateway in front of worker `worker` alone (gateway.pinned), for a pass that must
        reach that worker only: every worker has an endpoint there, whatever protocol it
        serves the topology's gateway with. Yields an ExtraGateway; stopped at the end, its
        teardown verified with the topology's (extra_gateway)."""
        with self.extra_gateway(None, name=f"gateway-{worker}", only=worker) as g:
            yield g

    def stop(self, verify_strict: bool | None = None) -> teardown.TeardownReport:
        if self.stopped:
            return self.teardown_report
        self.stopped = True
        t0 = time.monotonic()
        self.timing.teardown_started = time.time()
        if self._client:
            self._client.close()
        procs = [w.process for w in self.workers if w.process] + self._extra_gateways
        procs += [h for w in self.workers if (h := self._held_done(w, "stopped unused"))]
        self._extra_gateways = []
        if self.gateway:
            procs.insert(0, self.gateway)
        # A worker's own grace where its engine sets one (an engine whose own SIGTERM path
        # ends in a SIGKILL of itself after seconds; see that engine's STOP_GRACE_S).
        grace = {id(w.process): w.command.stop_grace_s for w in self.workers
                 if w.process and w.command.stop_grace_s is not None}
        with ThreadPoolExecutor(max_workers=max(1, len(procs))) as ex:
            self.stop_reports = list(ex.map(
                lambda p: p.stop(grace=grace.get(id(p), STOP_GRACE_S)), procs))
        self.stop_reports += self._extra_stops
        if self._baseline.shared:
            self._baseline.own_pids = self._own_pids(procs)
        rep = self.launcher.verify(self.stop_reports, self.allocated_ports, self._baseline)
        rep.seconds = round(time.monotonic() - t0, 2)
        self.timing.teardown_s = rep.seconds
        self.teardown_report = rep
        with Cluster.live_lock:
            Cluster.live.discard(self)
        try:
            if self.dir.exists():
                (self.dir / "cluster.json").write_text(
                    json.dumps(self.describe(), indent=2, default=str))
        except OSError:
            pass
        teardown.enforce(rep, f"{self.topology.name} ({self.name})", strict=verify_strict)
        return rep

    @staticmethod
    def _own_pids(procs) -> set[int]:
        """Every pid this topology started or saw among its processes' descendants."""
        out: set[int] = set()
        for p in procs:
            pid = getattr(p, "pid", None)
            if isinstance(pid, int) and pid > 0:
                out.add(pid)
            out.update(getattr(p, "known", {}) or {})
        return out

    def kill_now(self) -> None:
        """Second Ctrl-C: SIGKILL every process tree at once, no grace."""
        for p in [self.gateway, *self._extra_gateways] + [w.process for w in self.workers] \
                + [w.held for w in self.workers]:
            if p:
                p.kill()

    # -- clients ------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.gateway_url, timeout=REQUEST_TIMEOUT_S)
        return self._client

    def chat(self, content: str, max_tokens: int = 32, **kw) -> dict:
        r = self.client.post("/v1/chat/completions", json={
            "model": self.model_name, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **kw})
        r.raise_for_status()
        return r.json()

    def _dead(self) -> list[tuple[str, KnownCrash | None]]:
        """(line, the known upstream crash it shows or None) for every worker (or gateway)
        that exited."""
        out = []
        roles = {id(w.process): w.entry.role for w in self.workers}
        handles = [(name, p) for name, p in
                   ([("gateway", self.gateway)] + [(h.name, h) for h in self._extra_gateways]
                    + [(w.name, w.process) for w in self.workers])
                   if p is not None and p.started_at is not None]
        # asked at once: on a busy host a remote handle's answer may take its whole status
        # timeout (ray_launcher.STATUS_TIMEOUT_S, 5 s), and asked one after the other the
        # waits add up: a killed decode across two simulated nodes is named after twice that
        # timeout, past the multi-node test's 10 s
        with ThreadPoolExecutor(max_workers=max(1, len(handles))) as ex:
            alive = list(ex.map(lambda h: h[1].alive(), handles))
        for (name, p), up in zip(handles, alive):
            if not up:
                known = (self.driver.known_crash(roles[id(p)], p.log_text(200_000))
                         if id(p) in roles else None)
                out.append((f"{name} (pid {p.pid}{p.where}) died: {p.death_reason()}", known))
        return out

    def dead_processes(self) -> str | None:
        """One line naming every worker (or the gateway) that exited, with its exit code, and
        the known upstream bug it died of where its engine names one (Engine.known_crashes)."""
        dead = self._dead()
        if not dead:
            return None
        return (f"topology {self.topology.name} ({self.engine}): "
                + "; ".join(line + (f"; {k.line()}" if k else "") for line, k in dead))

    def death_error(self, message: str) -> WorkerDied:
        """The error for a dead topology: UpstreamBug when a worker died of a known upstream
        crash, else WorkerDied."""
        known = any(k for _, k in self._dead())
        return (UpstreamBug if known else WorkerDied)(message)

    def check_alive(self) -> None:
        """Raise death_error when a worker or the gateway has exited."""
        dead = self.dead_processes()
        if dead:
            raise self.death_error(dead)

    def watchdog(self, what: str, window_s: float | None = None):
        """A load.Watchdog that fails on a dead worker within a second and on a stall after
        the window (E2E_WATCHDOG_S, default 60 s), attaching queues and stack dumps."""
        window = window_s if window_s is not None else settings.get("E2E_WATCHDOG_S")
        return Watchdog(window_s=window, what=f"{what} on {self.topology.name}",
                        diagnose=lambda: diagnose_stall(self), check=self.dead_processes,
                        died=self.death_error,
                        engine_progress=self.engine_work)

    def worker_work(self, w: Worker, timeout: float = WORK_SCRAPE_S) -> float | None:
        """Tokens worker `w` has processed (the sum of the engine's work counters); None when
        it does not answer within `timeout`."""
        try:
            s = w.metrics(timeout=timeout)
        except Exception:
            return None
        return sum(metrics.total(s, name) for name in self.driver.work_counters)

    def engine_work(self) -> float | None:
        """Tokens all workers have processed, asked in parallel; a worker that does not
        answer counts with its last answer (its counters only grow while it lives), so a
        late /metrics is never a drop in work and a rise is always work done. None until a
        worker has answered."""
        workers = list(self.workers)
        with ThreadPoolExecutor(max_workers=max(1, len(workers))) as ex:
            answers = list(ex.map(self.worker_work, workers))
        for w, v in zip(workers, answers):
            if v is not None:
                self._work_seen[w.name] = v
        return sum(self._work_seen.values()) if self._work_seen else None

    def gateway_metrics(self) -> dict:
        return metrics.scrape(self.gateway_metrics_url)

    # -- serving faults -----------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None, **kw):
        """Every role back to no running / waiting requests and ~0 KV-cache usage (and no
        request in flight at the gateway); IdleError naming the role and the numbers."""
        return idle.wait_idle(self, idle.DEFAULT_TIMEOUT_S if timeout is None else timeout, **kw)

    def worker(self, name: str) -> Worker:
        for w in self.workers:
            if w.name == name:
                return w
        raise ConfigError(f"topology {self.topology.name}: no worker {name!r} "
                          f"(workers: {', '.join(w.name for w in self.workers)})")

    def _release_or_launch(self, w: Worker) -> None:
        """Release `w`'s held process as its new one, or launch one where none is held or the
        held one is gone (stopped, its end recorded)."""
        h = w.held
        if h is not None and h.release():
            self._held_done(w, "released")
            w.process = h
            return
        if h is not None:
            why = f"gone ({h.death_reason()}) at the restart: launched afresh"
            self._held_done(w, why)
            h.stop(grace=2.0)
            print(f"{self.name}: {w.name}'s held process {why}", flush=True)
        self._launch(w)

    def restart(self, name: str, timeout: float | None = None) -> Worker:
        """Stop worker `name` (dead or alive), start it again with the same command and ports,
        wait for it, and register it with smg again where the mode registers dynamically."""
        w = self.worker(name)
        if w.process is not None:
            rep = w.process.stop(grace=5.0)
            if rep.survivors:
                raise StartupError(f"restart {name}: the old process tree did not stop",
                                   "\n".join(rep.survivors))
        t0, epoch = time.monotonic(), time.time()
        w.restarts += 1
        with waiting_on_boot(self.timing), self._host_load_named():
            self._release_or_launch(w)
            with httpx.Client(timeout=2.0) as client:
                self._wait_ready([w], client, t0 + (timeout or self.startup_timeout))
        self.timing.restart_boots.append([epoch, round(time.monotonic() - t0, 2)])
        again = self._gateway_worker(w)
        if self.gateway is not None and again.register_dynamically:
            gw.register_workers(self.gateway_url, [again], timeout=120,
                                alive=self.gateway.alive, existing_ok=True)
        return w
