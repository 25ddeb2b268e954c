"""AFD (vLLM + afd-plugin) command builder and env contract: exact argv and env per role."""

import json
import sys

import pytest

from e2e_test.infra.engines import EngineOptions, Ports, afd
from e2e_test.infra.errors import ConfigError
from e2e_test.infra.lifecycle.readiness import HttpGet, PortBound
from e2e_test.infra.specs.model_specs import get_spec
from e2e_test.infra.specs.plan import plan_gpu
from e2e_test.infra.specs.topology import parse

SPEC = get_spec("deepseek-ai/DeepSeek-V2-Lite")   # max_model_len 4096, fraction 0.85
CUDA = EngineOptions(backend="cuda")
SERVE = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
UNSET = ("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK",
         "AFD_FORCE_BALANCED_TOPK_IDS", "AFD_PLUGIN_EARLY_ENGINE_PATCH")


@pytest.fixture(autouse=True)
def _default_vllm(monkeypatch):
    monkeypatch.delenv("AFD_GPU_E2E_VLLM_BIN", raising=False)


def entries(topo: str):
    t = parse(topo)
    return t, {e.role: e for e in plan_gpu(t, SPEC, (0, 1, 2, 3)).entries}


def env(gpus: str, plugins: str = "afd") -> dict:
    return {"CUDA_VISIBLE_DEVICES": gpus, "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_PLUGINS": plugins, "VLLM_ENGINE_READY_TIMEOUT_S": "18000",
            "PYTHONUNBUFFERED": "1", "VLLM_SERVER_DEV_MODE": "1"}


def afd_config(role: str, port: int, a: int, f: int) -> str:
    return ('{"afd":{"role":"%s","connector":"P2pNcclAFDConnector","host":"127.0.0.1",'
            '"port":%d,"num_attention_ranks":%d,"num_ffn_ranks":%d}}' % (role, port, a, f))


TAIL = ["--gpu-memory-utilization", "0.85", "--max-model-len", "4096", "--trust-remote-code"]


def test_ffn():
    t, e = entries("2a1f")
    f = e["ffn"]
    assert afd.aux_ports(t, f, CUDA) == ["afd"]
    cmd = afd.build(SPEC, t, f, Ports(api=21001, aux={"afd": 21100}), "/models/ds", CUDA)
    assert cmd.argv == SERVE + [
        "/models/ds", "--served-model-name", "deepseek-ai/DeepSeek-V2-Lite",
        "--data-parallel-size", "1", "--tensor-parallel-size", "1", "--enable-expert-parallel",
        "--additional-config", afd_config("ffn", 21100, 2, 1),
        "--enforce-eager", "--host", "127.0.0.1", "--port", "21001"] + TAIL
    assert cmd.env == env("2")
    assert (cmd.protocol, cmd.health_path, cmd.worker_type) == ("http", None, "none")
    assert (cmd.unset_env, cmd.start_stage, cmd.readiness, cmd.owned_ports) == (
        UNSET, 0, PortBound(21100), (21100, 21101))


def test_attention():
    t, e = entries("2a1f")
    a = e["attention"]
    assert afd.aux_ports(t, a, CUDA) == []
    opts = EngineOptions(backend="cuda", max_num_seqs=8, engine_opts={"afd_port": 21100})
    cmd = afd.build(SPEC, t, a, Ports(api=21000), "/models/ds", opts)
    assert cmd.argv == SERVE + [
        "/models/ds", "--served-model-name", "deepseek-ai/DeepSeek-V2-Lite",
        "--data-parallel-size", "2", "--tensor-parallel-size", "1", "--enable-expert-parallel",
        "--additional-config", afd_config("attention", 21100, 2, 1),
        "--enforce-eager", "--host", "127.0.0.1", "--port", "21000",
        "--gpu-memory-utilization", "0.85", "--max-model-len", "4096",
        "--max-num-seqs", "8", "--trust-remote-code"]
    assert cmd.env == env("0,1")
    assert (cmd.protocol, cmd.health_path, cmd.worker_type) == ("http", "/health", "regular")
    assert (cmd.unset_env, cmd.start_stage, cmd.readiness, cmd.owned_ports) == (
        UNSET, 1, HttpGet(21000, "/health"), ())


def test_2a2f_rank_counts_and_shared_port():
    t, e = entries("2a2f")
    opts = EngineOptions(backend="cuda", engine_opts={"afd_port": 25000})
    f = afd.build(SPEC, t, e["ffn"], Ports(api=1, aux={"afd": 25000}), "/m", opts)
    a = afd.build(SPEC, t, e["attention"], Ports(api=2), "/m", opts)
    for cmd, role in ((f, "ffn"), (a, "attention")):
        cfg = json.loads(cmd.argv[cmd.argv.index("--additional-config") + 1])
        assert cfg == {"afd": {"role": role, "connector": "P2pNcclAFDConnector",
                               "host": "127.0.0.1", "port": 25000,
                               "num_attention_ranks": 2, "num_ffn_ranks": 2}}
    assert f.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert f.owned_ports == (25000, 25001, 25002)


def test_attention_without_port_is_an_error():
    t, e = entries("2a1f")
    with pytest.raises(ConfigError, match="afd_port"):
        afd.build(SPEC, t, e["attention"], Ports(api=1), "/m", CUDA)
    with pytest.raises(ConfigError, match="differs"):
        afd.build(SPEC, t, e["ffn"], Ports(api=1, aux={"afd": 5}), "/m",
                  EngineOptions(backend="cuda", engine_opts={"afd_port": 6}))


def test_native_baseline(monkeypatch):
    monkeypatch.setenv("AFD_GPU_E2E_VLLM_BIN", "/opt/vllm/bin/vllm")
    t, e = entries("native-dp4")
    w = e["worker"]
    assert afd.aux_ports(t, w, CUDA) == []
    cmd = afd.build(SPEC, t, w, Ports(api=22000), "/models/ds", CUDA)
    assert cmd.argv == ["/opt/vllm/bin/vllm", "serve",
                        "/models/ds", "--served-model-name", "deepseek-ai/DeepSeek-V2-Lite",
                        "--data-parallel-size", "4", "--tensor-parallel-size", "1",
                        "--enable-expert-parallel", "--enforce-eager",
                        "--host", "127.0.0.1", "--port", "22000"] + TAIL
    assert cmd.env == env("0,1,2,3", plugins="")
    assert (cmd.health_path, cmd.worker_type) == ("/health", "regular")
    assert (cmd.unset_env, cmd.start_stage, cmd.owned_ports) == (UNSET, 0, ())


def test_refuses_cpu_and_wrong_roles():
    t, e = entries("2a1f")
    with pytest.raises(ConfigError, match="CUDA only"):
        afd.build(SPEC, t, e["ffn"], Ports(api=1, aux={"afd": 2}), "/m", EngineOptions())
    tn, en = entries("native-dp4")
    with pytest.raises(ConfigError, match="no role 'worker'"):
        afd.build(SPEC, t, en["worker"], Ports(api=1), "/m", CUDA)


# -- env contract -------------------------------------------------------------------------------

def have(*names):
    return lambda name: object() if name in names else None


def test_profile_from_env():
    p = afd.profile_from_env({"AFD_E2E_BACKEND": "gpu", "AFD_E2E_DEVICES": "0, 2,4,6",
                              "AFD_GPU_E2E_MODEL": "/m", "AFD_E2E_LARGE_MODEL": "1",
                              "AFD_GPU_E2E_VLLM_BIN": "/bin/vllm"})
    assert p == afd.AfdProfile(backend="gpu", devices_raw="0, 2,4,6",
                               devices=("0", "2", "4", "6"), model="/m", large_model=True,
                               vllm_bin="/bin/vllm")
    empty = afd.profile_from_env({})
    assert (empty.backend, empty.devices, empty.model, empty.large_model, empty.vllm_bin) == (
        None, (), None, False, None)


def test_check_profile_ok(tmp_path):
    p = afd.profile_from_env({"AFD_E2E_BACKEND": "gpu", "AFD_E2E_DEVICES": "0,1,2",
                              "AFD_GPU_E2E_MODEL": str(tmp_path)})
    assert afd.check_profile(p, 3, find_spec=have("afd_plugin", "vllm")) == []


def test_check_profile_reports_every_problem(tmp_path):
    p = afd.profile_from_env({"AFD_E2E_BACKEND": "npu", "AFD_E2E_DEVICES": "0,1,1",
                              "AFD_GPU_E2E_MODEL": str(tmp_path / "missing"),
                              "AFD_GPU_E2E_VLLM_BIN": "/no/vllm"})
    lines = afd.check_profile(p, 4, find_spec=have(), which=lambda _: None)
    assert lines == [
        "AFD_E2E_BACKEND='npu': this harness runs the CUDA path only (set AFD_E2E_BACKEND=gpu)",
        f"AFD_GPU_E2E_MODEL={tmp_path / 'missing'}: no such directory",
        "AFD_E2E_DEVICES=0,1,1: duplicate device(s) 1",
        "AFD_E2E_DEVICES=0,1,1: 3 device(s), need at least 4",
        "afd_plugin is not importable (install vllm-afd-plugin)",
        "AFD_GPU_E2E_VLLM_BIN=/no/vllm: not an executable",
    ]


def test_check_profile_unset_and_large_model(tmp_path):
    lines = afd.check_profile(afd.profile_from_env({}), 8, large_model=True,
                              find_spec=have("afd_plugin"))
    assert lines == [
        "AFD_E2E_BACKEND='': this harness runs the CUDA path only (set AFD_E2E_BACKEND=gpu)",
        "AFD_E2E_LARGE_MODEL must be 1 for the large-model profile",
        "AFD_GPU_E2E_MODEL is not set (a local model folder)",
        "AFD_E2E_DEVICES is not set (need 8 unique device ids)",
        "vllm is not importable in this interpreter (or set AFD_GPU_E2E_VLLM_BIN)",
    ]
    # The large-model profile wants exactly the device count; ordinary runs accept more.
    p = afd.profile_from_env({"AFD_E2E_BACKEND": "gpu", "AFD_E2E_LARGE_MODEL": "1",
                              "AFD_GPU_E2E_MODEL": str(tmp_path),
                              "AFD_E2E_DEVICES": "0,1,2,3,4,5,6,7,8",
                              "AFD_GPU_E2E_VLLM_BIN": "vllm"})
    ok = dict(find_spec=have("afd_plugin"), which=lambda b: "/usr/bin/" + b)
    assert afd.check_profile(p, 8, large_model=True, **ok) == [
        "AFD_E2E_DEVICES=0,1,2,3,4,5,6,7,8: 9 device(s), need exactly 8"]
    assert afd.check_profile(p, 8, **ok) == []
