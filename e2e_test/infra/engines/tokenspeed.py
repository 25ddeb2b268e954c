"""TokenSpeed worker commands: regular, DP (engine-internal), PD and EPD, served over gRPC.

smg drives TokenSpeed through its gRPC servicer (`python -m smg_grpc_servicer.tokenspeed`), which
parses TokenSpeed's own ServerArgs; the gateway reaches it at grpc://127.0.0.1:PORT. Where each
flag's contract comes from:

- Launch command, `--host/--port/--tensor-parallel-size/--log-level warning`,
  `--enable-output-logprobs`, and per disaggregation role
  `--disaggregation-mode {encode,prefill,decode}`, `--disaggregation-bootstrap-port` (prefill and
  encode only), `--disaggregation-transfer-backend mooncake`, `--dist-init-addr HOST:PORT`,
  `--enable-prefix-caching` (prefill, decode), `--enforce-eager` (prefill), `--skip-server-warmup`:
  smg-project/smg e2e_test/infra/worker.py (Worker._build_tokenspeed_grpc_cmd), pinned by
  smg-project/smg e2e_test/infra/test_epd_cmd_builders.py.
- smg's harness also passes `--grammar-backend xgrammar` (its structured-output tests). This
  harness has none, and TokenSpeed's default grammar backend is none, so the flag is left out:
  a runner without xgrammar (0.2.2, 45 MB) still serves. Add it through the model's
  args (`args: {tokenspeed: [...]}`) or E2E_ENGINE_ARGS where structured output is tested.
- Worker env for disaggregation roles (MC_INTRANODE_NVLINK=1, TOKENSPEED_SKIP_GRPC_WARMUP=1,
  NO_PROXY/no_proxy=*) and CUDA_VISIBLE_DEVICES: smg-project/smg e2e_test/infra/worker.py
  (Worker._build_env; smg uses setdefault, this builder returns plain overrides). Which ports a
  worker gets (bootstrap for prefill/encode, a dist-init port for every disaggregation role):
  same file, start_workers().
- Gateway registration (`--prefill URL BOOTSTRAP`, `--encode URL BOOTSTRAP`, `--decode URL`):
  smg-project/smg e2e_test/infra/gateway.py (build_epd_mode_args).
- Flag names and semantics (`--gpu-memory-utilization`, `--max-num-seqs`, `--max-model-len`,
  `--served-model-name`, `--data-parallel-size`, `--dist-init-addr`, device "cuda" only):
  lightseekorg/tokenspeed python/tokenspeed/runtime/utils/server_args.py. Its PortArgs.init_new
  requires `--dist-init-addr` when attention DP > 1, hence the dist_init port for dp > 1 here.
- The servicer parses all ServerArgs flags and reports `--served-model-name` in GetModelInfo:
  smg-project/smg grpc_servicer/smg_grpc_servicer/tokenspeed/__main__.py, .../servicer.py.
- Health: grpc.health.v1 (service "" turns SERVING after a 1-token warmup, or at once with
  TOKENSPEED_SKIP_GRPC_WARMUP=1 / on encode workers); the port binds before that:
  smg-project/smg grpc_servicer/smg_grpc_servicer/tokenspeed/server.py.
"""

from __future__ import annotations

import sys

from ..errors import ConfigError
from ..model_specs import ModelSpec
from ..plan import PlanEntry
from ..readiness import GrpcHealth
from ..topology import Topology
from . import Engine, EngineOptions, KnownCrash, Ports, WorkerCommand

SERVICER_MODULE = "smg_grpc_servicer.tokenspeed"
DISAGG_ROLES = ("encode", "prefill", "decode")
KINDS = ("regular", "dp", "pd", "epd")     # smg's EPD mode speaks gRPC to TokenSpeed only
HOST = "127.0.0.1"
# Idle verification (infra/idle.py): the scheduler snapshot gauges its engine writes to the
# Prometheus multiprocess folder (tokenspeed runtime/metrics/collector.py EngineMetrics:
# tokenspeed:num_requests_running / _waiting / kv_cache_usage_perc, a 0-1 ratio, livemax). An
# encode worker exports no metric of its own, so it is not checked.
IDLE_GAUGES = {"running": "tokenspeed:num_requests_running",
               "waiting": "tokenspeed:num_requests_waiting",
               "kv_cache_usage": "tokenspeed:kv_cache_usage_perc"}
IDLE_SKIP_ROLES = ("encode",)
TRANSPORTS = {"nvlink": {"MC_INTRANODE_NVLINK": "1"}, "tcp": {"MC_FORCE_TCP": "1"}}
# SIGTERM -> SIGKILL after this many seconds. The servicer cannot stop cleanly sooner: its
# SIGTERM path polls for in-flight requests every 0.5 s, SIGKILLs the scheduler children, then
# gives gRPC a fixed 5 s stop grace (smg_grpc_servicer/tokenspeed/server.py:193-208,
# servicer.py:865-910), while AsyncLLM's sigterm_watchdog wakes every 5 s and ends it with a
# SIGKILL of itself (tokenspeed runtime/engine/async_llm.py:779-794): 13-15 s per topology on
# the H200 (2026-12-01), once not at all. Upstream's own path ends in SIGKILL; the harness
# sends it after 1.5 s (vLLM's clean stop takes 0.7 s) and verifies the teardown as always:
# no process, port, GPU memory or /dev/shm segment left.
STOP_GRACE_S = 1.5
# smg's load monitor polls every worker group's GetLoads, the encode group's included, unless
# no load-aware policy, overload protection or engine metrics need it (smg 1.13
# worker/monitor.rs:1421-1428; the default --policy cache_aware is load-aware). TokenSpeed
# 0.1.0's encode loop takes that query for a request and dies (runtime/epd/encode_loop.py
# :300-301 -> encode_worker.py:97 `request.request_id`). Fixed upstream by smg PR #2249
# (encode GetLoads answers empty; servicer newer than the 0.7.0.post20260720 TokenSpeed 0.1.0
# pins); TokenSpeed PR #1205 passes --disable-load-monitoring. So EPD gateways run without it.
EPD_GATEWAY_ARGS = ("--policy", "round_robin", "--disable-load-monitoring",
                    "--disable-worker-overload-protection")
ENCODE_GETLOAD_CRASH = KnownCrash(
    pattern=r"'GetLoadReqInput' object has no attribute 'request_id'",
    summary=("TokenSpeed 0.1.0's encode worker takes smg's GetLoads query for a request and "
             "dies"),
    refs=("tokenspeed runtime/epd/encode_worker.py:97", "smg worker/monitor.rs load monitor",
          "fixed by smg PR #2249"),
    role="encode")


def _disagg(topology: Topology, entry: PlanEntry) -> bool:
    return topology.kind in ("pd", "epd") and entry.role in DISAGG_ROLES


def aux_ports(topology: Topology, entry: PlanEntry, options: EngineOptions) -> list[str]:
    """Names of the extra ports a worker needs, allocated by the cluster.

    "bootstrap": the Mooncake bootstrap server of a prefill/encode worker (the gateway is told it).
    "dist_init": the base of TokenSpeed's control-plane port cluster (it also binds a few ports
    right above it); needed by every disaggregation role and by dp > 1.
    """
    names = []
    disagg = _disagg(topology, entry)
    if disagg and entry.role in ("prefill", "encode"):
        names.append("bootstrap")
    if disagg or entry.dp > 1:
        names.append("dist_init")
    return names


def build(spec: ModelSpec, topology: Topology, entry: PlanEntry, ports: Ports,
          model_path: str, options: EngineOptions) -> WorkerCommand:
    if topology.kind not in KINDS:
        raise ConfigError(f"engines/tokenspeed builds {', '.join(KINDS)} workers, "
                          f"not {topology.kind!r}")
    if options.backend != "cuda":
        raise ConfigError("TokenSpeed runs on CUDA only (its --device accepts only 'cuda'); "
                          f"backend is {options.backend!r}")
    disagg = _disagg(topology, entry)
    if topology.kind in ("pd", "epd") and not disagg:
        raise ConfigError(f"{topology.kind} topology has no role {entry.role!r} for TokenSpeed")
    if options.mooncake_transport not in TRANSPORTS:
        raise ConfigError(f"mooncake transport {options.mooncake_transport!r}: use one of "
                          f"{', '.join(TRANSPORTS)}")
    # Packed on one GPU, the plan entry carries the cumulative share (packed_schedule).
    util = entry.mem_fraction
    argv = [sys.executable, "-m", SERVICER_MODULE,
            "--model", str(model_path), "--served-model-name", spec.id,
            "--host", HOST, "--port", str(ports.api),
            "--tensor-parallel-size", str(entry.tp),
            "--log-level", "warning",
            "--enable-output-logprobs",
            "--gpu-memory-utilization", f"{util:g}",
            # No host KV store: on by default for prefill and regular workers, it pins
            # kvstore_ratio (2.0) x the device pool in host memory (server_args.py:182-184,
            # 663-671; flat_memory_executor.py:79-82). A 0.30 pool of an H200 asked for more
            # pinned memory than the runner had (FlatHostMirror, CUDA OOM, 2026-12-01). The
            # suites test no host-tier cache; prefix caching on the device stays on.
            "--disable-kvstore"]
    if spec.kv_budget_tokens:
        # The pool from the model's KV budget, not from the memory fraction (a cap:
        # min(profiled, requested); TokenSpeed registry.py:76-90).
        argv += ["--max-total-tokens", str(spec.kv_budget_tokens)]
    # The servicer's 1-token gRPC warmup before SERVING (server.py:220): the gateway's ready
    # probe sends a real request anyway.
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, entry.gpus)),
           "TOKENSPEED_SKIP_GRPC_WARMUP": "1"}
    metrics_dir = None
    if options.state_dir:
        # The servicer has no /metrics: with --enable-metrics the engine writes Prometheus
        # multiprocess files here, which the harness reads (Worker.metrics).
        prom = f"{options.state_dir}/prometheus/{entry.name}"
        argv.append("--enable-metrics")
        env["PROMETHEUS_MULTIPROC_DIR"] = prom
        metrics_dir = prom
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if options.max_num_seqs:
        argv += ["--max-num-seqs", str(options.max_num_seqs)]
    if entry.dp > 1:
        argv += ["--data-parallel-size", str(entry.dp)]
    eager = False
    bootstrap = None
    if disagg:
        argv += ["--disaggregation-mode", entry.role]
        if entry.role in ("prefill", "encode"):
            bootstrap = ports.aux["bootstrap"]
            argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
        argv += ["--disaggregation-transfer-backend", "mooncake",
                 "--dist-init-addr", f"{HOST}:{ports.aux['dist_init']}"]
        if entry.role in ("prefill", "decode"):
            argv.append("--enable-prefix-caching")
        if entry.role == "prefill":
            argv.append("--enforce-eager")
            eager = True
        argv.append("--skip-server-warmup")
        env.update({**TRANSPORTS[options.mooncake_transport],
                    "NO_PROXY": "*", "no_proxy": "*"})
        if entry.role == "encode":
            # No embedding cache: every image runs the vision tower (the EPD proof).
            env["TOKENSPEED_EPD_ENCODE_EMBED_CACHE_MB"] = "0"
    elif entry.dp > 1:
        argv += ["--dist-init-addr", f"{HOST}:{ports.aux['dist_init']}"]
    if options.enforce_eager and not eager:
        argv.append("--enforce-eager")
    argv += list(spec.engine_args("tokenspeed", entry.role)) + list(options.extra_args)
    return WorkerCommand(argv=argv, env=env, protocol="grpc",
                         readiness=GrpcHealth(ports.api, service=""),
                         worker_type=entry.role if disagg else "regular",
                         bootstrap_port=bootstrap, start_stage=entry.start_stage,
                         metrics_dir=metrics_dir, stop_grace_s=STOP_GRACE_S)


def packed_schedule(entries, spec: ModelSpec | None = None) -> dict[str, tuple[int, float]]:
    """Start stage and --gpu-memory-utilization for TokenSpeed workers that share a GPU.

    TokenSpeed sizes its KV pool as free_now - total * (1 - utilization), with free memory
    measured over the whole device (tokenspeed runtime/layers/attention/utils.py), so two
    workers at 0.3 each on one GPU leave the second with a negative budget. Workers sharing a
    GPU therefore get the cumulative utilization of themselves and those before them:
    fractions 0.3, 0.3 -> 0.3, 0.6. Where the pool is bounded by the model's KV budget
    (`kv_budget_tokens` -> --max-total-tokens) a worker holds far less than its fraction, so
    the budget each sees stays positive while the others start: they all start at once (stage
    0). Without that bound they start one after another (stages 0, 1, ...), since each
    worker's pool is whatever the ones before it left. Workers alone on their GPUs are not
    listed.
    """
    capped = bool(spec is not None and spec.kv_budget_tokens)
    by_gpu: dict[tuple, list] = {}
    for e in entries:
        by_gpu.setdefault(tuple(e.gpus), []).append(e)
    out = {}
    for group in by_gpu.values():
        if len(group) < 2:
            continue
        total = 0.0
        for stage, e in enumerate(group):
            total += e.mem_fraction
            if total > 0.95:
                raise ConfigError(f"TokenSpeed workers packed on GPU {','.join(map(str, e.gpus))}"
                                  f" need {total:.2f} of its memory together")
            out[e.name] = (0 if capped else stage, round(total, 4))
    return out


# TokenSpeed counts tokens per request at its end; per scheduler step, only this.
WORK_COUNTERS = ("tokenspeed:iteration_tokens_total_sum",)


class TokenSpeedEngine(Engine):
    idle_gauges = IDLE_GAUGES
    # TokenSpeed 0.1.0 refuses top-k output logprobs on H200 (2026-12-01): "top_logprobs_num
    # > 0 (output top-k logprobs) is not supported yet; use top_logprobs_num=0 (the sampled
    # token's logprob)", a 400 through smg. The oracle then bounds the gap from the sampled
    # token's logprob alone (oracle.compare_item).
    top_logprobs = 0
    # smg 1.13's gRPC router drops logprobs from every completions response
    # (model_gateway/src/routers/grpc/regular/processor.rs:1282 "logprobs: None, // TODO: wire
    # legacy LogProbs from backend token_logprobs"; streaming.rs likewise), while chat converts
    # the servicer's output_logprobs (utils/logprobs.rs convert_proto_to_openai_logprobs): seen
    # on the H200 on 2026-12-01 as completions with text and no logprobs. So the oracle asks
    # TokenSpeed through chat, `logprobs: true, top_logprobs: 0`.
    logprobs_api = "chat"
    idle_skip_roles = IDLE_SKIP_ROLES
    name = "tokenspeed"
    kinds = KINDS
    known_crashes = (ENCODE_GETLOAD_CRASH,)
    backends = ("cuda",)
    work_counters = WORK_COUNTERS

    def aux_ports(self, topology, entry, options):
        return aux_ports(topology, entry, options)

    def build(self, spec, topology, entry, ports, model_path, options):
        return build(spec, topology, entry, ports, model_path, options)

    def packed_schedule(self, entries, spec=None):
        return packed_schedule(entries, spec)

    def gateway_args(self, topology) -> tuple[str, ...]:
        return EPD_GATEWAY_ARGS if topology.kind == "epd" else ()

    def pd_proof(self, cluster):
        from ..proof import pd_transfer_tokenspeed
        return pd_transfer_tokenspeed(cluster)


ENGINE = TokenSpeedEngine()
