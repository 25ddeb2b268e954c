"""TokenSpeed command builder: exact argv and env per role (no process is started)."""

import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from e2e_test.infra.engines import EngineOptions, Ports, tokenspeed
from e2e_test.infra.errors import ConfigError, HarnessError
from e2e_test.infra.specs.model_specs import get_spec, parse_spec
from e2e_test.infra.specs.plan import plan_gpu
from e2e_test.infra.specs.settings import options_from_env
from e2e_test.infra.specs.topology import parse

SPEC = get_spec("Qwen/Qwen3.5-9B")          # max_model_len 8192, memory fraction 0.85
# Built as TokenSpeed spawns its scheduler; the warm-spawn launcher is tested on its own below.
COLD = {"warm_spawn": False}
CUDA = EngineOptions(backend="cuda", engine_opts=COLD)
DEVICES = (4, 5, 6)


def entries(topo: str, spec=SPEC):
    t = parse(topo)
    return t, {e.role: e for e in plan_gpu(t, spec, DEVICES).entries}


def head(port: int, tp: int = 1) -> list[str]:
    return [sys.executable, "-m", "smg_grpc_servicer.tokenspeed",
            "--model", "/models/q", "--served-model-name", "Qwen/Qwen3.5-9B",
            "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp),
            "--log-level", "warning", "--enable-output-logprobs", "--gpu-memory-utilization", "0.85",
            "--disable-kvstore", "--max-model-len", "8192"]


# every worker: the Hopper kernel overrides, and Inductor compiling in the worker's own process
HOPPER = {**dict(tokenspeed.HOPPER_ENV), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
DISAGG_ENV = {"MC_INTRANODE_NVLINK": "1", "TOKENSPEED_SKIP_GRPC_WARMUP": "1",
              "NO_PROXY": "*", "no_proxy": "*", **HOPPER}
# The harness's defaults after the worker's own flags (serving_defaults): the greedy sampler, a
# host KV pool of 0.05 of the device's, and with CUDA graphs capture sizes up to 16 and no
# prefill graph.
EAGER_TAIL = ["--sampling-backend", "greedy", "--kvstore-ratio", "0.05"]
GRAPH_TAIL = EAGER_TAIL + ["--max-cudagraph-capture-size", "16", "--disable-prefill-graph"]


# The bundles' versions: 0.1.0's and 0.1.1's (scripts/stage_profiles/tokenspeed-0.1.*.lock).
V010 = {"tokenspeed": "0.1.0", "servicer": "0.7.0.post20260720"}
V011 = {"tokenspeed": "0.1.1", "servicer": "0.9.1.post20260920"}


@pytest.fixture(autouse=True)
def installed_0_1_0(monkeypatch):
    """Every build here sees TokenSpeed 0.1.0's bundle, whatever this environment holds."""
    monkeypatch.setattr(tokenspeed, "installed_versions", lambda: dict(V010))


def test_workarounds_by_version():
    """0.1.0's bundle needs every workaround; 0.1.1's not the EPD gateway's poll (servicer
    0.9.1 answers an encode worker's GetLoads), nor the host pool's ratio (no host pool with
    --disable-kvstore), nor going without a flush (its FlushCache clears); each by its own
    distribution's version, an unknown one needing all."""
    every = frozenset(tokenspeed.WORKAROUND_NAMES)
    assert tokenspeed.workarounds(**V010) == every
    assert tokenspeed.workarounds(None, None) == every
    assert tokenspeed.workarounds(**V011) == every - {"epd-gateway-no-load-poll",
                                                       "host-pool-ratio", "hybrid-boots-alone",
                                                       "kv-corrupt-no-flush"}
    # negative controls: each fix counts only in the distribution that carries it
    assert "epd-gateway-no-load-poll" in tokenspeed.workarounds("0.1.1", "0.7.0.post20260720")
    assert "epd-gateway-no-load-poll" in tokenspeed.workarounds("0.1.1", None)
    assert tokenspeed.workarounds("0.1.0", "0.9.1.post20260920") == every - {
        "epd-gateway-no-load-poll"}
    assert "host-pool-ratio" in tokenspeed.workarounds("0.0.9", "0.9.1")
    assert "host-pool-ratio" not in tokenspeed.workarounds("0.2.0", None)
    # still needed on 0.1.1: top-k refused, the decode's match at admission off, triton
    # samplers refused
    assert {"no-top-logprobs", "kv-corrupt-decode-uncached",
            "triton-sampler-graphs-refused"} <= tokenspeed.workarounds("9.9.9", "9.9.9")


@pytest.mark.parametrize("version,flag", [("0.1.0", "--no-enable-prefix-caching"),
                                          (None, "--no-enable-prefix-caching"),
                                          ("0.1.1", "--disable-prefix-caching")])
def test_the_flag_that_turns_prefix_caching_off_by_version(version, flag):
    """0.1.1 refuses 0.1.0's --no-enable-prefix-caching (argparse exit 2 at start)."""
    assert tokenspeed.no_prefix_cache_flag(version) == flag


@pytest.mark.parametrize("version,want", [("0.9.1.post20260920", (0, 9, 1)), ("0.1.1", (0, 1, 1)),
                                          ("0.1.10", (0, 1, 10)), (None, None), ("dev", None)])
def test_release(version, want):
    assert tokenspeed.release(version) == want


def test_the_workers_log_names_its_version_and_workarounds(monkeypatch):
    """One line per worker: the versions, which workarounds applied, which were not needed."""
    t, e = entries("1")
    ports = Ports(api=30000, aux={"dist_init": 30001})
    cmd = tokenspeed.build(SPEC, t, e["worker"], ports, "/models/q", CUDA)
    assert cmd.log_note == (
        "e2e: TokenSpeed 0.1.0 (servicer 0.7.0.post20260720): workarounds applied: "
        "epd-gateway-no-load-poll, host-pool-ratio, hybrid-boots-alone, no-top-logprobs, "
        "kv-corrupt-decode-uncached, kv-corrupt-no-flush, triton-sampler-graphs-refused; "
        "not needed: none")
    monkeypatch.setattr(tokenspeed, "installed_versions", lambda: dict(V011))
    cmd = tokenspeed.build(SPEC, t, e["worker"], ports, "/models/q", CUDA)
    assert cmd.log_note == (
        "e2e: TokenSpeed 0.1.1 (servicer 0.9.1.post20260920): workarounds applied: "
        "no-top-logprobs, kv-corrupt-decode-uncached, triton-sampler-graphs-refused; "
        "not needed: epd-gateway-no-load-poll, host-pool-ratio, hybrid-boots-alone, "
        "kv-corrupt-no-flush")
    assert "\n" not in cmd.log_note


def test_on_0_1_1_no_host_pool_ratio_and_an_epd_gateway_that_polls(monkeypatch):
    """0.1.1: the defaults leave --kvstore-ratio out (no host pool to bound) and an EPD gateway
    keeps smg's own policy and load monitor; 0.1.0's (the fixture) keep both."""
    t, e = entries("1")
    ports = Ports(api=30000, aux={"dist_init": 30001})
    assert "--kvstore-ratio" in tokenspeed.build(SPEC, t, e["worker"], ports, "/models/q",
                                                 CUDA).argv
    assert tokenspeed.ENGINE.gateway_args(parse("1e1p1d")) == tokenspeed.EPD_GATEWAY_ARGS
    monkeypatch.setattr(tokenspeed, "installed_versions", lambda: dict(V011))
    cmd = tokenspeed.build(SPEC, t, e["worker"], ports, "/models/q", CUDA)
    assert cmd.argv == (head(30000) + ["--dist-init-addr", "127.0.0.1:30001",
                                       "--sampling-backend", "greedy",
                                       "--max-cudagraph-capture-size", "16",
                                       "--disable-prefill-graph"])
    assert tokenspeed.ENGINE.gateway_args(parse("1e1p1d")) == ()
    # still refused on 0.1.1: a triton sampler with graphs
    t_, e_ = entries("1")
    with pytest.raises(ConfigError, match="stall the boot"):
        tokenspeed.build(SPEC, t_, e_["worker"], ports, "/models/q",
                         replace(CUDA, extra_args=("--sampling-backend", "triton")))


def test_regular():
    t, e = entries("1")
    # a dist-init port of the harness's own: without it TokenSpeed derives one from --port,
    # which another server of the session may hold (EADDRINUSE, a relaunch)
    assert tokenspeed.aux_ports(t, e["worker"], CUDA) == ["dist_init"]
    cmd = tokenspeed.build(SPEC, t, e["worker"], Ports(api=30000, aux={"dist_init": 30001}),
                           "/models/q", CUDA)
    assert cmd.argv == head(30000) + ["--dist-init-addr", "127.0.0.1:30001"] + GRAPH_TAIL
    # The servicer's 1-token gRPC warmup stays on: smg's first deep health probe must not be
    # the engine's first generation (it timed out at 5 s and smg waited 30 s to retry).
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "4", **HOPPER}
    # SIGKILL after 1.5 s: the servicer's own SIGTERM path ends in a SIGKILL of itself.
    assert cmd.stop_grace_s == 1.5
    assert (cmd.protocol, cmd.worker_type, cmd.bootstrap_port) == ("grpc", "regular", None)


def test_regular_small_window_eager_and_extra_args():
    t, e = entries("1")
    opts = EngineOptions(backend="cuda", engine_opts=COLD, max_num_seqs=4, enforce_eager=True,
                         extra_args=("--attention-backend", "fa3"))
    cmd = tokenspeed.build(SPEC, t, e["worker"], Ports(api=30000, aux={"dist_init": 30001}),
                           "/models/q", opts)
    assert cmd.argv == head(30000) + ["--max-num-seqs", "4", "--dist-init-addr",
                                      "127.0.0.1:30001", "--enforce-eager",
                                      "--attention-backend", "fa3"] + EAGER_TAIL


@pytest.mark.parametrize("sampler", [("--sampling-backend", "triton"),
                                     ("--sampling-backend=triton_full",)])
def test_graphs_with_a_triton_sampler_is_refused_before_any_process(sampler):
    """CUDA graphs and TokenSpeed 0.1.0's triton samplers: the capture compiles the generic
    Gumbel kernel and the boot stalls past its limit on an H200: one line, before
    anything starts, naming the worker, the sampler and the way out."""
    t, e = entries("1p1d")
    ports = Ports(api=32000, aux={"dist_init": 32001})
    with pytest.raises(ConfigError) as ei:
        tokenspeed.build(SPEC, t, e["decode"], ports, "/models/q",
                         EngineOptions(backend="cuda", engine_opts=COLD, extra_args=sampler))
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(f"TokenSpeed decode-0: CUDA graphs with --sampling-backend "
                          f"{sampler[-1].split('=')[-1]} stall the boot: ")
    assert "E2E_ENFORCE_EAGER=1" in msg
    # the negative controls: eager (by option, by flag), the always-eager prefill, another
    # sampler, and the default sampler are built
    for opts in (replace(CUDA, enforce_eager=True, extra_args=sampler),
                 replace(CUDA, extra_args=(*sampler, "--enforce-eager")),
                 replace(CUDA, extra_args=("--sampling-backend", "greedy")),
                 CUDA):
        assert tokenspeed.build(SPEC, t, e["decode"], ports, "/models/q", opts).argv
    assert tokenspeed.build(SPEC, t, e["prefill"],
                            Ports(api=1, aux={"bootstrap": 2, "dist_init": 3}), "/m",
                            EngineOptions(backend="cuda", engine_opts=COLD, extra_args=sampler)).argv


def test_serving_defaults_yield_to_what_the_worker_is_given():
    """Greedy sampler unless a sampler is named; with graphs, capture sizes up to 16 and no
    prefill graph unless the capture or the prefill graph is configured; eager (by option, by
    flag, the prefill role) gets no graph flags."""
    t, e = entries("1")
    ports = Ports(api=30000, aux={"dist_init": 30001})

    def tail(extra=(), **kw):
        argv = tokenspeed.build(SPEC, t, e["worker"], ports, "/m",
                                replace(CUDA, extra_args=extra, **kw)).argv
        return argv[argv.index("127.0.0.1:30001") + 1:]
    assert tail() == GRAPH_TAIL
    assert tail(enforce_eager=True) == ["--enforce-eager"] + EAGER_TAIL
    assert tail(("--enforce-eager",)) == ["--enforce-eager"] + EAGER_TAIL
    assert tail(("--sampling-backend=flashinfer",)) == ["--sampling-backend=flashinfer",
                                                        *GRAPH_TAIL[2:]]
    # the host pool: a ratio or a size of the worker's own wins (either spelling)
    assert tail(("--kvstore-ratio", "1.5")) == ["--kvstore-ratio", "1.5", *GRAPH_TAIL[:2],
                                                *GRAPH_TAIL[4:]]
    assert tail(("--kvstore-size=4",)) == ["--kvstore-size=4", *GRAPH_TAIL[:2], *GRAPH_TAIL[4:]]
    assert tail(("--cudagraph-capture-sizes", "1", "2")) == [
        "--cudagraph-capture-sizes", "1", "2", *EAGER_TAIL, "--disable-prefill-graph"]
    assert tail(("--prefill-graph-max-tokens", "512")) == [
        "--prefill-graph-max-tokens", "512", *GRAPH_TAIL[:6]]
    assert tail(("--max-cudagraph-capture-size=8", "--disable-prefill-graph")) == [
        "--max-cudagraph-capture-size=8", "--disable-prefill-graph", *EAGER_TAIL]


def test_engine_dp_needs_dist_init():
    t, e = entries("dp2-engine")
    w = e["worker"]
    assert tokenspeed.aux_ports(t, w, CUDA) == ["dist_init"]
    cmd = tokenspeed.build(SPEC, t, w, Ports(api=30000, aux={"dist_init": 30001}), "/models/q",
                           CUDA)
    assert cmd.argv == head(30000) + ["--data-parallel-size", "2",
                                      "--dist-init-addr", "127.0.0.1:30001"] + GRAPH_TAIL
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "4,5", **HOPPER}


def test_prefill():
    t, e = entries("1p1d")
    p = e["prefill"]
    assert tokenspeed.aux_ports(t, p, CUDA) == ["bootstrap", "dist_init"]
    cmd = tokenspeed.build(SPEC, t, p, Ports(api=31000, aux={"bootstrap": 31001,
                                                             "dist_init": 31002}),
                           "/models/q", CUDA)
    assert cmd.argv == head(31000) + [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "31001",
        "--disaggregation-transfer-backend", "mooncake", "--dist-init-addr", "127.0.0.1:31002",
        "--enable-prefix-caching", "--enforce-eager"] + EAGER_TAIL
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "4", **DISAGG_ENV}
    assert (cmd.protocol, cmd.worker_type, cmd.bootstrap_port) == ("grpc", "prefill", 31001)


def test_decode():
    t, e = entries("1p1d")
    d = e["decode"]
    assert tokenspeed.aux_ports(t, d, CUDA) == ["dist_init"]
    # enforce_eager from the options is added once, after the role flags.
    opts = EngineOptions(backend="cuda", engine_opts=COLD, enforce_eager=True)
    cmd = tokenspeed.build(SPEC, t, d, Ports(api=32000, aux={"dist_init": 32001}), "/models/q",
                           opts)
    assert cmd.argv == head(32000) + [
        "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", "mooncake", "--dist-init-addr", "127.0.0.1:32001",
        "--enable-prefix-caching", "--enforce-eager"] + EAGER_TAIL
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "5", **DISAGG_ENV}
    assert (cmd.worker_type, cmd.bootstrap_port) == ("decode", None)


def test_prefill_enforce_eager_not_repeated():
    t, e = entries("1p1d")
    cmd = tokenspeed.build(SPEC, t, e["prefill"],
                           Ports(api=1, aux={"bootstrap": 2, "dist_init": 3}), "/m",
                           EngineOptions(backend="cuda", engine_opts=COLD, enforce_eager=True))
    assert cmd.argv.count("--enforce-eager") == 1


def test_epd_encode_prefill_decode():
    t, e = entries("1e1p1d")
    enc = e["encode"]
    assert tokenspeed.aux_ports(t, enc, CUDA) == ["bootstrap", "dist_init"]
    cmd = tokenspeed.build(SPEC, t, enc, Ports(api=33000, aux={"bootstrap": 33001,
                                                               "dist_init": 33002}),
                           "/models/q", CUDA)
    assert cmd.argv == head(33000) + [
        "--disaggregation-mode", "encode", "--disaggregation-bootstrap-port", "33001",
        "--disaggregation-transfer-backend", "mooncake", "--dist-init-addr", "127.0.0.1:33002",
        ] + GRAPH_TAIL
    # No embedding cache on the encoder: every image runs the tower (EPD proof).
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "4", **DISAGG_ENV,
                       "TOKENSPEED_EPD_ENCODE_EMBED_CACHE_MB": "0"}
    assert (cmd.protocol, cmd.worker_type, cmd.bootstrap_port) == ("grpc", "encode", 33001)
    p = tokenspeed.build(SPEC, t, e["prefill"], Ports(api=1, aux={"bootstrap": 2,
                                                                  "dist_init": 3}), "/m", CUDA)
    d = tokenspeed.build(SPEC, t, e["decode"], Ports(api=4, aux={"dist_init": 5}), "/m", CUDA)
    assert (p.worker_type, p.bootstrap_port, p.env["CUDA_VISIBLE_DEVICES"]) == ("prefill", 2, "5")
    assert (d.worker_type, d.bootstrap_port, d.env["CUDA_VISIBLE_DEVICES"]) == ("decode", None, "6")


def test_spec_args_and_tp():
    spec = parse_spec("m", {"weights": {"source": "path", "path": "/m"}, "tp": 2,
                            "engines": ["tokenspeed"], "gpu_memory_fraction": 0.5,
                            "args": {"tokenspeed": ["--disaggregation-layerwise-interval", "0"]}})
    t = parse("1")
    w = plan_gpu(t, spec, (0, 1)).entries[0]
    cmd = tokenspeed.build(spec, t, w, Ports(api=7, aux={"dist_init": 8}), "/m", CUDA)
    assert cmd.argv[cmd.argv.index("--tensor-parallel-size") + 1] == "2"
    assert cmd.argv[cmd.argv.index("--gpu-memory-utilization") + 1] == "0.5"
    assert cmd.argv[-2 - len(GRAPH_TAIL):] == ["--disaggregation-layerwise-interval",
                                               "0"] + GRAPH_TAIL
    assert "--max-model-len" not in cmd.argv and "--max-total-tokens" not in cmd.argv
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1", **HOPPER}


def test_kv_budget_bounds_the_pool():
    """The registry's KV budget becomes the pool bound (--max-total-tokens); the default
    model has one: 131072 tokens."""
    spec = get_spec("SmolLM2-135M-Instruct")
    t, e = entries("1", spec)
    cmd = tokenspeed.build(spec, t, e["worker"], Ports(api=1, aux={"dist_init": 2}), "/m", CUDA)
    assert cmd.argv[cmd.argv.index("--max-total-tokens") + 1] == str(spec.kv_budget_tokens)
    assert spec.kv_budget_tokens == 131072 and "--disable-kvstore" in cmd.argv


def test_refuses_cpu_and_afd():
    t, e = entries("1")
    with pytest.raises(ConfigError, match="CUDA only"):
        tokenspeed.build(SPEC, t, e["worker"], Ports(api=1), "/m", EngineOptions())
    ta = parse("2a1f")
    with pytest.raises(ConfigError, match="not 'afd'"):
        tokenspeed.build(SPEC, ta, e["worker"], Ports(api=1), "/m", CUDA)


def test_metrics_dir_and_tcp_transport():
    # The servicer has no /metrics: --enable-metrics plus a multiprocess folder per worker.
    t, e = entries("1p1d")
    opts = EngineOptions(backend="cuda", state_dir="/r/state",
                         engine_opts={**COLD, "mooncake_transport": "tcp"})
    cmd = tokenspeed.build(SPEC, t, e["decode"], Ports(api=32000, aux={"dist_init": 32001}),
                           "/models/q", opts)
    assert cmd.argv[:len(head(32000)) + 1] == head(32000)[:-2] + [
        "--enable-metrics", "--max-model-len", "8192"]
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "5", "MC_FORCE_TCP": "1",
                       "MC_TCP_ENABLE_CONNECTION_POOL": "1",
                       "TOKENSPEED_SKIP_GRPC_WARMUP": "1", "NO_PROXY": "*", "no_proxy": "*",
                       "PROMETHEUS_MULTIPROC_DIR": "/r/state/prometheus/decode-0", **HOPPER}
    assert cmd.unset_env == ()
    nv = tokenspeed.build(SPEC, t, e["decode"], Ports(api=32000, aux={"dist_init": 32001}),
                          "/models/q", EngineOptions(backend="cuda", state_dir="/r/state",
                                                     engine_opts={**COLD}))
    # nvlink (the default): an inherited MC_FORCE_TCP, which Mooncake reads first, is dropped
    assert nv.env["MC_INTRANODE_NVLINK"] == "1" and nv.unset_env == ("MC_FORCE_TCP",)
    assert cmd.metrics_dir == "/r/state/prometheus/decode-0"
    with pytest.raises(ConfigError, match="mooncake transport 'rdma'"):
        tokenspeed.build(SPEC, t, e["decode"], Ports(api=1, aux={"dist_init": 2}), "/m",
                         EngineOptions(backend="cuda", engine_opts={**COLD, "mooncake_transport": "rdma"}))


def test_packed_schedule_is_cumulative_and_sequential():
    small = parse_spec("s", {"weights": {"source": "path", "path": "/m"},
                             "engines": ["tokenspeed"], "gpu_memory_fraction": 0.25})
    t = parse("1e1p1d")
    plan = plan_gpu(t, small, (3,))
    assert plan.packed and {en.gpus for en in plan.entries} == {(3,)}
    sched = tokenspeed.packed_schedule(plan.entries)
    fracs = [en.mem_fraction for en in plan.entries]
    assert [sched[en.name][0] for en in plan.entries] == [0, 1, 2]
    assert [sched[en.name][1] for en in plan.entries] == pytest.approx(
        [fracs[0], fracs[0] + fracs[1], sum(fracs)])
    # Alone on its GPU: not listed.
    assert tokenspeed.packed_schedule(plan_gpu(parse("1p1d"), small, (0, 1)).entries) == {}
    # The plan entry carries both: the share reaches the argv, the stage the command.
    en = replace(plan.entries[1], start_stage=1, mem_fraction=0.5)
    cmd = tokenspeed.build(small, t, en, Ports(api=1, aux={"bootstrap": 2, "dist_init": 3}),
                           "/m", EngineOptions(backend="cuda", engine_opts=COLD))
    assert cmd.argv[cmd.argv.index("--gpu-memory-utilization") + 1] == "0.5"
    assert cmd.start_stage == 1


def test_packed_schedule_starts_together_when_the_pool_is_bounded():
    """With a KV budget each worker holds far less than its fraction: the cumulative shares
    stay, and every worker starts at once (stage 0). Without one (above) they are staged."""
    capped = parse_spec("s", {"weights": {"source": "path", "path": "/m"},
                              "engines": ["tokenspeed"], "gpu_memory_fraction": 0.25,
                              "kv_budget_tokens": 4096})
    plan = plan_gpu(parse("1e1p1d"), capped, (3,))
    sched = tokenspeed.packed_schedule(plan.entries, capped)
    assert [sched[en.name] for en in plan.entries] == [(0, 0.25), (0, 0.5), (0, 0.75)]


def test_epd_gateway_runs_without_the_load_monitor():
    """smg's load monitor polls the encode group's GetLoads, which TokenSpeed 0.1.0's encode
    worker dies of: EPD gateways get no load-aware policy and no polling."""
    eng = tokenspeed.ENGINE
    args = eng.gateway_args(parse("1e1p1d"))
    assert "--disable-load-monitoring" in args and "--disable-worker-overload-protection" in args
    assert args[args.index("--policy") + 1] == "round_robin"
    assert eng.gateway_args(parse("1p1d")) == () and eng.gateway_args(parse("1")) == ()


def test_known_encode_crash_is_recognised():
    log = ("  File \".../tokenspeed/runtime/epd/encode_worker.py\", line 97, in submit\n"
           "AttributeError: 'GetLoadReqInput' object has no attribute 'request_id'\n")
    k = tokenspeed.ENGINE.known_crash("encode", log)
    assert k is not None and "encode_worker.py:97" in k.line()
    # Negative controls: another role, another error.
    assert tokenspeed.ENGINE.known_crash("prefill", log) is None
    assert tokenspeed.ENGINE.known_crash("encode", "CUDA error: out of memory") is None


def test_packed_schedule_refuses_overcommit():
    from e2e_test.infra.specs.plan import PlanEntry
    es = [PlanEntry(f"{r}-0", r, 0, 1, 1, gpus=(0,), mem_fraction=0.4)
          for r in ("encode", "prefill", "decode")]
    with pytest.raises(ConfigError, match="packed on GPU 0 need 1.20"):
        tokenspeed.packed_schedule(es)


def test_options_from_env():
    from e2e_test.infra.specs.settings import options_from_env
    o = options_from_env({"E2E_ENFORCE_EAGER": "1", "E2E_MOONCAKE_TRANSPORT": "tcp",
                          "E2E_ENGINE_ARGS": "--sampling-backend triton --x 'a b'"},
                         max_num_seqs=2)
    assert (o.enforce_eager, o.opt("mooncake_transport"), o.max_num_seqs) == (True, "tcp", 2)
    assert o.extra_args == ("--sampling-backend", "triton", "--x", "a b")
    d = options_from_env({})
    assert (d.enforce_eager, d.opt("mooncake_transport"), d.extra_args) == (False, "nvlink", ())


def test_dist_init_is_a_block_no_other_server_gets_a_port_of():
    """TokenSpeed binds the ports right above --dist-init-addr's (SGLang's PortArgs: +1 ...);
    a gateway handed dist_init + 1 fails its bind. The cluster allocates dist_init as a
    block: every port the session hands out after
    it (the gateway's, the next worker's) lies outside it."""
    from types import SimpleNamespace

    from e2e_test.infra.cluster.cluster import Cluster
    from e2e_test.infra.engines import for_topology
    from e2e_test.infra.lifecycle import ports
    from e2e_test.infra.lifecycle.launcher import LocalLauncher

    t, e = entries("1p1d")
    driver = for_topology("tokenspeed", t)
    span = driver.aux_port_span("dist_init", e["decode"])
    assert span >= 1 + tokenspeed.DIST_INIT_DERIVED + 1
    assert driver.aux_port_span("bootstrap", e["prefill"]) == 1
    me = SimpleNamespace(driver=driver, topology=t, options=CUDA, launcher=LocalLauncher(),
                         spec=SPEC, model_path="/models/q", dir=None)
    workers = [Cluster._make_worker(me, e[r]) for r in ("prefill", "decode")]
    later = set(ports.allocate(200))             # the gateway's and whatever comes after
    for w in workers:
        base = w.ports.aux["dist_init"]
        block = set(range(base, base + span))
        others = {w2.ports.api for w2 in workers} | {p for w2 in workers for n, p in
                                                      w2.ports.aux.items() if n != "dist_init"}
        assert not block & later and not block & others, (base, sorted(block & (later | others)))
        # what keeps them apart, deterministically: the whole block is handed out (before,
        # only the base port was, and dist_init + 1 could go to the gateway)
        assert block <= ports._handed_out, sorted(block - ports._handed_out)
        assert f"127.0.0.1:{base}" in w.command.argv


def test_a_regular_worker_gets_its_dist_init_block_too():
    """Without --dist-init-addr a regular worker binds its TCPStore near --port, a port the
    harness never reserved, which another topology booted together may hold (EADDRINUSE,
    a relaunch on the lane's critical path). The cluster reserves a block for it as for the
    PD roles."""
    from types import SimpleNamespace

    from e2e_test.infra.cluster.cluster import Cluster
    from e2e_test.infra.engines import for_topology
    from e2e_test.infra.lifecycle import ports
    from e2e_test.infra.lifecycle.launcher import LocalLauncher

    t, e = entries("1")
    driver = for_topology("tokenspeed", t)
    me = SimpleNamespace(driver=driver, topology=t, options=CUDA, launcher=LocalLauncher(),
                         spec=SPEC, model_path="/models/q", dir=None)
    w = Cluster._make_worker(me, e["worker"])
    base = w.ports.aux["dist_init"]
    span = driver.aux_port_span("dist_init", e["worker"])
    assert set(range(base, base + span)) <= ports._handed_out
    assert w.command.argv[w.command.argv.index("--dist-init-addr") + 1] == f"127.0.0.1:{base}"


def test_warm_spawn_wraps_a_single_scheduler_worker(monkeypatch):
    """By default a worker of tp 1, dp 1 runs the servicer through the warm-spawn launcher
    (launchers/e2e_warm_spawn.py): the servicer gets exactly the arguments it gets without it,
    the launcher folder goes ahead of the inherited PYTHONPATH (never instead of it), and the
    scheduler's module is preloaded with the two CUDA variables TokenSpeed sets first."""
    sys.path.insert(0, tokenspeed.LAUNCHERS)
    try:
        import e2e_warm_spawn
    finally:
        sys.path.remove(tokenspeed.LAUNCHERS)
    monkeypatch.setenv("PYTHONPATH", "/stage/site:/stage/other")
    warm = EngineOptions(backend="cuda")
    for topo, role, ports in (("1", "worker", Ports(api=1, aux={"dist_init": 2})),
                              ("1p1d", "decode", Ports(api=1, aux={"dist_init": 2})),
                              ("1p1d", "prefill", Ports(api=1, aux={"bootstrap": 3,
                                                                    "dist_init": 2}))):
        t, e = entries(topo)
        cold = tokenspeed.build(SPEC, t, e[role], ports, "/m", CUDA)
        cmd = tokenspeed.build(SPEC, t, e[role], ports, "/m", warm)
        assert cmd.argv[:3] == [sys.executable, "-m", "e2e_warm_spawn"]
        ns, rest, child_env = e2e_warm_spawn.parse(cmd.argv[3:])
        assert ns.run == "smg_grpc_servicer.tokenspeed" == cold.argv[2]
        assert rest == cold.argv[3:]
        assert ns.target == "tokenspeed.runtime.engine.event_loop:run_event_loop"
        assert ns.preload == ["tokenspeed.runtime.engine.event_loop"]
        assert child_env == {"CUDA_DEVICE_MAX_CONNECTIONS": "4", "CUDA_MODULE_LOADING": "AUTO",
                             "TF_CPP_MIN_LOG_LEVEL": "3", "NCCL_CUMEM_ENABLE": "0",
                             "NCCL_NVLS_ENABLE": "0", "TOKENSPEED_MAMBA_SSM_DTYPE": "float32"}
        assert ns.defaults == {"NVIDIA_TF32_OVERRIDE": "1", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1",
                               "TORCHINDUCTOR_ENABLE_PDL": "1", "TRTLLM_ENABLE_PDL": "1"}
        assert ns.collector_on is False            # its imports with the collector off
        assert ns.call == list(tokenspeed.WARM_CALLS)  # then the compilers' cache keys,
        assert not ns.calls_beside                     # before the request
        assert cmd.env == {**cold.env, "PYTHONPATH": os.pathsep.join(
            [tokenspeed.LAUNCHERS, "/stage/site", "/stage/other"])}
    # Each is MODULE:QUALNAME of a module the stage installs (triton comes with torch).
    assert all(":" in c and c.split(".")[0] in ("triton", "tokenspeed_triton", "torch")
               for c in tokenspeed.WARM_CALLS)
    # Nothing in the launcher folder shadows a package a worker imports.
    assert sorted(p.name for p in Path(tokenspeed.LAUNCHERS).glob("*.py")) == [
        "__init__.py", "e2e_warm_spawn.py"]


# The variables the warm scheduler's launcher line lists under "the parent's environment
# differs in" on an H200 when the warm interpreter does not get them from its start: what
# TokenSpeed's servicer sets before it starts its scheduler.
SEEN_DIFFERING_ON_H200 = {"NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NVIDIA_TF32_OVERRIDE",
                          "TF_CPP_MIN_LOG_LEVEL", "TOKENSPEED_MAMBA_SSM_DTYPE",
                          "TORCHINDUCTOR_ENABLE_PDL", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
                          "TRTLLM_ENABLE_PDL"}


def test_spawn_env_follows_the_servicers_arguments():
    """What TokenSpeed sets before it starts its scheduler, from the arguments it was given:
    the defaults cover every variable seen differing on the H200 (plus the two CUDA ones it
    always set); --enable-symm-mem, --enable-nccl-nvls, --mamba-ssm-dtype, --disable-tf32 and
    --disable-pdl change it as TokenSpeed's own code does."""
    env, default = tokenspeed.spawn_env([])
    assert set(env) | set(default) == SEEN_DIFFERING_ON_H200 | {
        "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING"}
    assert default["TORCHINDUCTOR_ENABLE_PDL"] == "1" and env["NCCL_CUMEM_ENABLE"] == "0"
    env, default = tokenspeed.spawn_env(["--enable-symm-mem", "--mamba-ssm-dtype", "bfloat16",
                                         "--disable-tf32", "--disable-pdl"])
    assert env["NCCL_CUMEM_ENABLE"] == "1" and "NCCL_NVLS_ENABLE" not in env
    assert env["TOKENSPEED_MAMBA_SSM_DTYPE"] == "bfloat16" and default == {}
    env, _ = tokenspeed.spawn_env(["--enable-nccl-nvls"])
    assert env["NCCL_NVLS_ENABLE"] == "1"


def test_spawn_env_of_0_1_1_sets_the_nccl_variables_only_when_disabled():
    """0.1.1 sets NCCL_CUMEM_ENABLE / NCCL_NVLS_ENABLE to 0 only for --disable-symm-mem /
    --disable-nccl-nvls; 0.1.0's values would differ from its servicer's at the request."""
    env, default = tokenspeed.spawn_env([], "0.1.1")
    assert "NCCL_CUMEM_ENABLE" not in env and "NCCL_NVLS_ENABLE" not in env
    assert env["TOKENSPEED_MAMBA_SSM_DTYPE"] == "float32"
    assert default == tokenspeed.spawn_env([], "0.1.0")[1]
    env, _ = tokenspeed.spawn_env(["--disable-symm-mem", "--disable-nccl-nvls"], "0.1.1")
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    # negative control: 0.1.0 (and an unknown version) set both from their own flags
    assert tokenspeed.spawn_env([], "0.1.0")[0]["NCCL_CUMEM_ENABLE"] == "0"
    assert tokenspeed.spawn_env([], None)[0]["NCCL_NVLS_ENABLE"] == "0"


def test_warm_spawn_not_for_several_schedulers_nor_when_off():
    """tp > 1 or dp > 1 starts several scheduler processes (or a DP controller): as
    TokenSpeed spawns them. E2E_TOKENSPEED_WARM_SPAWN=0 turns it off."""
    warm = EngineOptions(backend="cuda")
    t, e = entries("dp2-engine")
    cmd = tokenspeed.build(SPEC, t, e["worker"], Ports(api=1, aux={"dist_init": 2}), "/m", warm)
    assert cmd.argv[1:3] == ["-m", "smg_grpc_servicer.tokenspeed"] and "PYTHONPATH" not in cmd.env
    spec = parse_spec("m", {"weights": {"source": "path", "path": "/m"}, "tp": 2,
                            "engines": ["tokenspeed"], "gpu_memory_fraction": 0.5})
    t = parse("1")
    w = plan_gpu(t, spec, (0, 1)).entries[0]
    cmd = tokenspeed.build(spec, t, w, Ports(api=7, aux={"dist_init": 8}), "/m", warm)
    assert cmd.argv[1:3] == ["-m", "smg_grpc_servicer.tokenspeed"]
    off = options_from_env({"E2E_TOKENSPEED_WARM_SPAWN": "0"}, backend="cuda")
    t, e = entries("1")
    cmd = tokenspeed.build(SPEC, t, e["worker"], Ports(api=1, aux={"dist_init": 2}), "/m", off)
    assert cmd.argv[1:3] == ["-m", "smg_grpc_servicer.tokenspeed"]
    assert options_from_env({}, backend="cuda").opt("warm_spawn") is True


def test_kv_corrupt_patches_the_decodes_scheduler_through_the_warm_spawn():
    """The `kv_corrupt` profile (engine option kv_corrupt=runtime): the decode's waiting
    scheduler interpreter preloads engines/kv_corrupt_tokenspeed.py after the scheduler's own
    module, with the setting and its control folder in the worker's environment; the prefill
    gets neither. Without the warm spawn, a state folder, or with a bad kind: refused before
    anything starts."""
    sys.path.insert(0, tokenspeed.LAUNCHERS)
    try:
        import e2e_warm_spawn
    finally:
        sys.path.remove(tokenspeed.LAUNCHERS)
    from types import SimpleNamespace

    from e2e_test.infra.engines import kv_corrupt_tokenspeed as kt
    t, e = entries("1p1d")
    opts = EngineOptions(backend="cuda", state_dir="/s", engine_opts={"kv_corrupt": "runtime"})
    ports = Ports(api=1, aux={"bootstrap": 3, "dist_init": 2})
    dec = tokenspeed.build(SPEC, t, e["decode"], ports, "/m", opts)
    ns, rest, _ = e2e_warm_spawn.parse(dec.argv[3:])
    assert ns.preload == ["tokenspeed.runtime.engine.event_loop", kt.MODULE]
    # it matches no prefix at admission (it asks for every page): prefix caching is on by
    # default in TokenSpeed's ServerArgs, so it is turned off by name; the prefill caches
    assert "--enable-prefix-caching" not in rest and "--no-enable-prefix-caching" in rest
    assert dec.env[kt.ENV_SETTING] == "runtime"
    assert dec.env[kt.ENV_DIR] == "/s/kv-corrupt/decode-0"
    pre = tokenspeed.build(SPEC, t, e["prefill"], ports, "/m", opts)
    ns, rest, _ = e2e_warm_spawn.parse(pre.argv[3:])
    assert ns.preload == ["tokenspeed.runtime.engine.event_loop"]
    assert "--enable-prefix-caching" in rest
    assert kt.ENV_SETTING not in pre.env and kt.ENV_DIR not in pre.env
    # the negative controls: nothing asked, nothing loaded
    plain = tokenspeed.build(SPEC, t, e["decode"], ports, "/m", EngineOptions(backend="cuda"))
    assert kt.MODULE not in plain.argv and kt.ENV_SETTING not in plain.env
    assert "--enable-prefix-caching" in plain.argv
    # forget_received_kv: nothing to drop where the decode caches nothing; refused otherwise
    def cluster(decode_cmd):
        return SimpleNamespace(name="ts-1p1d", workers=[
            SimpleNamespace(name="prefill-0", entry=e["prefill"], command=pre),
            SimpleNamespace(name="decode-0", entry=e["decode"], command=decode_cmd)])
    tokenspeed.ENGINE.forget_received_kv(cluster(dec))
    with pytest.raises(HarnessError, match="decode-0 caches the KV it receives"):
        tokenspeed.ENGINE.forget_received_kv(cluster(plain))
    # a decode that only leaves --enable-prefix-caching out still caches (TokenSpeed's default)
    silent = SimpleNamespace(argv=[a for a in plain.argv if a != "--enable-prefix-caching"])
    with pytest.raises(HarnessError, match="decode-0 caches the KV it receives"):
        tokenspeed.ENGINE.forget_received_kv(cluster(silent))
    for bad, why in (({"kv_corrupt": "runtime", "warm_spawn": False}, "needs the warm spawn"),
                     ({"kv_corrupt": "zero"}, "unknown KV corruption kind")):
        with pytest.raises(ConfigError, match=why):
            tokenspeed.build(SPEC, t, e["decode"], ports, "/m",
                             EngineOptions(backend="cuda", state_dir="/s", engine_opts=bad))
    with pytest.raises(ConfigError, match="needs a state folder"):
        tokenspeed.build(SPEC, t, e["decode"], ports, "/m",
                         EngineOptions(backend="cuda", engine_opts={"kv_corrupt": "runtime"}))


def _kv_cluster(decode_argv):
    from types import SimpleNamespace
    t, e = entries("1p1d")
    ports = Ports(api=1, aux={"bootstrap": 3, "dist_init": 2})
    pre = tokenspeed.build(SPEC, t, e["prefill"], ports, "/m", CUDA)
    return SimpleNamespace(name="ts-1p1d", workers=[
        SimpleNamespace(name="prefill-0", entry=e["prefill"], command=pre,
                        ports=Ports(api=31000)),
        SimpleNamespace(name="decode-0", entry=e["decode"], ports=Ports(api=31002),
                        command=SimpleNamespace(argv=decode_argv))])


@pytest.mark.parametrize("versions,flushed", [(V011, ["prefill-0", "decode-0"]),
                                              (V010, []), ({"tokenspeed": None,
                                                           "servicer": None}, [])])
def test_kv_cases_flush_every_worker_where_flushcache_clears(monkeypatch, versions, flushed):
    """From 0.1.1 (FlushCache clears; its decode points a request at pages an earlier one
    received for the same tokens) forget_received_kv flushes every worker by its own port;
    0.1.0 and an unknown release flush none. A decode that would match a prefix at admission
    is refused first, on every release."""
    calls = []
    monkeypatch.setattr(tokenspeed, "installed_versions", lambda: dict(versions))
    monkeypatch.setattr(tokenspeed, "flush_cache",
                        lambda host, port, who: calls.append((host, port, who)))
    tokenspeed.ENGINE.forget_received_kv(_kv_cluster(["--disable-prefix-caching"]))
    assert [c[2] for c in calls] == [f"ts-1p1d: {n}" for n in flushed]
    assert [c[1] for c in calls] == [{"prefill-0": 31000, "decode-0": 31002}[n]
                                     for n in flushed]
    assert all(c[0] == "127.0.0.1" for c in calls)
    calls.clear()
    with pytest.raises(HarnessError, match="decode-0 caches the KV it receives"):
        tokenspeed.ENGINE.forget_received_kv(_kv_cluster(["--enable-prefix-caching"]))
    assert calls == []


def _fake_flush_stubs(monkeypatch, answers):
    """smg_grpc_proto's two modules that flush_cache imports, their stub answering
    FlushCache from `answers` ((success, message), in turn); returns the calls."""
    import types
    calls = []

    class Stub:
        def __init__(self, channel):
            pass

        def FlushCache(self, request, timeout):
            calls.append(timeout)
            ok, msg = answers[min(len(calls), len(answers)) - 1]
            return types.SimpleNamespace(success=ok, message=msg)

    common = types.ModuleType("common_pb2")
    common.FlushCacheRequest = lambda: object()
    grpc_mod = types.ModuleType("tokenspeed_scheduler_pb2_grpc")
    grpc_mod.TokenSpeedSchedulerStub = Stub
    gen = types.ModuleType("smg_grpc_proto.generated")
    gen.common_pb2, gen.tokenspeed_scheduler_pb2_grpc = common, grpc_mod
    top = types.ModuleType("smg_grpc_proto")
    top.generated = gen
    for name, mod in (("smg_grpc_proto", top), ("smg_grpc_proto.generated", gen),
                      ("smg_grpc_proto.generated.common_pb2", common),
                      ("smg_grpc_proto.generated.tokenspeed_scheduler_pb2_grpc", grpc_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(tokenspeed, "FLUSH_WAIT_S", 0.0)
    return calls


def test_flush_cache_waits_out_a_busy_worker_and_fails_in_one_line(monkeypatch):
    """FlushCache refuses while requests run: flush_cache asks again until it succeeds, and
    after FLUSH_TRIES refusals raises one line with the worker and its last answer."""
    pytest.importorskip("grpc")
    busy = (False, "Cache flush failed")
    calls = _fake_flush_stubs(monkeypatch, [busy, busy, (True, "Cache flushed successfully")])
    tokenspeed.flush_cache("127.0.0.1", 1, "ts-1p1d: decode-0")
    assert len(calls) == 3
    calls = _fake_flush_stubs(monkeypatch, [busy])
    with pytest.raises(HarnessError) as e:
        tokenspeed.flush_cache("127.0.0.1", 1, "ts-1p1d: decode-0")
    assert len(calls) == tokenspeed.FLUSH_TRIES
    assert str(e.value).startswith("ts-1p1d: decode-0: FlushCache answered no success")
    assert "'Cache flush failed'" in str(e.value) and "\n" not in str(e.value)


# Each staged release's flags, read from its wheel (scripts/engine_flags.py; device_session.py
# prepare re-reads the wheel and refuses a file that drifted).
_STAGE = Path(__file__).resolve().parents[1] / "scripts"
_ef_spec = importlib.util.spec_from_file_location("engine_flags", _STAGE / "engine_flags.py")
engine_flags = importlib.util.module_from_spec(_ef_spec)
_ef_spec.loader.exec_module(engine_flags)
FLAGS = {v["tokenspeed"]: json.loads((_STAGE / "stage_profiles" /
                                      f"tokenspeed-{v['tokenspeed']}.flags.json").read_text())["flags"]
         for v in (V010, V011)}


def _servicer_args(argv: list[str]) -> list[str]:
    """The arguments the servicer's parser reads: after `-m SERVICER_MODULE`, or after the
    warm-spawn launcher's `--`."""
    return argv[argv.index("--") + 1:] if "--" in argv else argv[3:]


def _lane_commands():
    """Every worker argv the GPU lanes build: the default model on 1, dp2 and 1p1d (graphs and
    eager, warm spawn on and off, the kv_corrupt decode), the tiny VLM on 1e1p1d."""
    small = get_spec("SmolLM2-135M-Instruct")
    vlm = get_spec("tiny-random/Qwen3.5-VL")
    ports = Ports(api=1, aux={"bootstrap": 3, "dist_init": 2})
    for spec, topo in ((small, "1"), (small, "dp2"), (small, "1p1d"), (vlm, "1e1p1d"), (vlm, "1")):
        t = parse(topo)
        for entry in plan_gpu(t, spec, (0,)).entries:
            for warm in (True, False):
                for eager in (True, False):
                    opts = EngineOptions(backend="cuda", enforce_eager=eager, state_dir="/s",
                                         engine_opts={"warm_spawn": warm})
                    yield f"{topo}/{entry.name}", tokenspeed.build(spec, t, entry, ports, "/m", opts)
            if entry.role == "decode":
                opts = EngineOptions(backend="cuda", state_dir="/s",
                                     engine_opts={"kv_corrupt": "runtime"})
                yield f"{topo}/{entry.name}/kv_corrupt", tokenspeed.build(spec, t, entry, ports,
                                                                         "/m", opts)


@pytest.mark.parametrize("versions", [V010, V011], ids=["0.1.0", "0.1.1"])
def test_every_lane_argv_parses_on_the_staged_release(monkeypatch, versions):
    """Each release refuses a flag it does not declare (argparse, allow_abbrev off: exit 2 at
    the worker's start on the device, as 0.1.1 did with --skip-server-warmup and 0.1.0's
    --no-enable-prefix-caching). Every argv the lanes build is checked here against the flags of
    the release it is built for, values against literal choices."""
    refused = engine_flags.refused
    monkeypatch.setattr(tokenspeed, "installed_versions", lambda: dict(versions))
    flags = FLAGS[versions["tokenspeed"]]
    seen = 0
    for name, cmd in _lane_commands():
        assert refused(_servicer_args(cmd.argv), flags) == [], name
        seen += 1
    assert seen >= 20
    # negative controls: each flag 0.1.1 refused on an H100, and a choice it does not offer
    assert refused(["--skip-server-warmup"], FLAGS["0.1.1"]) == [
        "--skip-server-warmup: no such flag"]
    assert refused(["--no-enable-prefix-caching"], FLAGS["0.1.1"]) == [
        "--no-enable-prefix-caching: no such flag"]
    assert refused(["--skip-server-warmup", "--no-enable-prefix-caching"], FLAGS["0.1.0"]) == []
    assert refused(["--disaggregation-mode", "encoder"], flags) == [
        "--disaggregation-mode encoder: not one of null, prefill, decode, encode"]
    assert refused(["--port"], flags) == ["--port: no value"]
