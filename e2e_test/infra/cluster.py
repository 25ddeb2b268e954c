"""Cluster: one context manager that owns a topology's whole life.

    with Cluster(model="SmolLM2-135M-Instruct", engine="vllm", topology="1p1d") as c:
        c.chat("Say hi")
        gsm8k.run(c.gateway_url, c.model_name, n=32)

Construction validates everything (registry, topology x engine, weights, devices) and raises a
one-line ConfigError before any process starts. `start()` launches every worker at once, waits
for each one's health AND liveness (a worker that exits fails the topology at once, naming role,
argv, exit code, error line and log tail), then starts the gateway and probes it with a real
completion. `stop()` stops everything in parallel and verifies teardown.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from . import gateway as gw
from . import metrics, ports, teardown
from .engines import EngineOptions, Ports, WorkerCommand
from .errors import ConfigError, StartupError
from .model_specs import DEFAULT_MODEL, ModelSpec, get_spec
from .models import weights_path
from .plan import Plan, PlanEntry, make_plan, nvml_inventory, resolve_devices
from .process import ManagedProcess, StopReport, classify_log
from .topology import Topology, parse

POLL_S = 0.25
PORT_RETRIES = 2
_ids = itertools.count(1)


def results_root() -> Path:
    return Path(os.environ.get("E2E_RESULTS_DIR", "results"))


def default_backend() -> str:
    env = os.environ.get("E2E_BACKEND")
    if env:
        if env not in ("cpu", "cuda"):
            raise ConfigError(f"E2E_BACKEND={env!r}: expected cpu or cuda")
        return env
    return "cuda" if nvml_inventory() else "cpu"


def _builder(engine: str, topology: Topology):
    if topology.kind == "afd":
        from .engines import afd
        return afd
    if engine == "vllm":
        from .engines import vllm
        return vllm
    if engine == "tokenspeed":
        from .engines import tokenspeed
        return tokenspeed
    raise ConfigError(f"no command builder for engine {engine!r}")


def _grpc_serving(port: int, service: str = "") -> bool:
    """The standard gRPC health check (grpc.health.v1) answers SERVING."""
    if ports.is_free(port):
        return False
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:      # no grpc client here: an open port is the best we can tell
        return True
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


@dataclass
class Worker:
    entry: PlanEntry
    ports: Ports
    command: WorkerCommand
    process: ManagedProcess | None = None
    ready_s: float | None = None
    restarts: int = 0

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def url(self) -> str:
        scheme = "grpc" if self.command.protocol == "grpc" else "http"
        return f"{scheme}://127.0.0.1:{self.ports.api}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    def metrics(self, timeout: float = 5.0) -> dict:
        prom_dir = self.command.metadata.get("prometheus_multiproc_dir")
        if prom_dir:       # TokenSpeed: no /metrics endpoint, multiprocess files instead
            return metrics.read_multiproc_dir(prom_dir)
        return metrics.scrape(f"{self.http_url}/metrics", timeout=timeout)


@dataclass
class Timing:
    workers: dict[str, float] = field(default_factory=dict)   # name -> seconds to ready
    topology_ready_s: float | None = None                     # first start -> last worker ready
    gateway_ready_s: float | None = None
    total_ready_s: float | None = None
    teardown_s: float | None = None

    def slowest_worker_s(self) -> float | None:
        return max(self.workers.values()) if self.workers else None


class Cluster:
    live: "set[Cluster]" = set()
    _live_lock = threading.Lock()

    def __init__(self, model: str = DEFAULT_MODEL, engine: str = "vllm",
                 topology: str | Topology = "1", backend: str | None = None,
                 devices: str | None = None, options: EngineOptions | None = None,
                 admission: gw.Admission | None = None, policy: str = "round_robin",
                 startup_timeout: float | None = None, results_dir: Path | str | None = None,
                 name: str | None = None, gateway_args: tuple[str, ...] = ()):
        self.spec: ModelSpec = get_spec(model)
        self.engine = engine
        self.topology = parse(topology)
        self.topology.check_engine(engine)
        self.spec.require(engine, self.topology.kind)
        self.backend = backend or default_backend()
        base = options or EngineOptions()
        self.options = replace(base, backend=self.backend)
        self.model_path = weights_path(self.spec)
        if self.backend == "cuda":
            devs = resolve_devices(self.topology, devices)
            self.plan: Plan = make_plan(self.topology, self.spec, "cuda", devices=devs)
        else:
            cores = None
            if devices:
                from .plan import parse_device_list
                cores = parse_device_list(devices, "--devices")
            self.plan = make_plan(self.topology, self.spec, "cpu", cores=cores)
        if self.topology.kind == "afd" and self.plan.packed:
            raise ConfigError(f"topology {self.topology.name!r}: AFD attention and FFN need "
                              f"separate devices; {len(self.plan.devices)} device(s) are too few")
        self.builder = _builder(engine, self.topology)
        # Engines that size their memory from what is free at start (TokenSpeed) say how
        # workers sharing a GPU must start: {name: (stage, memory utilization)}.
        schedule = getattr(self.builder, "packed_schedule", None)
        self._packed_starts = (schedule(self.plan.entries)
                               if schedule and self.backend == "cuda" else {})
        if self.topology.kind == "afd" and not self.topology.native_baseline:
            # The FFN binds the connector port and the next num_ffn_ranks ports; attention
            # connects to the same base port.
            ffn = self.topology.group("ffn")
            self.options = replace(self.options, afd_port=ports.allocate_block(
                ffn.dp * ffn.tp * self.spec.tp + 1))
        self.admission = admission
        self.policy = policy
        self.gateway_args = tuple(gateway_args)
        self.startup_timeout = startup_timeout or self.spec.startup_timeout_s
        self.name = name or f"{self.engine}-{self.topology.name}-{os.getpid()}-{next(_ids)}"
        self.dir = Path(results_dir) if results_dir else results_root() / "clusters" / self.name
        if not self.options.state_dir:
            self.options = replace(self.options, state_dir=str(self.dir.resolve() / "state"))
        self.workers: list[Worker] = [self._make_worker(e) for e in self.plan.entries]
        self.gateway_port, self.prometheus_port = ports.allocate(2)
        self.gateway: ManagedProcess | None = None
        self.timing = Timing()
        self.teardown_report: teardown.TeardownReport | None = None
        self.stop_reports: list[StopReport] = []
        self._shm_before: set[str] = set()
        self._gpu_baseline: dict[int, float] = {}
        self._stopped = False
        self._client: httpx.Client | None = None

    # -- construction helpers -----------------------------------------------------------------
    def _make_worker(self, entry: PlanEntry) -> Worker:
        names = self.builder.aux_ports(self.topology, entry, self.options)
        preset = {"afd": self.options.afd_port} if self.options.afd_port else {}
        fresh = [n for n in names if n not in preset]
        allocated = ports.allocate(1 + len(fresh))
        aux = {**dict(zip(fresh, allocated[1:])), **{n: preset[n] for n in names if n in preset}}
        p = Ports(api=allocated[0], aux=aux)
        opts = self.options
        if entry.name in self._packed_starts:
            stage, util = self._packed_starts[entry.name]
            opts = replace(opts, start_stage=stage, gpu_memory_utilization=util)
        if opts.kv_connector == "example" and not opts.kv_shared_path:
            opts = replace(opts, kv_shared_path=str(self.dir.resolve() / "kv-store"))
        cmd = self.builder.build(self.spec, self.topology, entry, p, str(self.model_path), opts)
        if self.topology.kind == "afd" and entry.role == "ffn":
            from .proof import afd_ffn_step_env, ffn_step_trace_enabled
            if ffn_step_trace_enabled():   # the plugin's per-step FFN signal (proof.py)
                trace_dir = self.dir.resolve() / "afd-ffn-steps" / entry.name
                cmd = replace(cmd, env={**cmd.env, **afd_ffn_step_env(trace_dir)})
        return Worker(entry, p, cmd)

    @property
    def allocated_ports(self) -> set[int]:
        out = {self.gateway_port, self.prometheus_port}
        for w in self.workers:
            out.add(w.ports.api)
            out.update(w.ports.aux.values())
            out.update(w.command.metadata.get("afd_ports", ()))
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
                         "log": str(w.process.log_path) if w.process else None}
                        for w in self.workers],
            "gateway": {"url": self.gateway_url, "metrics": self.gateway_metrics_url,
                        "argv": self.gateway.argv if self.gateway else None},
            "timing": vars(self.timing),
            "teardown": self.teardown_report.to_dict() if self.teardown_report else None,
        }

    # -- life ---------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.stop(verify_strict=False)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop(verify_strict=None if exc[0] is None else False)

    def start(self) -> "Cluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "plan.txt").write_text(self.plan.describe() + "\n")
        with Cluster._live_lock:
            Cluster.live.add(self)
        self._shm_before = teardown.shm_snapshot()
        if self.backend == "cuda":
            self._gpu_baseline = teardown.gpu_memory_mib(self.plan.devices)
        t0 = time.monotonic()
        self._start_workers(t0)
        self.timing.topology_ready_s = round(time.monotonic() - t0, 2)
        self._start_gateway()
        self.timing.total_ready_s = round(time.monotonic() - t0, 2)
        (self.dir / "cluster.json").write_text(json.dumps(self.describe(), indent=2, default=str))
        return self

    def _launch(self, w: Worker) -> None:
        log = self.dir / "logs" / f"{w.name}{'.' + str(w.restarts) if w.restarts else ''}.log"
        prom_dir = w.command.metadata.get("prometheus_multiproc_dir")
        if prom_dir:       # must exist, and start empty (a restart starts its counters anew)
            shutil.rmtree(prom_dir, ignore_errors=True)
            Path(prom_dir).mkdir(parents=True)
        w.process = ManagedProcess(w.name, w.command.argv, w.command.env, log,
                                   unset_env=w.command.metadata.get("unset_env", ()),
                                   cpu_affinity=w.entry.cores).start()

    def _start_workers(self, t0: float) -> None:
        stages = sorted({w.command.metadata.get("start_stage", 0) for w in self.workers})
        deadline = t0 + self.startup_timeout
        with httpx.Client(timeout=2.0) as client:
            for stage in stages:
                group = [w for w in self.workers
                         if w.command.metadata.get("start_stage", 0) == stage]
                for w in group:        # all at once: Popen returns immediately
                    self._launch(w)
                self._wait_ready(group, client, t0, deadline)

    def _probe(self, w: Worker, client: httpx.Client) -> bool:
        if w.command.health_path is None:     # no API of its own (AFD FFN): alive is ready
            port = w.command.metadata.get("ready_port")
            return port is None or not ports.is_free(port)
        if w.command.protocol == "grpc":
            return _grpc_serving(w.ports.api, w.command.metadata.get("grpc_health_service", ""))
        try:
            return client.get(f"{w.http_url}{w.command.health_path}").status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_ready(self, group: list[Worker], client: httpx.Client, t0: float,
                    deadline: float) -> None:
        pending = list(group)
        while pending:
            for w in list(pending):
                if not w.process.alive():
                    self._handle_early_exit(w)
                    continue
                if self._probe(w, client):
                    w.ready_s = round(time.monotonic() - w.process.started_at, 2)
                    self.timing.workers[w.name] = w.ready_s
                    pending.remove(w)
                else:
                    w.process.remember_descendants()
            self._check_others_alive(group)
            if pending and time.monotonic() > deadline:
                names = ", ".join(w.name for w in pending)
                tails = "\n".join(f"--- {w.name} ({w.process.log_path}):\n"
                                  f"{w.process.log_tail(15)}" for w in pending)
                raise StartupError(f"topology {self.topology.name}: {names} not ready within "
                                   f"{self.startup_timeout:.0f} s", tails)
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
        gws = tuple(gw.GatewayWorker(url=w.url, worker_type=w.command.worker_type,
                                     bootstrap_port=w.command.bootstrap_port,
                                     kv_connector=w.command.kv_connector,
                                     runtime_type=self.engine)
                    for w in self.workers if w.command.worker_type != "none")
        cfg = gw.GatewayConfig(kind=self.topology.kind, workers=gws, port=self.gateway_port,
                               prometheus_port=self.prometheus_port, policy=self.policy,
                               dp_aware=self.topology.engine_dp, admission=self.admission,
                               extra_args=self.gateway_args,
                               model_path=str(self.model_path))
        self.gateway = ManagedProcess("gateway", gw.build_argv(cfg), {},
                                      self.dir / "logs" / "gateway.log").start()
        deadline = t0 + 120
        with httpx.Client(timeout=30.0) as client:
            while True:
                if not self.gateway.alive():
                    head, _, details = self.gateway.failure_summary().partition("\n")
                    raise StartupError(head, details)
                try:
                    if client.get(f"{self.gateway_url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise StartupError("gateway /health not answering within 120 s",
                                       self.gateway.log_tail(20))
                time.sleep(POLL_S)
            dynamic = [g for g in gws if g.register_dynamically]
            if dynamic:
                gw.register_workers(self.gateway_url, dynamic, timeout=120,
                                    alive=self.gateway.alive)
            last = ""
            while time.monotonic() < deadline:
                self._check_others_alive([])
                ok, last = gw.probe_ready(self.gateway_url, self.model_name, client)
                if ok:
                    self.timing.gateway_ready_s = round(time.monotonic() - t0, 2)
                    return
                time.sleep(POLL_S * 2)
        raise StartupError(f"gateway not ready within 120 s: {last}", self.gateway.log_tail(20))

    def stop(self, verify_strict: bool | None = None) -> teardown.TeardownReport:
        if self._stopped:
            return self.teardown_report
        self._stopped = True
        t0 = time.monotonic()
        if self._client:
            self._client.close()
        procs = [w.process for w in self.workers if w.process]
        if self.gateway:
            procs.insert(0, self.gateway)
        with ThreadPoolExecutor(max_workers=max(1, len(procs))) as ex:
            self.stop_reports = list(ex.map(lambda p: p.stop(grace=15.0), procs))
        rep = teardown.TeardownReport()
        rep.escalated = [r.name for r in self.stop_reports if r.escalated]
        rep.survivors = [s for r in self.stop_reports for s in r.survivors]
        rep.busy_ports = teardown.listening_ports(self.allocated_ports)
        if self._gpu_baseline:
            rep.gpu_checked = True
            rep.gpu_leaks = teardown.wait_gpu_baseline(self._gpu_baseline)
        rep.shm_removed, rep.shm_left = teardown.clean_shm(self._shm_before)
        rep.seconds = round(time.monotonic() - t0, 2)
        self.timing.teardown_s = rep.seconds
        self.teardown_report = rep
        with Cluster._live_lock:
            Cluster.live.discard(self)
        try:
            if self.dir.exists():
                (self.dir / "cluster.json").write_text(
                    json.dumps(self.describe(), indent=2, default=str))
        except OSError:
            pass
        teardown.enforce(rep, f"{self.topology.name} ({self.name})", strict=verify_strict)
        return rep

    def kill_now(self) -> None:
        """Second Ctrl-C: SIGKILL every process tree at once, no grace."""
        for p in [self.gateway] + [w.process for w in self.workers]:
            if p:
                p.remember_descendants()
                p.signal_tree(signal.SIGKILL)

    # -- clients ------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.gateway_url, timeout=120.0)
        return self._client

    def chat(self, content: str, max_tokens: int = 32, **kw) -> dict:
        r = self.client.post("/v1/chat/completions", json={
            "model": self.model_name, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **kw})
        r.raise_for_status()
        return r.json()

    def dead_processes(self) -> str | None:
        """One line naming every worker (or the gateway) that exited, with its exit code."""
        dead = []
        for name, p in [("gateway", self.gateway)] + [(w.name, w.process) for w in self.workers]:
            if p is not None and p.proc is not None and not p.alive():
                code = p.exit_code
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                dead.append(f"{name} (pid {p.pid}) died: {how}")
        if not dead:
            return None
        return f"topology {self.topology.name} ({self.engine}): " + "; ".join(dead)

    def watchdog(self, what: str, window_s: float | None = None):
        """A load.Watchdog that fails on a dead worker within a second and on a stall after
        the window (E2E_WATCHDOG_S, default 60 s), attaching queues and stack dumps."""
        from .diagnostics import diagnose_stall
        from .load import Watchdog
        window = window_s if window_s is not None else float(
            os.environ.get("E2E_WATCHDOG_S", "60"))
        return Watchdog(window_s=window, what=f"{what} on {self.topology.name}",
                        diagnose=lambda: diagnose_stall(self), check=self.dead_processes,
                        engine_progress=self.engine_work)

    def engine_work(self) -> float | None:
        """Prompt + generated tokens all workers have processed (vLLM counters); None when
        no worker answered. A worker that does not answer contributes nothing."""
        total, answered = 0.0, False
        for w in self.workers:
            try:
                s = w.metrics(timeout=2.0)
            except Exception:
                continue
            answered = True
            total += metrics.total(s, "vllm:prompt_tokens_total")
            total += metrics.total(s, "vllm:generation_tokens_total")
            # TokenSpeed counts tokens per request at its end; per scheduler step, only this.
            total += metrics.total(s, "tokenspeed:iteration_tokens_total_sum")
        return total if answered else None

    def gateway_metrics(self) -> dict:
        return metrics.scrape(self.gateway_metrics_url)

    # -- serving faults -----------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None, **kw):
        """Every role back to no running / waiting requests and ~0 KV-cache usage (and no
        request in flight at the gateway); IdleError naming the role and the numbers."""
        from . import idle
        return idle.wait_idle(self, idle.DEFAULT_TIMEOUT_S if timeout is None else timeout, **kw)

    def worker(self, name: str) -> Worker:
        for w in self.workers:
            if w.name == name:
                return w
        raise ConfigError(f"topology {self.topology.name}: no worker {name!r} "
                          f"(workers: {', '.join(w.name for w in self.workers)})")

    def restart(self, name: str, timeout: float | None = None) -> Worker:
        """Stop worker `name` (dead or alive), start it again with the same command and ports,
        wait for it, and register it with smg again where the mode registers dynamically."""
        w = self.worker(name)
        if w.process is not None:
            rep = w.process.stop(grace=5.0)
            if rep.survivors:
                raise StartupError(f"restart {name}: the old process tree did not stop",
                                   "\n".join(rep.survivors))
        t0 = time.monotonic()
        w.restarts += 1
        self._launch(w)
        with httpx.Client(timeout=2.0) as client:
            self._wait_ready([w], client, t0, t0 + (timeout or self.startup_timeout))
        if w.command.kv_connector is not None and self.gateway is not None:
            gw.register_workers(self.gateway_url, [gw.GatewayWorker(
                url=w.url, worker_type=w.command.worker_type,
                bootstrap_port=w.command.bootstrap_port, kv_connector=w.command.kv_connector,
                runtime_type=self.engine)], timeout=120, alive=self.gateway.alive,
                existing_ok=True)
        return w
