"""The smg gateway: a pure argv builder plus worker registration (its readiness check is
readiness.ModelServed).

Regular/DP: `--worker-urls` (GatewayConfig.dynamic says why gRPC workers stay there too).
PD: `--pd-disaggregation`; vLLM+NIXL workers are registered through `POST /workers` with their
`kv_connector` (with static --prefill/--decode smg runs in passthrough and the decode worker
silently recomputes the prompt). EPD: `--epd-disaggregation` with gRPC TokenSpeed workers. AFD:
the attention endpoint is the only worker. `pinned`: a gateway in front of one worker alone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import httpx

from ..engines import DEFAULT_ENGINE
from ..errors import ConfigError, StartupError

# smg's per-worker count of requests it has in flight to workers (its Prometheus endpoint);
# idle verification wants it back at 0 after traffic.
ACTIVE_REQUESTS = "smg_worker_requests_active"
# Between two reads of smg's worker list while workers register (a boot waits on it).
REGISTER_POLL_S = 0.1


@dataclass(frozen=True)
class Admission:
    """smg admission control: excess requests get 429 admission_queue_full or
    503 admission_queue_timeout with retry-after."""
    max_concurrent_requests: int
    queue_size: int = 0
    queue_timeout_secs: float = 5.0

    def __post_init__(self):
        # smg parses --queue-timeout-secs as an integer: 0.5 would kill it at startup.
        if self.queue_timeout_secs != int(self.queue_timeout_secs):
            raise ConfigError(f"admission queue_timeout_secs={self.queue_timeout_secs}: smg "
                              "takes a whole number of seconds")

    def args(self) -> list[str]:
        return ["--max-concurrent-requests", str(self.max_concurrent_requests),
                "--queue-size", str(self.queue_size),
                "--queue-timeout-secs", str(int(self.queue_timeout_secs))]


@dataclass(frozen=True)
class GatewayWorker:
    url: str                        # http://127.0.0.1:P or grpc://127.0.0.1:P
    worker_type: str = "regular"    # regular | prefill | decode | encode
    bootstrap_port: int | None = None
    kv_connector: str | None = None
    # smg's runtime_type: the caller passes the engine's (Engine.gateway_runtime); one that
    # names none gets the default engine's, which is smg's own default too.
    runtime_type: str = DEFAULT_ENGINE

    @property
    def register_dynamically(self) -> bool:
        """Through POST /workers, not the command line: a kv_connector worker (GatewayConfig.
        dynamic, which lists them, says why a regular gateway's gRPC workers are not)."""
        return self.kv_connector is not None

    def registration(self) -> dict:
        body = {"url": self.url, "worker_type": self.worker_type,
                "runtime_type": self.runtime_type}
        if self.kv_connector:
            body["kv_connector"] = self.kv_connector
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        return body


@dataclass(frozen=True)
class GatewayConfig:
    kind: str                       # regular | dp | pd | epd | afd
    workers: tuple[GatewayWorker, ...]
    port: int
    prometheus_port: int
    policy: str = "round_robin"
    dp_aware: bool = False
    admission: Admission | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    # smg tokenizes for gRPC workers itself: it needs the model folder (tokenizer, chat
    # template). HTTP workers (vLLM) tokenize on their own; then it stays None.
    model_path: str | None = None
    # smg's --shutdown-grace-period-secs (its default 180). On SIGTERM smg first keeps its
    # listener open for a load balancer to notice it is draining, for min(5, grace / 2) s
    # (smg 1.13: `settle_secs` in its log; its Python launcher does not expose the 5), then
    # waits up to the grace for in-flight requests. No load balancer watches a test gateway,
    # and a stop the harness asked for has nothing in flight worth 180 s, so 1: the settle
    # becomes 0 and a clean stop takes what it needs (it took 5.0 s, every teardown).
    shutdown_grace_secs: int = 1

    def dynamic(self) -> list[GatewayWorker]:
        """The workers registered through POST /workers (those with a kv_connector: vLLM
        NIXL); the rest go on the command line.

        A regular gateway's gRPC workers stay on --worker-urls, though smg 1.13 probes such a
        worker twice for its runtime before its connection probe (classify_worker_type, then
        detect_backend: a gRPC health check per runtime it knows, workflow/steps classify.rs,
        local/detect_backend.rs) and a TokenSpeed servicer answers each after at least 0.5 s
        (servicer.py HealthCheck sleeps 0.5 s before it looks): the TokenSpeed `1` gateways of
        the H200 lanes spend about 1.5 s in those steps (about 500 ms each in their logs).
        Registered through POST /workers with runtime_type "tokenspeed" instead, smg lists the
        worker healthy and ready under its model and answers every chat completion 404
        model_not_found ("No worker available for model"): started with no
        worker on its command line, a regular smg builds its HTTP router ("Created single
        router with ID: http-regular"; the router's connection mode comes from the startup
        URLs, routers/gateway.rs from_config), which never routes to a gRPC worker. smg's
        --backend names the startup workers' runtime only over ZMQ (main.rs
        startup_worker_runtime_type)."""
        return [w for w in self.workers if w.register_dynamically]


def pinned(cfg: GatewayConfig, url: str) -> GatewayConfig:
    """`cfg`'s gateway in front of its worker at `url` alone: every request it routes reaches
    that worker, over the worker's own protocol (http or grpc, from the URL). The worker is a
    regular one there (a disaggregated leg too: no bootstrap port, no kv_connector, so it
    serves a plain request itself); the rest (policy, dp_aware, model path, extra args,
    admission, ports) is `cfg`'s.

    A second gateway rather than a per-request target on `cfg`'s: smg's only one,
    X-SMG-Target-Worker, is read by the consistent_hashing policy alone and names an index
    into the workers available at that moment (policies/consistent_hashing.rs,
    routers/http/router.rs select_worker_for_model), so a worker that drops out shifts the
    indices and a pinned request reaches another worker, answered as if nothing happened."""
    mine = [w for w in cfg.workers if w.url == url]
    if not mine:
        raise ConfigError(f"no worker {url} behind this gateway (workers: "
                          f"{', '.join(w.url for w in cfg.workers) or 'none'})")
    return replace(cfg, kind="regular",
                   workers=(GatewayWorker(url, runtime_type=mine[0].runtime_type),))


def build_argv(cfg: GatewayConfig) -> list[str]:
    argv = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(cfg.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(cfg.prometheus_port),
            "--log-level", "info", "--shutdown-grace-period-secs", str(cfg.shutdown_grace_secs)]
    if cfg.model_path and any(w.url.startswith("grpc://") for w in cfg.workers):
        argv += ["--model-path", cfg.model_path]
    dynamic = cfg.dynamic()
    static = [w for w in cfg.workers if w not in dynamic]
    if cfg.kind in ("pd", "epd"):
        argv.append("--pd-disaggregation" if cfg.kind == "pd" else "--epd-disaggregation")
        for w in static:
            if w.worker_type == "decode":
                argv += ["--decode", w.url]
            else:
                flag = "--prefill" if w.worker_type == "prefill" else "--encode"
                argv += [flag, w.url] + ([str(w.bootstrap_port)] if w.bootstrap_port else [])
        argv += ["--prefill-policy", cfg.policy, "--decode-policy", cfg.policy]
    else:
        if static:
            argv += ["--worker-urls", *[w.url for w in static]]
        argv += ["--policy", cfg.policy]
    if cfg.dp_aware:
        argv.append("--dp-aware")
    if cfg.admission:
        argv += cfg.admission.args()
    argv += list(cfg.extra_args)
    return argv


def register_workers(base_url: str, workers: list[GatewayWorker], timeout: float,
                     alive=lambda: True, existing_ok: bool = False) -> None:
    """POST each dynamic worker, then wait until smg reports all of them healthy.
    `existing_ok`: a worker smg still lists (a restarted one on its old URL) is fine."""
    with httpx.Client(timeout=10) as c:
        for w in workers:
            r = c.post(f"{base_url}/workers", json=w.registration())
            if existing_ok and r.status_code >= 300 and "already exists" in r.text:
                continue
            if r.status_code >= 300:
                raise StartupError(f"gateway refused worker {w.url}: HTTP {r.status_code} "
                                   f"{r.text[:200]}")
        wanted = {w.url for w in workers}
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not alive():
                raise StartupError("gateway exited while registering workers")
            try:
                listed = c.get(f"{base_url}/workers").json().get("workers", [])
                ok = {w["url"] for w in listed if w.get("is_healthy")
                      and w.get("status", "ready") == "ready"}
                if wanted <= ok:
                    return
                last = str([(w["url"], w.get("status")) for w in listed])
            except (httpx.HTTPError, ValueError) as e:
                last = repr(e)
            time.sleep(REGISTER_POLL_S)
    raise StartupError(f"gateway did not report workers {sorted(wanted)} healthy within "
                       f"{timeout:.0f} s (last: {last[:300]})")
