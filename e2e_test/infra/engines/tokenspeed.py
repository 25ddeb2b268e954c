"""TokenSpeed worker commands: regular, DP (engine-internal), PD and EPD, served over gRPC.

smg drives TokenSpeed through its gRPC servicer (`python -m smg_grpc_servicer.tokenspeed`), which
parses TokenSpeed's own ServerArgs; the gateway reaches it at grpc://127.0.0.1:PORT. Where each
flag's contract comes from:

- Launch command, `--host/--port/--tensor-parallel-size/--log-level warning`,
  `--enable-output-logprobs`, and per disaggregation role
  `--disaggregation-mode {encode,prefill,decode}`, `--disaggregation-bootstrap-port` (prefill and
  encode only), `--disaggregation-transfer-backend mooncake`, `--dist-init-addr HOST:PORT`,
  `--enable-prefix-caching` (prefill, decode), `--enforce-eager` (prefill):
  smg-project/smg e2e_test/infra/worker.py (Worker._build_tokenspeed_grpc_cmd), pinned by
  smg-project/smg e2e_test/infra/test_epd_cmd_builders.py.
- smg's harness also passes `--grammar-backend xgrammar` (its structured-output tests). This
  harness has none, and TokenSpeed's default grammar backend is none, so the flag is left out:
  a runner without xgrammar (0.2.2, 45 MB) still serves. Add it through the model's
  args (`args: {tokenspeed: [...]}`) or E2E_ENGINE_ARGS where structured output is tested.
- smg's harness passes `--skip-server-warmup` too. Nothing in TokenSpeed 0.1.0 or its servicer
  reads it (the servicer's warmup skip is TOKENSPEED_SKIP_GRPC_WARMUP, below), and 0.1.1's
  ServerArgs refuses it (exit 2 at start), so it is left out.
- Worker env for disaggregation roles only (MC_INTRANODE_NVLINK=1, TOKENSPEED_SKIP_GRPC_WARMUP=1,
  NO_PROXY/no_proxy=*) and CUDA_VISIBLE_DEVICES: smg-project/smg e2e_test/infra/worker.py
  (Worker._build_env; smg uses setdefault, this builder returns plain overrides). Which ports a
  worker gets (bootstrap for prefill/encode, a dist-init port for every disaggregation role):
  same file, start_workers(). This harness gives every worker a dist-init port (aux_ports).
- Gateway registration (`--prefill URL BOOTSTRAP`, `--encode URL BOOTSTRAP`, `--decode URL`):
  smg-project/smg e2e_test/infra/cluster/gateway.py (build_epd_mode_args).
- Flag names and semantics (`--gpu-memory-utilization`, `--max-num-seqs`, `--max-model-len`,
  `--served-model-name`, `--data-parallel-size`, `--dist-init-addr`, device "cuda" only):
  lightseekorg/tokenspeed python/tokenspeed/runtime/utils/server_args.py. Its PortArgs.init_new
  requires `--dist-init-addr` when attention DP > 1, and derives one from `--port` otherwise.
- The servicer parses all ServerArgs flags and reports `--served-model-name` in GetModelInfo:
  smg-project/smg grpc_servicer/smg_grpc_servicer/tokenspeed/__main__.py, .../servicer.py.
- Health: grpc.health.v1 (service "" turns SERVING after a 1-token warmup, or at once with
  TOKENSPEED_SKIP_GRPC_WARMUP=1 / on encode workers); the port binds before that:
  smg-project/smg grpc_servicer/smg_grpc_servicer/tokenspeed/server.py.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace

from packaging.version import InvalidVersion, Version

from ..errors import ConfigError, HarnessError
from ..lifecycle.launcher import WorkerCommand
from ..lifecycle.readiness import GrpcHealth
from ..lifecycle.reaper import extend_pythonpath
from ..specs.model_specs import ModelSpec
from ..specs.plan import PlanEntry
from ..specs.settings import Bool, Choice, Setting
from ..specs.topology import Topology
from ..verdicts.proof import (
    dispatch_problems,
    gateway_dispatch,
    image_chat_body,
    leg,
    legs_traffic,
    long_unique_prompt,
    post_all,
    random_png_data_uri,
    scrape_all,
    sum_delta,
    verdict,
)
from . import (
    LAUNCHERS,
    Engine,
    EngineOptions,
    KnownCrash,
    Ports,
    kv_corrupt,
    kv_corrupt_tokenspeed,
)

SERVICER_MODULE = "smg_grpc_servicer.tokenspeed"
# TokenSpeed's ServerArgs flag that turns its default-on prefix caching off, by release: 0.1.0's
# BooleanOptionalAction gives --no-enable-prefix-caching, 0.1.1 a mutually exclusive
# --disable-prefix-caching and refuses the other (runtime/utils/server_args.py).
NO_PREFIX_CACHE_FLAGS = ("--no-enable-prefix-caching", "--disable-prefix-caching")
# Warm spawn (launchers/e2e_warm_spawn.py): the servicer's process imports TokenSpeed's runtime,
# then starts the scheduler in a spawn child (0.1.0 runtime/entrypoints/engine.py
# _set_envs_and_config: mp.set_start_method("spawn", force=True); _launch_subprocesses:
# mp.Process(target=run_event_loop)), a fresh interpreter that imports it all again, one round after
# the other; the two rounds (boot phases `starting` and `server imported, starting engine`) are
# about two thirds of a boot (docs/gpu.md, table "Engine figures"). The launcher starts the
# scheduler's interpreter first, importing its module during the servicer's own imports; the
# servicer's start of the scheduler then hands it over. Fork would not do: the runtime initialises
# CUDA at import (tokenspeed_kernel platform.py current_platform() at module level). What TokenSpeed
# sets in the servicer's environment before that start (spawn_env) goes to the warm interpreter from
# its start, so that its imports see what a spawned scheduler's would; the rest of the servicer's
# environment at the start is applied before the scheduler runs. Only for a single scheduler (tp 1,
# dp 1: one target process). Env E2E_TOKENSPEED_WARM_SPAWN.
WARM_SPAWN = ("e2e_warm_spawn", "tokenspeed.runtime.engine.event_loop:run_event_loop",
              ("tokenspeed.runtime.engine.event_loop",))
DEFAULT_WARM_SPAWN = True
# What the waiting scheduler interpreter calls after its imports (the launcher's --call): the hashes
# of installed files that each compiler keys its on-disk cache with, computed once per process
# (functools caches) in every worker's first forward (py-spy): triton's `triton_key` (the triton
# torch brings, which TokenSpeed's own kernels such as execution/cache_loc_kernel.py and inductor
# compile with), tokenspeed_triton's (tokenspeed_kernel's kernels), and inductor's `torch_key`. Same
# files, same result, only sooner: after the interpreter's imports, before the servicer's request is
# taken. The eager prefill's first forward, at the first request, is spared them; a compiled worker
# gains little, as the request mostly comes before the calls end (docs/gpu.md, table "Engine
# figures"; against the control without them, docs/lanes.md, "The compilers' cache keys before
# the request"). One that raises is reported in the worker's log and filled in the first forward
# instead.
WARM_CALLS = ("triton.runtime.cache:triton_key", "tokenspeed_triton.runtime.cache:triton_key",
              "torch._inductor.codecache:torch_key")
DISAGG_ROLES = ("encode", "prefill", "decode")
KINDS = ("regular", "dp", "pd", "epd")     # smg's EPD mode speaks gRPC to TokenSpeed only
HOST = "127.0.0.1"
# Idle verification (infra/cluster/idle.py): the scheduler snapshot gauges its engine writes to the
# Prometheus multiprocess folder (tokenspeed runtime/metrics/collector.py EngineMetrics:
# tokenspeed:num_requests_running / _waiting / kv_cache_usage_perc, a 0-1 ratio, livemax). An
# encode worker exports no metric of its own, so it is not checked.
IDLE_GAUGES = {"running": "tokenspeed:num_requests_running",
               "waiting": "tokenspeed:num_requests_waiting",
               "kv_cache_usage": "tokenspeed:kv_cache_usage_perc"}
IDLE_SKIP_ROLES = ("encode",)
TRANSPORTS = {"nvlink": {"MC_INTRANODE_NVLINK": "1"},
              "tcp": {"MC_FORCE_TCP": "1", "MC_TCP_ENABLE_CONNECTION_POOL": "1"}}
# Over TCP, Mooncake opens a socket per transfer request and closes it after unless its pool is on
# (tcp_transport.cpp getConnection/startTransfer; the pool is off by default), and TokenSpeed's
# prefill sends one request per page, layer and K/V (runtime/pd/mooncake/prefill.py): the ports
# left in TIME_WAIT towards the decode's one address ran out within a KV corruption lane on an
# H100 ("connect: Cannot assign requested address", then Mooncake failed the session for 30 s;
# docs/gpu.md, the KV corruption lane's `bitflip:0.1` on one H100). Mooncake's troubleshooting
# guide names the pool as the fix (docs/source/troubleshooting/troubleshooting.md, "TCP
# Transport").
# EngineOptions.engine_opts["mooncake_transport"]: Mooncake's transport between workers on one
# host. "nvlink" = MC_INTRANODE_NVLINK=1 (smg's CI; CUDA IPC), "tcp" = MC_FORCE_TCP=1 (through
# host memory). With neither, Mooncake picks multi-node NVLink (fabric handles), which does not
# publish torch's cudaMalloc memory. Env E2E_MOONCAKE_TRANSPORT.
DEFAULT_TRANSPORT = "nvlink"
UNSET_FOR_NVLINK = "MC_FORCE_TCP"
# SIGTERM -> SIGKILL after this many seconds. The servicer cannot stop cleanly sooner: its SIGTERM
# path polls for in-flight requests every 0.5 s, SIGKILLs the scheduler children, then gives gRPC a
# fixed 5 s stop grace (smg_grpc_servicer/tokenspeed/server.py:193-208, servicer.py:865-910), while
# AsyncLLM's sigterm_watchdog wakes every 5 s and ends it with a SIGKILL of itself (tokenspeed
# runtime/engine/async_llm.py:779-794): 13-15 s per topology on an H200, and sometimes no stop at
# all (docs/gpu.md, table "Engine figures"). Upstream's own path ends in SIGKILL; the harness sends
# it after 1.5 s (vLLM's clean stop takes 0.7 s) and verifies the teardown as always: no process,
# port, GPU memory or /dev/shm segment left.
STOP_GRACE_S = 1.5
# smg's load monitor polls every worker group's GetLoads, the encode group's included, unless
# no load-aware policy, overload protection or engine metrics need it (smg 1.13
# worker/monitor.rs:1421-1428; the default --policy cache_aware is load-aware). TokenSpeed
# 0.1.0's encode loop takes that query for a request and dies (runtime/epd/encode_loop.py
# :300-301 -> encode_worker.py:97 `request.request_id`). Fixed upstream by smg PR #2249
# (encode GetLoads answers empty: in servicer 0.9.1.post20260920, which TokenSpeed 0.1.1's
# bundle carries, not in the 0.7.0.post20260720 of 0.1.0's); TokenSpeed PR #1205 passes
# --disable-load-monitoring. So EPD gateways run without it where the servicer is older
# (workaround "epd-gateway-no-load-poll", WORKAROUNDS).
EPD_GATEWAY_ARGS = ("--policy", "round_robin", "--disable-load-monitoring",
                    "--disable-worker-overload-protection")
ENCODE_GETLOAD_CRASH = KnownCrash(
    pattern=r"'GetLoadReqInput' object has no attribute 'request_id'",
    summary=("TokenSpeed 0.1.0's encode worker takes smg's GetLoads query for a request and "
             "dies"),
    refs=("tokenspeed runtime/epd/encode_worker.py:97", "smg worker/monitor.rs load monitor",
          "fixed by smg PR #2249"),
    role="encode")



# -- What each TokenSpeed release needs of the harness --------------------------------------
#
# The harness's workarounds for TokenSpeed, by name, and the first release of a distribution
# ("tokenspeed", or "servicer": its gRPC servicer, SERVICER_DISTS) that no longer needs one;
# None: every release read needs it. The evidence, release by release: docs/staging.md,
# "TokenSpeed 0.1.1: what changed for the harness". A version that cannot be read (the harness
# outside the engine's environment, the unit tests) counts as needing every workaround.
SERVICER_DISTS = ("tokenspeed-smg-grpc-servicer", "smg-grpc-servicer")
WORKAROUNDS = (
    # EPD_GATEWAY_ARGS: servicer 0.9.1 answers an encode worker's GetLoads itself, empty
    # (smg_grpc_servicer/tokenspeed/servicer.py GetLoads, disaggregation_mode == "encode"), and
    # TokenSpeed 0.1.1's encode loop drops a control message (runtime/epd/encode_loop.py).
    ("epd-gateway-no-load-poll", ("servicer", (0, 9, 1))),
    # serving_defaults' --kvstore-ratio: TokenSpeed 0.1.1 builds no host pool with
    # --disable-kvstore (runtime/execution/device.py: L2CacheExecutor only if enable_kvstore).
    ("host-pool-ratio", ("tokenspeed", (0, 1, 1))),
    # alone_reason for a hybrid model: 0.1.0 gives the recurrent-state pool the budget's share
    # beside the KV (runtime/layers/attention/utils.py profile_cache_budget), unbounded by
    # --max-total-tokens; 0.1.1 pages KV and state in one arena whose parents the token limit
    # caps (layers/attention/kv_cache/recipes/base.py num_lcm_blocks, configured_token_limit).
    ("hybrid-boots-alone", ("tokenspeed", (0, 1, 1))),
    # top_logprobs = 0: 0.1.1 refuses top-k too (runtime/engine/input_processor.py).
    ("no-top-logprobs", None),
    # the kv_corrupt decode without prefix caching (build, forget_received_kv): the flag
    # gates the decode's prefix match at admission, so it asks the prefill for every page.
    ("kv-corrupt-decode-uncached", None),
    # forget_received_kv flushes no worker: 0.1.0's FlushCache acknowledges without flushing
    # (runtime/engine/request_handler.py). 0.1.1's clears (the compiled scheduler's
    # clear_cache) and answers success only then; 0.1.1 needs it: its decode publishes every
    # full received page into its prefix index with prefix caching off, and points the
    # request at the page already there for the same tokens (docs/upstream.md), so a page
    # corrupted in one kv_corrupt case is not read where an earlier case left that prefix.
    ("kv-corrupt-no-flush", ("tokenspeed", (0, 1, 1))),
    # GRAPH_STALL_SAMPLERS: 0.1.1 still captures the generic Gumbel route
    # (sampling/backends/triton.py prepare_capture); tokenspeed-kernel 0.1.4's kernel unread.
    ("triton-sampler-graphs-refused", None),
)
WORKAROUND_NAMES = tuple(name for name, _ in WORKAROUNDS)


def release(version: str | None) -> tuple[int, ...] | None:
    """The release of a PEP 440 version string ("0.9.1.post20260920" -> (0, 9, 1)); None for
    None or a string that is no version. Pure."""
    try:
        return Version(version).release if version else None
    except InvalidVersion:
        return None


def no_prefix_cache_flag(tokenspeed: str | None) -> str:
    """The flag that turns prefix caching off on this TokenSpeed version (0.1.0's for an
    unknown one). Pure."""
    rel = release(tokenspeed)
    return NO_PREFIX_CACHE_FLAGS[rel is not None and rel >= (0, 1, 1)]


def workarounds(tokenspeed: str | None, servicer: str | None = None) -> frozenset[str]:
    """The workarounds (WORKAROUNDS) that these installed versions of TokenSpeed and of its
    gRPC servicer need; an unknown version needs them all. Pure."""
    have = {"tokenspeed": release(tokenspeed), "servicer": release(servicer)}
    out = set()
    for name, fixed in WORKAROUNDS:
        if fixed is None:
            out.add(name)
            continue
        dist, first = fixed
        if have[dist] is None or have[dist] < first:
            out.add(name)
    return frozenset(out)


def workaround_line(tokenspeed: str | None, servicer: str | None = None) -> str:
    """The line a TokenSpeed worker's log gets after its command: its versions and which
    workarounds apply (WorkerCommand.log_note). Pure."""
    applied = workarounds(tokenspeed, servicer)
    on = [n for n in WORKAROUND_NAMES if n in applied]
    off = [n for n in WORKAROUND_NAMES if n not in applied]
    return (f"e2e: TokenSpeed {tokenspeed or '(version unknown)'} (servicer "
            f"{servicer or 'unknown'}): workarounds applied: {', '.join(on) or 'none'}; "
            f"not needed: {', '.join(off) or 'none'}")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def installed_versions() -> dict[str, str | None]:
    """{"tokenspeed": version, "servicer": version} of this environment, read once (the
    harness runs in the engine's environment; None where a distribution is not installed)."""
    return {"tokenspeed": _dist_version("tokenspeed"),
            "servicer": _dist_version(*SERVICER_DISTS)}


def _disagg(topology: Topology, entry: PlanEntry) -> bool:
    return topology.kind in ("pd", "epd") and entry.role in DISAGG_ROLES


def aux_ports(topology: Topology, entry: PlanEntry, options: EngineOptions) -> list[str]:
    """Names of the extra ports a worker needs, allocated by the cluster.

    "bootstrap": the Mooncake bootstrap server of a prefill/encode worker (the gateway is told it).
    "dist_init": the base of TokenSpeed's control-plane port cluster (it also binds a few ports
    right above it). Every worker gets one: TokenSpeed needs it for every disaggregation role
    and for dp > 1. Without it a regular worker derives its ports from --port (0.1.0
    server_args PortArgs.init_new): its control-plane cluster at --port + ZMQ_TCP_PORT_DELTA
    (233), and the TCPStore of torch.distributed at --port + randint(100, 1000) (`nccl_port`,
    checked free when drawn, bound later: execution/distributed_initializer.py uses it where
    no --dist-init-addr was given), ports in the harness's range that the harness may have
    handed to another server: with topologies booting at once, such a worker dies binding its
    TCPStore (EADDRINUSE) and is relaunched on the lane's critical path (docs/decisions.md).
    Given the address, the TCPStore binds the block's base.
    """
    names = []
    disagg = _disagg(topology, entry)
    if disagg and entry.role in ("prefill", "encode"):
        names.append("bootstrap")
    names.append("dist_init")
    return names


# TokenSpeed derives its control-plane ports from --dist-init-addr's port as SGLang does
# (server_args PortArgs: port_base = dist_init + 1, then the detokenizer, RPC, metrics and
# load-collector ports above it, and one scheduler input port per DP rank). A port of that
# block handed to another server (the gateway of the same topology, say) fails that server's
# bind ("Address already in use") and with it the topology's tests. The cluster allocates
# dist_init as a block this wide.
DIST_INIT_DERIVED = 8


def dist_init_span(entry: PlanEntry) -> int:
    """Ports from --dist-init-addr's port up that a TokenSpeed worker may bind."""
    return 1 + DIST_INIT_DERIVED + max(1, entry.dp)


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
    versions = installed_versions()
    applied = workarounds(**versions)
    transport = options.opt("mooncake_transport", DEFAULT_TRANSPORT)
    if transport not in TRANSPORTS:
        raise ConfigError(f"mooncake transport {transport!r}: use one of "
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
            # 663-671; flat_memory_executor.py:79-82). A 0.30 pool of an H200 asks for more
            # pinned memory than a runner has (FlatHostMirror, CUDA OOM; docs/upstream.md). The
            # suites test no host-tier cache; prefix caching on the device stays on.
            "--disable-kvstore"]
    if spec.kv_budget_tokens:
        # The pool from the model's KV budget, not from the memory fraction (a cap:
        # min(profiled, requested); TokenSpeed registry.py:76-90).
        argv += ["--max-total-tokens", str(spec.kv_budget_tokens)]
    # The Hopper kernel overrides in every worker's own environment, so that every way to
    # start one (a lane, `bench`, `main`, a probe) gets them: without them a worker on Hopper
    # dies in its first forward ("no kernel image is available", rope.cu; docs/upstream.md).
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, entry.gpus)), **dict(HOPPER_ENV),
           **dict(COMPILE_ENV)}
    if disagg:
        # A disaggregated worker cannot run the servicer's standalone 1-token warmup (no peer
        # to pair with), so it skips it, as smg's own harness does for these roles only
        # (server.py:220). A regular or DP worker keeps it: SERVING then means one real
        # generation ran. Without it, smg's first deep health probe (servicer.py HealthCheck:
        # a 1-token generate for aggregated workers) is the engine's first generation, takes
        # more than smg's 5 s reachability timeout, and smg retries only after 30 s
        # ("detect_connection_mode ... gRPC reachability timeout", "delay_ms=30000" in the
        # gateway log): the gateway's readiness waits about 30 s longer
        # (docs/gpu.md, table "Engine figures").
        env["TOKENSPEED_SKIP_GRPC_WARMUP"] = "1"
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
    # A decode of the kv_corrupt profile matches no prefix at admission, so it asks the prefill
    # for every page of every prompt: otherwise a page corrupted in one case would be reused,
    # unreceived and uncounted, by the next case's identical prompts. Prefix caching is on by
    # default (runtime/utils/server_args.py: enable_prefix_caching = True), so it is turned
    # off by name; leaving out --enable-prefix-caching leaves it on. Every release read
    # ("kv-corrupt-decode-uncached", WORKAROUNDS); what else a case needs between cases:
    # forget_received_kv.
    corrupt = options.opt("kv_corrupt", "")
    corrupting = bool(corrupt) and entry.role == "decode"
    if disagg:
        argv += ["--disaggregation-mode", entry.role]
        if entry.role in ("prefill", "encode"):
            bootstrap = ports.aux["bootstrap"]
            argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
        argv += ["--disaggregation-transfer-backend", "mooncake",
                 "--dist-init-addr", f"{HOST}:{ports.aux['dist_init']}"]
        if entry.role == "prefill" or (entry.role == "decode" and not corrupting):
            argv.append("--enable-prefix-caching")
        elif corrupting:
            argv.append(no_prefix_cache_flag(versions["tokenspeed"]))
        if entry.role == "prefill":
            argv.append("--enforce-eager")
            eager = True
        env.update({**TRANSPORTS[transport],
                    "NO_PROXY": "*", "no_proxy": "*"})
        if entry.role == "encode":
            # No embedding cache: every image runs the vision tower (the EPD proof).
            env["TOKENSPEED_EPD_ENCODE_EMBED_CACHE_MB"] = "0"
    else:
        argv += ["--dist-init-addr", f"{HOST}:{ports.aux['dist_init']}"]
    if options.enforce_eager and not eager:
        argv.append("--enforce-eager")
    extra = list(spec.engine_args("tokenspeed", entry.role)) + list(options.extra_args)
    sampler = _flag_value(extra, "--sampling-backend")
    graphs = not (eager or options.enforce_eager or "--enforce-eager" in extra)
    if sampler in GRAPH_STALL_SAMPLERS and graphs and "triton-sampler-graphs-refused" in applied:
        raise ConfigError(f"TokenSpeed {entry.name}: CUDA graphs with --sampling-backend "
                          f"{sampler} stall the boot: {GRAPH_STALL_SAMPLERS[sampler]}; "
                          f"run it eager (E2E_ENFORCE_EAGER=1) or with another sampler")
    argv += extra + serving_defaults(extra, graphs=graphs, applied=applied)
    warm = bool(options.opt("warm_spawn", DEFAULT_WARM_SPAWN)) and entry.tp == 1 and entry.dp == 1
    preload = ()
    if corrupting:
        # The KV corruption negative control (engines/kv_corrupt_tokenspeed.py): patched into
        # the decode's scheduler process by the warm-spawn launcher's preload.
        try:
            kv_corrupt.check_setting(corrupt)
        except ValueError as e:
            raise ConfigError(f"kv_corrupt={corrupt!r}: {e}") from None
        if not warm:
            raise ConfigError(f"kv_corrupt on TokenSpeed's {entry.name} needs the warm spawn "
                              "(its patch loads in the waiting scheduler interpreter): "
                              "E2E_TOKENSPEED_WARM_SPAWN=1 and a decode of tp 1, dp 1")
        if not options.state_dir:
            raise ConfigError("kv_corrupt needs a state folder (its control file and counts)")
        env.update({kv_corrupt_tokenspeed.ENV_SETTING: corrupt,
                    kv_corrupt_tokenspeed.ENV_DIR: kv_corrupt.control_dir(options.state_dir,
                                                                          entry.name)})
        preload = (kv_corrupt_tokenspeed.MODULE,)
    if warm:
        argv = warm_spawn_argv(argv, preload=preload, version=versions["tokenspeed"])
        env["PYTHONPATH"] = extend_pythonpath(LAUNCHERS)
    # Mooncake reads MC_FORCE_TCP before MC_INTRANODE_NVLINK, so a TCP setting inherited from
    # the environment (a staging env file exports it) would silently win over "nvlink".
    unset = (UNSET_FOR_NVLINK,) if disagg and transport == "nvlink" else ()
    return WorkerCommand(argv=argv, env=env, protocol="grpc", unset_env=unset,
                         log_note=workaround_line(**versions),
                         readiness=GrpcHealth(ports.api, service=""),
                         worker_type=entry.role if disagg else "regular",
                         bootstrap_port=bootstrap, start_stage=entry.start_stage,
                         metrics_dir=metrics_dir, stop_grace_s=STOP_GRACE_S)


# Samplers whose CUDA graph capture does not finish within a boot limit. TokenSpeed 0.1.0's
# triton backends route the capture's default variant to the generic Gumbel pool kernel
# (sampling/backends/triton.py prepare_capture: _SAMPLE_ROUTE_GUMBEL_GENERIC; triton_full
# calls the same kernel), which tokenspeed_kernel 0.1.3 writes with TOPK_PAD = 128 unrolled by
# tl.static_range inside the vocabulary loop and again over its 8 attempts
# (ops/sampling/triton/generic.py). On an H200, py-spy finds workers with graphs still in
# tokenspeed_triton's make_ttgir compiling `_gumbel_sample_generic_pool_kernel`, called from
# the capture's warm-up (execution/cuda_graph_wrapper.py run_once), when their 300 s boot
# limit comes, long after NCCL's init (docs/upstream.md). Eager workers never compile it:
# greedy batches take cute_argmax.
GRAPH_STALL_SAMPLERS = {
    name: ("the graph capture compiles tokenspeed_kernel's generic Gumbel sampling kernel, "
           "still compiling after 270 s on an H200 (TokenSpeed 0.1.0)")
    for name in ("triton", "triton_full")}


# What the harness asks of a TokenSpeed worker unless E2E_ENGINE_ARGS (or the model's own
# arguments) say otherwise, each measured on an H200 (docs/gpu.md, table "Engine figures"):
# - the greedy sampler: every request the harness sends is temperature 0, whose answer is the
#   argmax either way (`greedy` ignores temperature, top-p and top-k: a request with sampling
#   parameters would get argmax too); TokenSpeed's own default, FlashInfer's sampler,
#   JIT-compiles with nvcc, and the triton ones stall a graph capture (GRAPH_STALL_SAMPLERS);
# - with CUDA graphs, capture batch sizes up to GRAPH_MAX_BS only, and no prefill graph: the
#   harness has at most 16 requests in flight on a topology (the passes' concurrency, a
#   burst's E2E_BURST_N default), a larger batch runs without a graph (cuda_graph_wrapper
#   can_run: bs <= max_bs). A worker is ready in about half the time it takes with
#   TokenSpeed's default sizes (1-32, 64, 96, 128, 160) and its prefill graph.
# - a host KV pool of KVSTORE_RATIO of the device pool: with --disable-kvstore TokenSpeed
#   0.1.0 still allocates its host pool, for retraction (event_loop.py "KVStore L2 cache will
#   not be used during normal execution, but it will still be used when retraction happens"),
#   at --kvstore-ratio 2.0 x the device pool, and pins it for the GPU
#   (kv_cache_host.py init_kv_buffer: torch.empty on the host, then
#   register_host_tensor_for_gpu_access): 6 GB for SmolLM2's 131072-token pool, in every
#   worker, which lengthens every worker's `allocating KV cache` to ready by seconds.
#   The suites never fill the device pool (at most 16 requests of at most 4096 tokens in
#   flight, half of it), so nothing is retracted; the host tier is not under test. 0.1.1
#   builds no host pool with --disable-kvstore (execution/device.py), so the ratio is given
#   only where workaround "host-pool-ratio" applies (WORKAROUNDS).
# Eager (E2E_ENFORCE_EAGER=1, and the always-eager prefill) TokenSpeed's scheduler is
# CPU-bound for this 135M model, every request shape alike (scripts/probe_shapes.py); with
# graphs `1`'s oracle passes take a tenth of the time.
DEFAULT_SAMPLER = "greedy"
GRAPH_MAX_BS = 16
KVSTORE_RATIO = "0.05"
_KVSTORE_FLAGS = ("--kvstore-ratio", "--kvstore-size")
_CAPTURE_FLAGS = ("--max-cudagraph-capture-size", "--cudagraph-capture-sizes")
_PREFILL_GRAPH_FLAGS = ("--disable-prefill-graph", "--prefill-graph-max-tokens",
                        "--prefill-graph-capture-sizes")


def _has_flag(args: list[str], flags) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def spawn_env(args: list[str], version: str | None = None
              ) -> tuple[dict[str, str], dict[str, str]]:
    """What TokenSpeed's servicer puts in its environment before it starts the scheduler,
    for these server arguments and TokenSpeed `version` (None: as 0.1.0): (set, set where
    unset). Pure.

    runtime/entrypoints/engine.py _set_envs_and_config sets TF_CPP_MIN_LOG_LEVEL, the two CUDA
    variables, NCCL_CUMEM_ENABLE (--enable-symm-mem) and, without it, NCCL_NVLS_ENABLE
    (--enable-nccl-nvls), and setdefaults the TF32 overrides unless --disable-tf32;
    utils/server_args.py validate() sets TOKENSPEED_MAMBA_SSM_DTYPE (--mamba-ssm-dtype, default
    float32) and setdefaults TORCHINDUCTOR_ENABLE_PDL and TRTLLM_ENABLE_PDL unless
    --disable-pdl. The warm interpreter gets them from its start, as a spawned scheduler does:
    TokenSpeed compiles with torch.compile at import (runtime/sampling/utils.py,
    layers/common.py), which reads inductor's config, TORCHINDUCTOR_ENABLE_PDL with it, so a
    warm scheduler imported without them compiles without PDL where a spawned one compiles
    with it (the launcher's line "the parent's environment differs in" names any left out).
    0.1.1 (engine.py _set_envs_and_config) sets NCCL_CUMEM_ENABLE=0 only with
    --disable-symm-mem and NCCL_NVLS_ENABLE=0 only with --disable-nccl-nvls, and neither
    otherwise: a warm interpreter given 0.1.0's values would see another environment than the
    servicer's at the request, and the launcher would spawn the scheduler cold."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3",
           "CUDA_DEVICE_MAX_CONNECTIONS": "4", "CUDA_MODULE_LOADING": "AUTO",
           "TOKENSPEED_MAMBA_SSM_DTYPE": _flag_value(args, "--mamba-ssm-dtype") or "float32"}
    if (release(version) or (0, 1, 0)) >= (0, 1, 1):
        if _has_flag(args, ("--disable-symm-mem",)):
            env["NCCL_CUMEM_ENABLE"] = "0"
        if _has_flag(args, ("--disable-nccl-nvls",)):
            env["NCCL_NVLS_ENABLE"] = "0"
    else:
        symm = _has_flag(args, ("--enable-symm-mem",))
        env["NCCL_CUMEM_ENABLE"] = "1" if symm else "0"
        if not symm:
            env["NCCL_NVLS_ENABLE"] = "1" if _has_flag(args, ("--enable-nccl-nvls",)) else "0"
    default = {}
    if not _has_flag(args, ("--disable-tf32",)):
        default.update(NVIDIA_TF32_OVERRIDE="1", TORCH_ALLOW_TF32_CUBLAS_OVERRIDE="1")
    if not _has_flag(args, ("--disable-pdl",)):
        default.update(TORCHINDUCTOR_ENABLE_PDL="1", TRTLLM_ENABLE_PDL="1")
    return env, default


def warm_spawn_argv(argv: list[str], preload: tuple[str, ...] = (),
                    version: str | None = None) -> list[str]:
    """The servicer's argv (`python -m SERVICER_MODULE ARGS`) run through the warm-spawn
    launcher (see WARM_SPAWN), whose imports run with the garbage collector off (the
    launcher's default), and whose waiting interpreter then fills the caches of WARM_CALLS
    before the request. `preload`: modules its waiting interpreter imports after the
    scheduler's own (the KV corruption's patch). `version`: TokenSpeed's (spawn_env). Pure."""
    module, target, spawn_preload = WARM_SPAWN
    if argv[1:3] != ["-m", SERVICER_MODULE]:
        raise ValueError(f"not a servicer command: {argv[:3]}")
    out = [argv[0], "-m", module, "--run", SERVICER_MODULE, "--target", target]
    for name in (*spawn_preload, *preload):
        out += ["--preload", name]
    for name in WARM_CALLS:
        out += ["--call", name]
    env, default = spawn_env(argv[3:], version)
    out += [a for k, v in env.items() for a in ("--child-env", f"{k}={v}")]
    out += [a for k, v in default.items() for a in ("--child-env-default", f"{k}={v}")]
    return [*out, "--", *argv[3:]]


def serving_defaults(extra: list[str], graphs: bool,
                     applied: frozenset[str] = frozenset(WORKAROUND_NAMES)) -> list[str]:
    """The flags of the harness's defaults that `extra` does not set (see above); the host
    pool's ratio only where workaround "host-pool-ratio" is in `applied`. Pure."""
    out = [] if _has_flag(extra, ("--sampling-backend",)) else [
        "--sampling-backend", DEFAULT_SAMPLER]
    if "host-pool-ratio" in applied and not _has_flag(extra, _KVSTORE_FLAGS):
        out += ["--kvstore-ratio", KVSTORE_RATIO]
    if graphs:
        if not _has_flag(extra, _CAPTURE_FLAGS):
            out += ["--max-cudagraph-capture-size", str(GRAPH_MAX_BS)]
        if not _has_flag(extra, _PREFILL_GRAPH_FLAGS):
            out.append("--disable-prefill-graph")
    return out


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value given for `flag` (`--flag V` or `--flag=V`) in an argv list."""
    val = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


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


def beside(plan, device_shares: dict):
    """The plan of a topology booting beside others (coboot.assign), where `device_shares` is
    the memory share that the topologies running at once may hold together on each device.
    Every worker on a shared device gets that total as its --gpu-memory-utilization:
    TokenSpeed's pool budget is free_now - total x (1 - utilization), and with every worker
    holding at most its own planned share (the pool bounded by --max-total-tokens), free_now >=
    total x (1 - W) + the worker's own share whatever the others have allocated yet, so the
    budget it sees is at least its own share (W: the total). The cumulative shares of
    packed_schedule are the same rule inside one topology. Pure."""
    if not device_shares:
        return plan
    out = []
    for e in plan.entries:
        shared = [device_shares[g] for g in e.gpus if g in device_shares]
        out.append(replace(e, mem_fraction=round(max(shared), 4)) if shared else e)
    return replace(plan, entries=tuple(out))


# -- PD on TokenSpeed -------------------------------------------------------------------------
#
# TokenSpeed's servicer serves no /metrics; with --enable-metrics its engine writes Prometheus
# multiprocess files (the builder points PROMETHEUS_MULTIPROC_DIR at the cluster's state
# folder; Worker.metrics reads them). Its KV-transfer metrics are no-ops in 0.1.0 and 0.1.1
# (runtime/metrics/collector.py KVTransferMetrics), so the proof combines:
# - the gateway sent every request to a prefill AND a decode worker
#   (smg_worker_selection_total{worker_type=...}) and counted no bootstrap / KV-transfer
#   failure (smg_pd_bootstrap_failures_total, smg_pd_kv_transfer_failures_total);
# - the prefill workers ran the prompts forward (tokenspeed:iteration_tokens_total_sum, the
#   tokens of every scheduler forward step);
# - the decode workers finished every request successfully (tokenspeed:request_success) and
#   generated its tokens. A TokenSpeed decode node cannot recompute a prompt: its extend step
#   only posts the KV receive and returns without a forward pass, and a request whose transfer
#   fails or times out is aborted ("PD/EPD remote transfer failed or timed out"), not served
#   (tokenspeed runtime/engine/event_loop.py, DisaggDecodeExecutor branch and the
#   FailedEvent handling). So a successful decode-side finish means the KV arrived.

TS_PREFIX = "tokenspeed:"


@dataclass
class TokenSpeedPDProof:
    requests: int
    prompt_tokens: int
    gateway_prefill_selections: float
    gateway_decode_selections: float
    gateway_transfer_failures: float
    prefill_forward_tokens: float
    prefill_finished: float
    decode_success: float
    decode_generation_tokens: float
    decode_prompt_tokens: float
    # PD pairs smg's veto fallback picked, counted in the two selections above
    # (proof.FALLBACKS); absent in older records, read as 0
    gateway_fallback_pairs: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def tokenspeed_transfer_problems(proof: TokenSpeedPDProof, n: int) -> list[str]:
    """Exact checks of a TokenSpeed PD proof. Pure (tests/test_proof_exact.py).

    - the prefill ran every prompt token forward, and at most one more token per request
      (the first token it samples): prompt_tokens <= prefill_forward_tokens <=
      prompt_tokens + n (H200 records: 1558 -> 1562 and 1560 -> 1564 for 4 requests);
    - the decode side counted the whole prompt of every request it finished
      (tokenspeed:prompt_tokens_total == the prompt tokens the gateway reported; records:
      1558/1558, 1560/1560): a decode that got a shorter or another request's prompt differs;
    - the decode finished every request and generated its tokens."""
    problems = dispatch_problems(proof, n)
    pt = proof.prompt_tokens
    if pt <= 0:
        return problems + ["no prompt tokens sent: nothing was proved"]
    if not pt <= proof.prefill_forward_tokens <= pt + n:
        problems.append(f"prefill ran {proof.prefill_forward_tokens:.0f} tokens forward for "
                        f"{pt} prompt tokens in {n} requests (expected {pt} to {pt + n})")
    if proof.decode_prompt_tokens != pt:
        problems.append(f"decode counted {proof.decode_prompt_tokens:.0f} prompt tokens for "
                        f"the {pt} the prefill was sent")
    if proof.decode_success < n:
        problems.append(f"decode finished only {proof.decode_success:.0f} of {n} requests "
                        "successfully")
    if proof.decode_generation_tokens <= 0:
        problems.append("decode generated no tokens")
    return problems


def pd_transfer_tokenspeed(cluster, n: int = 4, roles: dict | None = None) -> TokenSpeedPDProof:
    """`roles`: the workers read as {"prefill": [...], "decode": [...]} (default: the
    topology's own; the negative control reads a regular worker as both)."""
    roles = roles or {}
    decode = roles.get("decode") or cluster.role("decode")
    prefill = roles.get("prefill") or cluster.role("prefill")
    if not decode or not prefill:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    b_d, b_p, b_g = scrape_all(decode), scrape_all(prefill), cluster.gateway_metrics()
    prompt_tokens = sum(u["prompt_tokens"] for u in post_all(
        cluster, "PD proof", "/v1/chat/completions",
        ({"model": cluster.model_name, "max_tokens": 8, "temperature": 0,
          "messages": [{"role": "user", "content": long_unique_prompt(seed=i)}]}
         for i in range(n))))
    a_d, a_p, a_g = scrape_all(decode), scrape_all(prefill), cluster.gateway_metrics()
    gw = gateway_dispatch(b_g, a_g, pd=cluster.topology.kind == "pd")
    gw.pop("gateway_encode_selections")
    proof = TokenSpeedPDProof(
        requests=n, prompt_tokens=prompt_tokens, **gw,
        prefill_forward_tokens=sum_delta(b_p, a_p, TS_PREFIX + "iteration_tokens_total_sum"),
        prefill_finished=sum_delta(b_p, a_p, TS_PREFIX + "num_requests_total"),
        decode_success=sum_delta(b_d, a_d, TS_PREFIX + "request_success_total"),
        decode_generation_tokens=sum_delta(b_d, a_d, TS_PREFIX + "generation_tokens_total"),
        decode_prompt_tokens=sum_delta(b_d, a_d, TS_PREFIX + "prompt_tokens_total"),
    )
    return verdict("PD transfer proof (tokenspeed)", cluster,
                    tokenspeed_transfer_problems(proof, n), proof)


# -- EPD on TokenSpeed: the encoder ran for the request --------------------------------------
#
# TokenSpeed's encode worker exports no metric of its own. What shows that the vision encoder
# ran on the encode worker for a request, and its output reached prefill:
# - the gateway dispatched every image item to an encode worker
#   (smg_worker_selection_total{worker_type="encode"} grows by one per image item) and to a
#   prefill and a decode worker, with no bootstrap / transfer failure counted;
# - a prefill node in EPD mode cannot run the tower itself: an item handshaked to an encode
#   worker that reaches the prefill forward without its received embedding raises, and an
#   embedding receive that times out aborts the request (tokenspeed runtime/engine/
#   event_loop.py _assert_epd_embeddings_received; runtime/pd/prefill_executor.py "EPD:
#   prefill aborted request ... (embedding receive timed out)"), so a 200 answer means the
#   embeddings arrived from the encoder;
# - the decode workers finished every request (tokenspeed:request_success), as in PD.
# The builder sets TOKENSPEED_EPD_ENCODE_EMBED_CACHE_MB=0 on encode workers and every proof
# image is new, so no embedding comes from the encoder's cache. The encode worker's INFO line
# "EPD encode: accepted request_id=..." is counted too when its log has it (TokenSpeed may
# reconfigure logging and drop it), as corroboration only.

ENCODE_LOG_LINE = "EPD encode: accepted request_id="


@dataclass
class EncoderProof:
    requests: int
    image_items: int
    prompt_tokens: int
    gateway_encode_selections: float
    gateway_prefill_selections: float
    gateway_decode_selections: float
    gateway_transfer_failures: float
    prefill_forward_tokens: float
    decode_success: float
    encode_log_lines: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def epd_encoder_ran(cluster, n: int = 3, roles: dict | None = None) -> EncoderProof:
    """`roles`: the workers read as {"encode": [...], "prefill": [...], "decode": [...]}
    (default: the topology's own; the negative control reads a regular worker as all three)."""
    roles = roles or {}
    enc, prefill, decode = (roles.get(r) or cluster.role(r) for r in ("encode", "prefill",
                                                                       "decode"))
    if not enc or not prefill or not decode:
        raise HarnessError(f"topology {cluster.topology.name} has no encode/prefill/decode roles")

    def enc_lines():
        try:
            return sum(w.process.log_text().count(ENCODE_LOG_LINE) for w in enc)
        except (OSError, AttributeError):   # no process or log yet
            return None
    b_g, b_p, b_d, b_l = (cluster.gateway_metrics(), scrape_all(prefill), scrape_all(decode),
                          enc_lines())
    salt = uuid.uuid4().int % 2**31
    prompt_tokens = sum(u["prompt_tokens"] for u in post_all(
        cluster, "EPD proof", "/v1/chat/completions",
        (image_chat_body(cluster.model_name, f"[{uuid.uuid4().hex[:8]}] Describe the image.",
                         random_png_data_uri(salt + i)) for i in range(n))))
    a_g, a_p, a_d, a_l = (cluster.gateway_metrics(), scrape_all(prefill), scrape_all(decode),
                          enc_lines())
    proof = EncoderProof(
        requests=n, image_items=n, prompt_tokens=prompt_tokens, **gateway_dispatch(b_g, a_g),
        prefill_forward_tokens=sum_delta(b_p, a_p, TS_PREFIX + "iteration_tokens_total_sum"),
        decode_success=sum_delta(b_d, a_d, TS_PREFIX + "request_success_total"),
        encode_log_lines=(a_l - b_l) if a_l is not None and b_l is not None else None,
    )
    return verdict("EPD encoder proof", cluster, epd_problems(proof, n), proof)


def epd_problems(proof: EncoderProof, n: int) -> list[str]:
    """Exact checks of a TokenSpeed EPD encoder proof. Pure (tests/test_proof_exact.py).

    - the gateway picked an encode worker for every image item, and a prefill and a decode
      for every request, with no transfer failure;
    - the prefill ran every prompt token forward and at most one more per request, as in PD
      (H200 records: 263 -> 266, 264 -> 267, 265 -> 268 for 3 requests): a prefill that skipped
      the image's tokens, or recomputed, differs;
    - the decode finished every request. No image item or no prompt token: nothing proved."""
    problems = dispatch_problems(proof, n)
    if proof.image_items <= 0 or proof.prompt_tokens <= 0:
        return problems + ["no image item or no prompt token sent: nothing was proved"]
    if proof.gateway_encode_selections < proof.image_items:
        problems.append(f"the gateway sent {proof.gateway_encode_selections:.0f} of "
                        f"{proof.image_items} image items to an encode worker")
    pt = proof.prompt_tokens
    if not pt <= proof.prefill_forward_tokens <= pt + n:
        problems.append(f"prefill ran {proof.prefill_forward_tokens:.0f} tokens forward for "
                        f"{pt} prompt tokens in {n} requests (expected {pt} to {pt + n})")
    if proof.decode_success < n:
        problems.append(f"decode finished only {proof.decode_success:.0f} of {n} requests")
    return problems



def proof_line(key: str, p: dict) -> str | None:
    """A recorded PD or EPD proof of TokenSpeed in one line (see pd_transfer_tokenspeed,
    epd_encoder_ran)."""
    if key == "pd_proof" and "decode_external" not in p:
        return (f"KV proof: gateway sent {p['gateway_prefill_selections']:.0f} prefill + "
                f"{p['gateway_decode_selections']:.0f} decode selections for "
                f"{p['requests']} requests, prefill ran {p['prefill_forward_tokens']:.0f}/"
                f"{p['prompt_tokens']} prompt tokens forward, decode finished "
                f"{p['decode_success']:.0f}/{p['requests']} ({p['decode_generation_tokens']:.0f}"
                f" tokens), transfer failures {p['gateway_transfer_failures']:.0f}")
    if key == "epd_proof":
        return (f"encoder proof: {p['gateway_encode_selections']:.0f}/{p['image_items']} image "
                f"items dispatched to encode, decode finished {p['decode_success']:.0f}/"
                f"{p['requests']}")
    return None


def server_info(port: int, timeout: float = 5.0) -> dict:
    """TokenSpeed's GetServerInfo over gRPC (server_args, scheduler_info as dicts), through
    the proto stubs its servicer ships (smg_grpc_proto)."""
    import grpc
    from google.protobuf.json_format import MessageToDict
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = pb_grpc.TokenSpeedSchedulerStub(ch).GetServerInfo(pb.GetServerInfoRequest(),
                                                                  timeout=timeout)
    return MessageToDict(resp, preserving_proto_field_name=True)


# FlushCache refuses while requests run (0.1.1 runtime/engine/request_handler.py
# `_try_clear_replica_cache`): a worker still finishing the last requests gets this many
# tries, FLUSH_WAIT_S apart.
FLUSH_TRIES = 20
FLUSH_WAIT_S = 0.5


def flush_cache(host: str, port: int, who: str, timeout: float = 30.0) -> None:
    """TokenSpeed's FlushCache over gRPC (smg_grpc_proto's stubs), retried while the worker
    answers no success; a HarnessError naming `who` and its last answer otherwise."""
    import grpc
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc
    last = ""
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        stub = pb_grpc.TokenSpeedSchedulerStub(ch)
        for i in range(FLUSH_TRIES):
            try:
                resp = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=timeout)
            except grpc.RpcError as e:
                raise HarnessError(f"{who}: FlushCache failed: {e.code().name} "
                                   f"{e.details()}") from None
            if resp.success:
                return
            last = resp.message
            if i + 1 < FLUSH_TRIES:
                time.sleep(FLUSH_WAIT_S)
    raise HarnessError(f"{who}: FlushCache answered no success {FLUSH_TRIES} times, "
                       f"{FLUSH_WAIT_S:g} s apart ({last!r}): its cache still holds what it "
                       "received")


def running_window(worker_url: str, timeout: float = 5.0) -> dict:
    """The worker's resolved running window from gRPC GetServerInfo's scheduler_info;
    {"error": why} when it cannot be read (stubs missing, worker gone)."""
    try:
        info = server_info(int(worker_url.rsplit(":", 1)[1]))
    except Exception as e:       # stubs missing, worker gone: say so, fall back to the log
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    sched = info.get("scheduler_info", {})

    def num(v):
        return int(v) if isinstance(v, (int, float)) else None
    return {"max_num_seqs": num(sched.get("max_num_seqs")),
            "max_total_num_tokens": num(sched.get("max_total_num_tokens")),
            "chunked_prefill_size": num(sched.get("chunked_prefill_size")),
            "source": "grpc GetServerInfo"}


# tokenspeed-kernel 0.1.3's CUDA objects are Blackwell-only (sm_100a/sm_103a); on Hopper two
# ops must take their triton implementations (docs/gpu.md). Harmless elsewhere. Set by every
# lane's TokenSpeed virtualenv (Engine.lane_env; lanes.py).
HOPPER_ENV = (
    ("TOKENSPEED_KERNEL_OVERRIDE_EMBEDDING_ROPE", "triton_embedding_rope"),
    ("TOKENSPEED_KERNEL_OVERRIDE_ATTENTION_ATTN_MERGE_STATE", "triton_attn_merge_state"),
)


# Torch Inductor compiles in the worker's own process (TORCHINDUCTOR_COMPILE_THREADS=1), not
# through its pool of compile subprocesses. TokenSpeed 0.1.0 torch.compiles the chosen tokens'
# logprobs (sampling/utils.py gather_token_logprobs_torch, with --enable-output-logprobs) at a
# worker's first forward: the first graph capture, or an eager worker's first request. py-spy
# (scripts/probe_boot.py) catches the scheduler in that compile while a thread waits on the
# pool (compile_worker/subproc_pool.py) and 17 pool processes, each importing torch, beside
# every worker with graphs. The same kernel is compiled either way, and the boot takes as long
# either way (docs/gpu.md, table "Engine figures"); the setting saves the 17 processes per
# worker.
COMPILE_ENV = (("TORCHINDUCTOR_COMPILE_THREADS", "1"),)


# TokenSpeed counts tokens per request at its end; per scheduler step, only this.
WORK_COUNTERS = ("tokenspeed:iteration_tokens_total_sum",)


# Boot states in a TokenSpeed worker's log (progress.py): the servicer's first lines come once
# its imports are done; the scheduler process's weights and its KV pool follow (a worker's log
# on an H200: "Inferred world_size ...", "Launching TokenSpeed scheduler + AsyncLLM...",
# "Loading safetensors checkpoint shards", "KVStore L2 cache ... (event_loop.py)").
PROGRESS_MARKERS = (
    (r"Inferred world_size|Launching TokenSpeed scheduler", "server imported, starting engine"),
    (r"KVStore L2 cache|kv_cache_host\.py", "allocating KV cache"),
)


class TokenSpeedEngine(Engine):
    idle_gauges = IDLE_GAUGES
    progress_markers = PROGRESS_MARKERS
    option_defaults = {"mooncake_transport": DEFAULT_TRANSPORT,  # noqa: RUF012
                       "warm_spawn": DEFAULT_WARM_SPAWN}
    env_options = {"mooncake_transport": "E2E_MOONCAKE_TRANSPORT",  # noqa: RUF012
                   "warm_spawn": "E2E_TOKENSPEED_WARM_SPAWN"}
    packages = ("tokenspeed",)
    extra = "tokenspeed"
    stage_env = "/root/stage/ts-env.sh"
    settings_rows = (Setting("E2E_MOONCAKE_TRANSPORT", Choice("nvlink", "tcp"), DEFAULT_TRANSPORT,
                             "TokenSpeed PD/EPD Mooncake transport on one host"),
                     Setting("E2E_TOKENSPEED_WARM_SPAWN", Bool(), DEFAULT_WARM_SPAWN,
                             "start a TokenSpeed worker's scheduler interpreter, and its "
                             "imports, beside the servicer's own (launchers/e2e_warm_spawn.py; "
                             "a worker of tp 1, dp 1); 0: as TokenSpeed spawns it"))
    # TokenSpeed 0.1.0 and 0.1.1 refuse top-k output logprobs: "top_logprobs_num
    # > 0 (output top-k logprobs) is not supported yet; use top_logprobs_num=0 (the sampled
    # token's logprob)", a 400 through smg (runtime/engine/input_processor.py;
    # "no-top-logprobs", WORKAROUNDS). The oracle then bounds the gap from the sampled
    # token's logprob alone (oracle.compare_item).
    top_logprobs = 0
    # smg 1.13's gRPC router drops logprobs from every completions response
    # (model_gateway/src/routers/grpc/regular/processor.rs:1282 "logprobs: None, // TODO: wire
    # legacy LogProbs from backend token_logprobs"; streaming.rs likewise), while chat converts
    # the servicer's output_logprobs (utils/logprobs.rs convert_proto_to_openai_logprobs): a
    # completion comes back with text and no logprobs. So the oracle asks
    # TokenSpeed through chat, `logprobs: true, top_logprobs: 0`.
    logprobs_api = "chat"
    idle_skip_roles = IDLE_SKIP_ROLES
    name = "tokenspeed"
    kinds = KINDS
    known_crashes = (ENCODE_GETLOAD_CRASH,)
    backends = ("cuda",)
    work_counters = WORK_COUNTERS
    generation_counter = TS_PREFIX + "generation_tokens_total"
    # RequestMetrics' e2e latency, observed at a request's finish (on a PD prefill: after its
    # transfer); lightseekorg/tokenspeed runtime/metrics/collector.py. Not read on a GPU:
    # where a worker lacks it, the prefill cancel falls back to the first token.
    request_latency_histogram = TS_PREFIX + "e2e_request_latency_seconds"
    lane_env = HOPPER_ENV
    boots_beside_others = (
        "TokenSpeed sizes its KV pool from the device's free memory at start (free_now - total"
        " x (1 - utilization), packed_schedule), so another topology booting beside it would "
        "change its budget unless the model's kv_budget_tokens bounds the pool")
    # nothing moved: the gateway dispatched nothing to a prefill/decode (or encode) worker
    proof_misses = {"pd": r"the gateway picked prefill 0 and decode 0 times",
                    "epd": r"the gateway sent 0 of \d+ image items to an encode worker"}

    def aux_ports(self, topology, entry, options):
        return aux_ports(topology, entry, options)

    def aux_port_span(self, name, entry):
        return dist_init_span(entry) if name == "dist_init" else 1

    def build(self, spec, topology, entry, ports, model_path, options):
        return build(spec, topology, entry, ports, model_path, options)

    def packed_schedule(self, entries, spec=None):
        return packed_schedule(entries, spec)

    def alone_reason(self, spec):
        # With the pool bounded (--max-total-tokens) a worker holds about its share, and
        # beside() gives each the utilization of everything booting on its device. Not for a
        # hybrid model where the version sizes its recurrent-state pool as the budget's share
        # beside the KV, which --max-total-tokens does not bound (workaround
        # "hybrid-boots-alone"): at the shared utilization it would take what the others were
        # promised.
        if (spec is not None and "hybrid" in spec.features
                and "hybrid-boots-alone" in workarounds(**installed_versions())):
            return (f"model {spec.id!r} is hybrid: TokenSpeed sizes its recurrent-state pool "
                    "from the device's free memory at start, whatever --max-total-tokens")
        if spec is not None and spec.kv_budget_tokens:
            return None
        return self.boots_beside_others

    def beside(self, plan, device_shares):
        return beside(plan, device_shares)

    def held_share(self, plan):
        # packed_schedule's fractions are cumulative (0.1, 0.2 for two workers at 0.1 each):
        # what a device holds is the largest, not the sum.
        out: dict = {}
        for e in plan.entries:
            for g in e.gpus:
                out[g] = max(out.get(g, 0.0), e.mem_fraction)
        return out

    def gateway_args(self, topology) -> tuple[str, ...]:
        needed = "epd-gateway-no-load-poll" in workarounds(**installed_versions())
        return EPD_GATEWAY_ARGS if topology.kind == "epd" and needed else ()

    def forget_received_kv(self, cluster) -> None:
        """Each decode matches no prefix at admission (its command turns prefix caching off:
        build), checked here; and where FlushCache clears (kv-corrupt-no-flush, WORKAROUNDS),
        every worker is flushed (flush_cache), which 0.1.1's decode needs: it points a request
        at pages an earlier request received for the same tokens. 0.1.0 cannot be flushed
        and never does that."""
        cached = [w.name for w in cluster.workers if w.entry.role == "decode"
                  and not set(NO_PREFIX_CACHE_FLAGS) & set(w.command.argv)]
        if cached:
            raise HarnessError(f"{cluster.name}: {', '.join(cached)} caches the KV it receives "
                               "and TokenSpeed 0.1.0 cannot flush it (FlushCache is a no-op): "
                               "a corrupted page would be reused by the next request")
        if "kv-corrupt-no-flush" in workarounds(**installed_versions()):
            return
        for w in cluster.workers:
            flush_cache(w.entry.host, w.ports.api, f"{cluster.name}: {w.name}")

    def pd_proof(self, cluster, roles=None):
        return pd_transfer_tokenspeed(cluster, roles=roles)

    def pd_legs(self, cluster, roles=None):
        # a prefill runs prompts forward; a decode counts the prompts it was handed and
        # finishes requests. TokenSpeed 0.1.0 has no counter that only the other role moves
        # (its KV-transfer metrics are no-ops), so the wrong role is not checked here.
        return legs_traffic(
            cluster,
            own={"prefill": [leg(TS_PREFIX + "iteration_tokens_total_sum")],
                 "decode": [leg(TS_PREFIX + "prompt_tokens_total"),
                            leg(TS_PREFIX + "request_success_total")]},
            foreign={}, path="/v1/chat/completions",
            body=lambda i: {"model": cluster.model_name, "max_tokens": 4, "temperature": 0,
                            "messages": [{"role": "user",
                                          "content": long_unique_prompt(words=120,
                                                                        seed=1000 + i)}]},
            roles=roles)

    def epd_proof(self, cluster, roles=None):
        return epd_encoder_ran(cluster, roles=roles)

    def proof_line(self, key, proof):
        return proof_line(key, proof)

    def running_window(self, worker_url, timeout=5.0):
        return running_window(worker_url, timeout)


ENGINE = TokenSpeedEngine()
