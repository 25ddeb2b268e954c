"""vLLM + afd-plugin (Attention-FFN Disaggregation) worker commands, and the plugin's env contract.

Topology "XaYf": one attention server (vLLM DP = X ranks) and one FFN server (DP = Y ranks), both
`vllm serve` processes configured through `--additional-config '{"afd": {...}}'`. The native
baseline ("native-dpN") is one plain `vllm serve` with DP N, TP 1 and expert parallel, the afd
plugin not loaded. Where each piece's contract comes from:

- Command shapes (`serve MODEL --served-model-name --data-parallel-size --tensor-parallel-size
  --enable-expert-parallel --additional-config JSON --enforce-eager --host --port`, the FFN gets
  its own --port too), the baseline command, and the env (CUDA_VISIBLE_DEVICES,
  VLLM_USE_V2_MODEL_RUNNER=0, VLLM_PLUGINS=afd for AFD roles and "" for the baseline,
  VLLM_ENGINE_READY_TIMEOUT_S=18000, PYTHONUNBUFFERED=1, AFD_PLUGIN_EARLY_ENGINE_PATCH dropped):
  vllm-project/afd-plugin tests/e2e/runner.py (build_vllm_command, build_baseline_command,
  build_env) and README.md ("GPU Attention-side shape", "GPU FFN-side shape").
- `additional_config["afd"]` keys role, connector, host, port, num_attention_ranks,
  num_ffn_ranks (defaults P2pNcclAFDConnector, 127.0.0.1, 1239): vllm-project/afd-plugin
  afd_plugin/config.py (AFDConfig) and README.md ("AFD Config").
- FFN first / readiness: the P2pNcclAFDConnector world is ordered FFN ranks first, so FFN rank 0
  hosts the tcp:// rendezvous store on `port`; each FFN subgroup also binds port+1..port+Y; the
  rendezvous times out after 2 minutes: vllm-project/afd-plugin afd_plugin/connectors/gpu/p2p.py
  (module docstring, init_afd_connector). The FFN joins the rendezvous only after loading its
  weights (afd_plugin/v1/worker/ffn_worker.py initialize_from_config), and its own API comes up
  only once Attention has joined; Attention joins when its model runner is built
  (afd_plugin/v1/worker/attention_model_runner.py). Hence: FFN stage 0, ready when the
  rendezvous port is bound; Attention stage 1; requests go to Attention only (README.md).
- Env contract (AFD_E2E_BACKEND, AFD_E2E_DEVICES, AFD_GPU_E2E_MODEL, AFD_GPU_E2E_VLLM_BIN default
  `vllm`): vllm-project/afd-plugin .agents/skills/run-e2e/SKILL.md ("Environment reference") and
  tests/e2e/README.md; AFD_E2E_LARGE_MODEL=1 with an existing model folder and exactly eight
  unique devices for Qwen3.5-122B: JiusiServe/afd-plugin .agents/skills/run-e2e/SKILL.md and
  tests/e2e/models/qwen3_5/test_qwen3_5_122b.py. Attention and FFN devices must be disjoint:
  vllm-project/afd-plugin tests/e2e/runner.py (validate_topology).
- Benchmark-only forced routing, removed for correctness runs (`WorkerCommand.unset_env`):
  VLLM_MOE_ROUTING_SIMULATION_STRATEGY and AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK
  (JiusiServe/afd-plugin tests/e2e/models/qwen3_5/test_qwen3_5_122b.py CONTROLLED_ROUTING_ENV_VARS
  / natural_routing_env), AFD_FORCE_BALANCED_TOPK_IDS (vllm-project/afd-plugin afd_plugin/envs.py,
  used by afd_plugin/model_executor/models/npu/deepseek_v2_attention_gate.py).

Always eager: the plugin's correctness scenarios (afd-eager-*, the 122B profile) are eager; its
graph mode needs FULL_DECODE_ONLY plus fixed capture sizes and is not built here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import ConfigError, HarnessError, SettingError
from ..lifecycle.launcher import WorkerCommand
from ..lifecycle.readiness import Alive, HttpGet, PortBound
from ..specs import settings
from ..specs.devices import check_gpu_ids
from ..specs.model_specs import ModelSpec
from ..specs.plan import PlanEntry
from ..specs.settings import Bool, Choice, DeviceList, Executable, Int, PathKind, Setting
from ..specs.topology import Topology
from ..verdicts.oracle import verdict_line
from ..verdicts.proof import long_unique_prompt, post_all, scrape_all, sum_delta
from . import Engine, EngineOptions, Ports, vllm
from .vllm import WORK_COUNTERS as VLLM_WORK_COUNTERS

CONNECTOR = "P2pNcclAFDConnector"
HOST = "127.0.0.1"
# Benchmark-only forced MoE routing: these change model outputs (see the module docstring).
FORCED_ROUTING_ENV = ("VLLM_MOE_ROUTING_SIMULATION_STRATEGY",
                      "AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK",
                      "AFD_FORCE_BALANCED_TOPK_IDS")
# The plugin's runner drops this legacy switch from every child environment.
UNSET_ENV = FORCED_ROUTING_ENV + ("AFD_PLUGIN_EARLY_ENGINE_PATCH",)
ENGINE_READY_TIMEOUT_S = "18000"
VLLM_BIN_ENV = "AFD_GPU_E2E_VLLM_BIN"
# Idle verification (infra/cluster/idle.py): attention and the native baseline are vLLM API servers;
# the FFN server takes no requests of its own.
IDLE_GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
               "kv_cache_usage": "vllm:kv_cache_usage_perc"}
IDLE_SKIP_ROLES = ("ffn",)


def aux_ports(topology: Topology, entry: PlanEntry, options: EngineOptions) -> list[str]:
    """The FFN entry owns the connector's rendezvous port ("afd"); it also binds the next
    num_ffn_ranks ports (one per FFN subgroup). Attention takes the same value from
    EngineOptions.engine_opts['afd_port'], which the cluster fills."""
    if topology.kind == "afd" and not topology.native_baseline and entry.role == "ffn":
        return ["afd"]
    return []


def serve_prefix(environ: dict | None = None) -> list[str]:
    """`$AFD_GPU_E2E_VLLM_BIN serve` when set, else this interpreter's vLLM CLI."""
    vllm_bin = settings.raw(VLLM_BIN_ENV, environ)
    if vllm_bin:
        return [vllm_bin, "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def _ranks(spec: ModelSpec, topology: Topology, role: str, entry: PlanEntry) -> int:
    if entry.role == role:
        return entry.dp * entry.tp
    g = topology.group(role)
    if g is None:
        raise ConfigError(f"AFD topology {topology.name!r} has no {role} role")
    return g.dp * g.tp * spec.tp


def _afd_port(entry: PlanEntry, ports: Ports, options: EngineOptions) -> int:
    own = ports.aux.get("afd")
    if options.opt("afd_port") is not None:
        if own is not None and own != options.opt("afd_port"):
            raise ConfigError(f"{entry.name}: aux afd port {own} differs from "
                              f"EngineOptions.engine_opts['afd_port'] {options.opt('afd_port')}")
        return options.opt("afd_port")
    if own is None:
        raise ConfigError(f"{entry.name}: no AFD connector port; the cluster must set "
                          "EngineOptions.engine_opts['afd_port'] to the FFN entry's aux 'afd' port")
    return own


def build(spec: ModelSpec, topology: Topology, entry: PlanEntry, ports: Ports,
          model_path: str, options: EngineOptions) -> WorkerCommand:
    if topology.kind != "afd":
        raise ConfigError(f"engines/afd builds AFD topologies, not {topology.kind!r}")
    if options.backend != "cuda":
        raise ConfigError("AFD (P2pNcclAFDConnector) runs on CUDA only; "
                          f"backend is {options.backend!r}")
    expected = ("worker",) if topology.native_baseline else ("attention", "ffn")
    if entry.role not in expected:
        raise ConfigError(f"AFD topology {topology.name!r} has no role {entry.role!r}")
    argv = serve_prefix() + [str(model_path), "--served-model-name", spec.id,
                             "--data-parallel-size", str(entry.dp),
                             "--tensor-parallel-size", str(entry.tp),
                             "--enable-expert-parallel"]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, entry.gpus)),
           "VLLM_USE_V2_MODEL_RUNNER": "0",
           "VLLM_PLUGINS": "" if topology.native_baseline else "afd",
           "VLLM_ENGINE_READY_TIMEOUT_S": ENGINE_READY_TIMEOUT_S,
           "PYTHONUNBUFFERED": "1",
           # /server_info: the resolved window the burst preflight reads (as engines/vllm.py)
           "VLLM_SERVER_DEV_MODE": "1"}
    afd_port = None
    if not topology.native_baseline:
        afd_port = _afd_port(entry, ports, options)
        cfg = {"afd": {"role": entry.role, "connector": CONNECTOR, "host": HOST,
                       "port": afd_port,
                       "num_attention_ranks": _ranks(spec, topology, "attention", entry),
                       "num_ffn_ranks": _ranks(spec, topology, "ffn", entry)}}
        argv += ["--additional-config", json.dumps(cfg, separators=(",", ":"))]
    argv += ["--enforce-eager", "--host", HOST, "--port", str(ports.api),
             "--gpu-memory-utilization", f"{entry.mem_fraction:g}"]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if options.max_num_seqs:
        argv += ["--max-num-seqs", str(options.max_num_seqs)]
    argv += list(spec.engine_args("vllm", entry.role)) + list(options.extra_args)
    if entry.role == "ffn":
        # Stage 0; "up" = its rank 0 listens on the rendezvous port (weights loaded). Its HTTP
        # API only answers after Attention has joined, so the gateway never sees it.
        return WorkerCommand(argv=argv, env=env, worker_type="none", unset_env=UNSET_ENV,
                             readiness=PortBound(afd_port) if afd_port else Alive(),
                             start_stage=0, owned_ports=tuple(
                                 afd_port + i for i in range(entry.dp * entry.tp + 1)))
    return WorkerCommand(argv=argv, env=env, readiness=HttpGet(ports.api, "/health"),
                         worker_type="regular", unset_env=UNSET_ENV,
                         start_stage=1 if entry.role == "attention" else 0)


# -- AFD: the FFN server really ran the FFN ----------------------------------------------------
#
# The afd-plugin exposes no Prometheus metric, counter or per-step log line on the FFN side
# (its FFN EngineCore runs a connector loop, no scheduler, so vLLM's own counters there stay at
# zero). The one per-step signal it has is its FFN profiler: afd_plugin/compat/profiler.py,
# configured by AFD_GPU_FFN_PROFILER_{ENABLE,WAIT,WARMUP,ACTIVE,REPEAT,SKIP_FIRST,DIR} and
# stepped at the top of every GPUFFNModelRunner.execute_model (afd_plugin/v1/worker/
# ffn_model_runner.py), which the FFN worker loop calls once per control-plane payload from
# Attention (afd_plugin/v1/worker/ffn_worker.py _run_ffn_server_loop), i.e. once per Attention
# forward step. With WAIT=every-2, WARMUP=1, ACTIVE=1, REPEAT=0 (unlimited) torch.profiler's
# TensorBoard handler writes one `<host>_<pid>.<ns>.pt.trace.json` per `every` FFN steps into
# DIR. The plugin's own GPU e2e test proves FFN execution the same way
# (tests/e2e/features/test_profiler_gpu.py: trace files must appear in the FFN dir).
# The cluster sets this env on every AFD FFN server (E2E_AFD_FFN_STEP_TRACE=0 turns it off).

FFN_STEP_TRACE_ENV = "E2E_AFD_FFN_STEP_TRACE"
FFN_PROFILER_PREFIX = "AFD_GPU_FFN_PROFILER"
FFN_TRACE_EVERY = 8
_TRACE_GLOB = "*.pt.trace.json*"


def ffn_step_trace_enabled(environ: dict | None = None) -> bool:
    return bool(settings.get(FFN_STEP_TRACE_ENV, environ))


def afd_ffn_step_env(trace_dir, every: int = FFN_TRACE_EVERY) -> dict[str, str]:
    """The FFN server's env for one profiler trace per `every` FFN steps into `trace_dir`."""
    if every < 2:
        raise ValueError("every must be >= 2 (one warmup + one active step per cycle)")
    p = FFN_PROFILER_PREFIX
    return {f"{p}_ENABLE": "1", f"{p}_WAIT": str(every - 2), f"{p}_WARMUP": "1",
            f"{p}_ACTIVE": "1", f"{p}_REPEAT": "0", f"{p}_SKIP_FIRST": "0",
            f"{p}_DIR": str(trace_dir)}


@dataclass
class FfnProof:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    trace_every: int
    traces_before: int
    traces_after: int
    new_traces_by_process: dict
    expected_min_new: int            # floor(steps / every) - 1 for these sequential requests
    kernel_events: int | None        # GPU kernels in the parsed new traces (None: none parsed)
    moe_kernel_events: int | None
    top_kernels: list
    attention_generation_tokens: float

    @property
    def new_traces(self) -> int:
        return self.traces_after - self.traces_before

    def to_dict(self) -> dict:
        return {**asdict(self), "new_traces": self.new_traces}


def _ffn_trace_dirs(cluster) -> list:
    return [Path(w.command.env[f"{FFN_PROFILER_PREFIX}_DIR"]) for w in cluster.role("ffn")
            if w.command.env.get(f"{FFN_PROFILER_PREFIX}_ENABLE") == "1"
            and w.command.env.get(f"{FFN_PROFILER_PREFIX}_DIR")]


def _traces(dirs) -> set:
    return {f for d in dirs if d.is_dir() for f in d.rglob(_TRACE_GLOB) if f.is_file()}


def _kernel_summary(files, limit: int = 3) -> tuple[int | None, int | None, list]:
    """Kernel events in (at most `limit` of) the new trace files: what the FFN GPU ran."""
    import gzip
    counts: dict[str, int] = {}
    parsed = 0
    for f in sorted(files, key=lambda p: p.stat().st_mtime)[:limit]:
        try:
            raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
            events = json.loads(raw).get("traceEvents", [])
        except (OSError, ValueError):
            continue        # still being written
        parsed += 1
        for e in events:
            if isinstance(e, dict) and e.get("cat") == "kernel":
                counts[e.get("name", "?")] = counts.get(e.get("name", "?"), 0) + 1
    if not parsed:
        return None, None, []
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
    moe = sum(v for k, v in counts.items() if "moe" in k.lower())
    return sum(counts.values()), moe, [[k[:80], v] for k, v in top]


def afd_ffn_served(cluster, n: int = 4, max_tokens: int = 16, settle_s: float = 10.0,
                   every: int | None = None) -> FfnProof:
    """n sequential completions through the gateway must make the FFN server(s) step: the
    plugin's FFN step traces (see above) must grow. Raises HarnessError otherwise."""
    name = cluster.topology.name
    if cluster.topology.kind != "afd" or cluster.topology.native_baseline:
        raise HarnessError(f"topology {name} has no AFD FFN server: the FFN proof does not "
                           "apply")
    ffn = cluster.role("ffn")
    if not ffn:
        raise HarnessError(f"topology {name}: no FFN worker")
    dirs = _ffn_trace_dirs(cluster)
    if not dirs:
        raise HarnessError(f"topology {name}: the FFN servers were started without the "
                           f"plugin's step traces ({FFN_STEP_TRACE_ENV}=0?): nothing to "
                           "measure")
    if every is None:
        env = ffn[0].command.env
        every = (int(env.get(f"{FFN_PROFILER_PREFIX}_WAIT", FFN_TRACE_EVERY - 2))
                 + int(env.get(f"{FFN_PROFILER_PREFIX}_WARMUP", 1))
                 + int(env.get(f"{FFN_PROFILER_PREFIX}_ACTIVE", 1)))
    attention = cluster.role("attention")
    b_att = scrape_all(attention)
    before = _traces(dirs)
    usages = post_all(cluster, "AFD FFN proof", "/v1/completions",
                       ({"model": cluster.model_name,
                         "prompt": long_unique_prompt(words=40, seed=i),
                         "max_tokens": max_tokens, "temperature": 0} for i in range(n)))
    prompt_tokens = sum(u.get("prompt_tokens", 0) for u in usages)
    completion_tokens = sum(u.get("completion_tokens", 0) for u in usages)
    # Sequential requests: each is one prefill step plus completion_tokens - 1 decode steps,
    # one FFN step each. A trace is saved when the step after its active step starts.
    expected = max(1, completion_tokens // every - 1)
    deadline = time.monotonic() + settle_s
    after = _traces(dirs)
    while len(after - before) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _traces(dirs)
    new = after - before
    by_proc: dict[str, int] = {}
    for f in new:
        base = Path(f).name.split(".pt.trace.json", 1)[0]   # <host>_<pid>.<ns>
        proc = base.rsplit(".", 1)[0]                        # <host>_<pid>
        by_proc[proc] = by_proc.get(proc, 0) + 1
    kernels, moe, top = _kernel_summary(new)
    a_att = scrape_all(attention)
    proof = FfnProof(
        requests=n, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        trace_every=every, traces_before=len(before), traces_after=len(before) + len(new),
        new_traces_by_process=by_proc, expected_min_new=expected, kernel_events=kernels,
        moe_kernel_events=moe, top_kernels=top,
        attention_generation_tokens=sum_delta(b_att, a_att, "vllm:generation_tokens_total"))
    problems = afd_trace_problems(proof)
    if problems:
        raise HarnessError(f"AFD FFN proof failed on {name}: {n} completions "
                           f"({completion_tokens} tokens) through the gateway: "
                           + "; ".join(problems) + f" (in {', '.join(map(str, dirs))}) "
                           f"({proof.to_dict()})")
    return proof


def afd_trace_problems(p: FfnProof) -> list[str]:
    """The FFN server(s) must have written the step traces that the requests' steps make:
    at least `expected_min_new` (floor(steps / every) - 1: the last one may not be saved yet),
    not merely one; and a parsed trace must hold GPU kernels (new traces none of which could be
    parsed: an error, not a pass). Pure (H200 record: 64 tokens, one trace every 8 steps: 8 new,
    7 required)."""
    out = []
    if p.completion_tokens <= 0:
        out.append("the requests generated no token: no FFN step to trace")
    if p.new_traces < p.expected_min_new or p.new_traces <= 0:
        out.append(f"{p.new_traces} new FFN step traces, {p.expected_min_new} expected for "
                   f"{p.completion_tokens} steps at one every {p.trace_every}")
    if p.kernel_events == 0:
        out.append("the new FFN traces hold no GPU kernel")
    elif p.kernel_events is None and p.new_traces > 0:   # the kernel check over nothing
        out.append(f"none of the {p.new_traces} new FFN traces could be read (the oldest "
                   "three tried): whether they hold GPU kernels is unknown")
    return out



# The record key of the AFD suite's comparison with the native baseline (router/test_afd.py).
NATIVE_COMPARISON_KEY = "afd_vs_native"


def native_comparison_lines(record: dict) -> list[str]:
    """The comparison with the native baseline a test record holds, for a report: the oracle's
    verdict in one line, or (result files from before the oracle) one line per baseline."""
    v = record.get(NATIVE_COMPARISON_KEY) or {}
    if "message" in v:
        return [verdict_line(v)]
    return [f"vs {name}: {c['same_text']}/{c['prompts']} identical outputs, "
            f"{c['same_first_token']}/{c['prompts']} same first token" for name, c in v.items()]


class AfdEngine(Engine):
    """AFD topologies of --engine vllm (the afd-plugin); attention and FFN never share a GPU."""
    idle_gauges = IDLE_GAUGES
    idle_skip_roles = IDLE_SKIP_ROLES
    name = "afd"
    runtime = "vllm"
    kinds = ("afd",)
    backends = ("cuda",)
    packable = False
    work_counters = VLLM_WORK_COUNTERS
    devices_env = "AFD_E2E_DEVICES"
    opt_in_flag = "AFD_E2E_LARGE_MODEL"
    opt_in_weights_env = "AFD_GPU_E2E_MODEL"
    settings_rows = (
        Setting("E2E_AFD_GSM8K_N", Int(1), 8, "GSM8K questions of the AFD suite"),
        Setting("E2E_AFD_GSM8K_MAX_TOKENS", Int(1), 128, "max tokens per GSM8K answer in the AFD suite"),
        Setting("E2E_AFD_FFN_STEP_TRACE", Bool(), True, "the afd-plugin per-step FFN trace on every FFN server (the FFN proof)"),
        Setting("AFD_E2E_BACKEND", Choice("gpu"), None, "AFD plugin backend; this harness runs the CUDA path only"),
        Setting("AFD_E2E_DEVICES", DeviceList(), None, "ordered GPU ids for AFD topologies (role order)"),
        Setting("AFD_E2E_LARGE_MODEL", Bool(), False, "the opt-in AFD large-model profile (an opt-in registry model needs it)"),
        Setting("AFD_GPU_E2E_MODEL", PathKind(must_be_dir=True), None, "weights folder of the AFD large model (used as its weights path)"),
        Setting("AFD_GPU_E2E_VLLM_BIN", Executable(), None, "`vllm` executable for AFD workers; unset: this interpreter's vLLM"),
    )

    def settings_problems(self, values, environ):
        devs = values.get("AFD_E2E_DEVICES")
        if not devs:
            return []
        try:
            check_gpu_ids(devs, "AFD_E2E_DEVICES", settings.raw("AFD_E2E_DEVICES", environ))
        except SettingError as e:
            return [e.summary]
        return []

    def profile_problems(self, values, environ, skip=()):
        if not values.get("AFD_E2E_LARGE_MODEL"):
            return []
        named = {e.split("=", 1)[0] for e in skip}
        problems = check_profile(profile_from_env(environ), need_devices=8, large_model=True)
        return [f"opt-in AFD large-model profile (AFD_E2E_LARGE_MODEL=1): {p}" for p in problems
                if p.split("=", 1)[0].split(" ", 1)[0] not in named]

    # The connector base port (P2pNcclAFDConnector rendezvous): `prepare` sets it, the FFN binds
    # it and attention connects to it (EngineOptions.engine_opts['afd_port']).
    option_defaults = {"afd_port": None}  # noqa: RUF012

    def aux_ports(self, topology, entry, options):
        return aux_ports(topology, entry, options)

    def fixed_ports(self, options):
        return {"afd": options.opt("afd_port")} if options.opt("afd_port") else {}

    def prepare(self, topology, spec, options, run_dir, allocate_block):
        if topology.native_baseline:
            return options
        # The FFN binds the connector port and the next num_ffn_ranks ports; attention
        # connects to the same base port.
        ffn = topology.group("ffn")
        return options.with_opts(afd_port=allocate_block(ffn.dp * ffn.tp * spec.tp + 1))

    def build(self, spec, topology, entry, ports, model_path, options):
        return build(spec, topology, entry, ports, model_path, options)

    def ffn_proof(self, cluster):
        return afd_ffn_served(cluster)

    def proof_line(self, key, proof):
        if key != "afd_ffn_proof":
            return None
        return (f"FFN proof: {proof.get('new_traces')} new FFN step traces for "
                f"{proof.get('requests')} requests ({proof.get('moe_kernel_events')} MoE kernel "
                "events)")

    def record_lines(self, record):
        return native_comparison_lines(record)

    def running_window(self, worker_url, timeout=5.0):
        return vllm.running_window(worker_url, timeout)     # the attention side is vLLM's

    def worker_command(self, spec, topology, entry, ports, model_path, options, run_dir):
        cmd = build(spec, topology, entry, ports, model_path, options)
        if entry.role == "ffn":
            if ffn_step_trace_enabled():   # the plugin's per-step FFN signal (ffn_proof)
                trace_dir = run_dir.resolve() / "afd-ffn-steps" / entry.name
                cmd = replace(cmd, env={**cmd.env, **afd_ffn_step_env(trace_dir)})
        return cmd


ENGINE = AfdEngine()


# -- the plugin's environment contract ---------------------------------------------------------

@dataclass(frozen=True)
class AfdProfile:
    backend: str | None             # AFD_E2E_BACKEND: gpu | npu
    devices_raw: str | None         # AFD_E2E_DEVICES as given
    devices: tuple[str, ...]        # parsed, in order (order assigns roles)
    model: str | None               # AFD_GPU_E2E_MODEL
    large_model: bool               # AFD_E2E_LARGE_MODEL (true/1/yes)
    vllm_bin: str | None            # AFD_GPU_E2E_VLLM_BIN (None: this interpreter's vLLM)


def profile_from_env(environ: dict | None = None) -> AfdProfile:
    """The variables as given (settings.py declares and validates them; this keeps the raw
    text so check_profile can name what it got)."""
    env = os.environ if environ is None else environ
    raw = settings.raw("AFD_E2E_DEVICES", env)
    devices = tuple(d.strip() for d in raw.split(",") if d.strip()) if raw else ()
    try:
        large = bool(settings.get("AFD_E2E_LARGE_MODEL", env))
    except settings.SettingError:
        large = False
    return AfdProfile(backend=settings.raw("AFD_E2E_BACKEND", env), devices_raw=raw,
                      devices=devices, model=settings.raw("AFD_GPU_E2E_MODEL", env),
                      large_model=large, vllm_bin=settings.raw(VLLM_BIN_ENV, env))


def check_profile(profile: AfdProfile, need_devices: int, *, large_model: bool = False,
                  find_spec=importlib.util.find_spec, which=shutil.which) -> list[str]:
    """One line per missing prerequisite; empty when the AFD run can start.

    `large_model`: the opt-in Qwen3.5-122B profile (AFD_E2E_LARGE_MODEL=1, exactly
    `need_devices` devices). `find_spec`/`which` are injectable for tests.
    """
    problems = []
    if profile.backend != "gpu":
        problems.append(f"AFD_E2E_BACKEND={profile.backend or ''!r}: this harness runs the "
                        "CUDA path only (set AFD_E2E_BACKEND=gpu)")
    if large_model and not profile.large_model:
        problems.append("AFD_E2E_LARGE_MODEL must be 1 for the large-model profile")
    if not profile.model:
        problems.append("AFD_GPU_E2E_MODEL is not set (a local model folder)")
    elif not Path(profile.model).expanduser().is_dir():
        problems.append(f"AFD_GPU_E2E_MODEL={profile.model}: no such directory")
    if not profile.devices:
        problems.append(f"AFD_E2E_DEVICES is not set (need {need_devices} unique device ids)")
    else:
        bad = [d for d in profile.devices if not d.isdigit()]
        dup = sorted({d for d in profile.devices if profile.devices.count(d) > 1})
        if bad:
            problems.append(f"AFD_E2E_DEVICES={profile.devices_raw}: not device ids: "
                            f"{', '.join(bad)}")
        if dup:
            problems.append(f"AFD_E2E_DEVICES={profile.devices_raw}: duplicate device(s) "
                            f"{', '.join(dup)}")
        n = len(profile.devices)
        if (n != need_devices) if large_model else (n < need_devices):
            want = "exactly" if large_model else "at least"
            problems.append(f"AFD_E2E_DEVICES={profile.devices_raw}: {n} device(s), "
                            f"need {want} {need_devices}")
    if find_spec("afd_plugin") is None:
        problems.append("afd_plugin is not importable (install vllm-afd-plugin)")
    if profile.vllm_bin:
        path = which(profile.vllm_bin)
        if not path:
            problems.append(f"AFD_GPU_E2E_VLLM_BIN={profile.vllm_bin}: not an executable")
    elif find_spec("vllm") is None:
        problems.append("vllm is not importable in this interpreter "
                        "(or set AFD_GPU_E2E_VLLM_BIN)")
    return problems
