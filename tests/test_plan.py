"""The device planner: CPU core splits, GPU spread and packing, the device-list parser (the
device-list resolution, startup.py's, is tested in test_startup.py)."""

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs.model_specs import get_spec, parse_spec
from e2e_test.infra.specs.plan import make_plan, parse_device_list, plan_cpu, plan_gpu
from e2e_test.infra.specs.topology import parse
from e2e_test.infra.startup import resolve_devices

SMALL = get_spec("SmolLM2-135M-Instruct")        # gpu_memory_fraction 0.1
LLAMA = get_spec("meta-llama/Llama-3.1-8B-Instruct")  # 0.85


def by_name(plan):
    return {e.name: e for e in plan.entries}


def make_spec(tp=1, fraction=0.85):
    return parse_spec("org/m", {"weights": {"source": "path", "path": "/m"}, "tp": tp,
                                "gpu_memory_fraction": fraction})


# -- CPU --------------------------------------------------------------------------------------

def test_cpu_single_worker_gets_all_cores():
    plan = plan_cpu(parse("1"), (0, 1))
    assert plan.backend == "cpu" and plan.devices == () and not plan.packed
    (w,) = plan.entries
    assert (w.name, w.role, w.index, w.tp, w.dp, w.cores, w.gpus) == (
        "worker-0", "worker", 0, 1, 1, (0, 1), ())


def test_cpu_dp2_splits_cores():
    e = by_name(plan_cpu(parse("dp2"), (0, 1)))
    assert (e["worker-0"].cores, e["worker-1"].cores) == ((0,), (1,))


def test_cpu_pd_cores_are_disjoint():
    plan = plan_cpu(parse("1p1d"), (0, 1))
    p, d = plan.by_role("prefill"), plan.by_role("decode")
    assert [x.cores for x in p] == [(0,)] and [x.cores for x in d] == [(1,)]
    assert not set(p[0].cores) & set(d[0].cores)


def test_cpu_uneven_split_is_disjoint_and_complete():
    plan = plan_cpu(parse("1e1p1d"), (0, 1, 2, 3, 4, 5, 6))
    assert [e.cores for e in plan.entries] == [(0, 1, 2), (3, 4), (5, 6)]


def test_cpu_tp_role_gets_a_core_per_rank():
    """A tp=2 prefill gets two cores (one per rank); the spare cores are shared out evenly."""
    e = by_name(plan_cpu(parse("1p1d,p.tp=2"), (0, 1, 2)))
    assert (e["prefill-0"].tp, e["prefill-0"].cores, e["decode-0"].cores) == (2, (0, 1), (2,))
    e = by_name(plan_cpu(parse("1p1d,p.tp=2"), tuple(range(5))))
    assert (e["prefill-0"].cores, e["decode-0"].cores) == ((0, 1, 2), (3, 4))
    e = by_name(plan_cpu(parse("1p1d,d.tp=4"), tuple(range(6))))
    assert (e["prefill-0"].cores, e["decode-0"].cores) == ((0, 1), (2, 3, 4, 5))


def test_cpu_tp_role_on_too_few_cores_is_one_line():
    with pytest.raises(ConfigError) as ei:
        plan_cpu(parse("1p1d,p.tp=2"), (0, 1))
    assert str(ei.value) == ("topology '1p1d,p.tp=2' needs 3 cores, one per rank of each "
                             "worker (prefill-0 2, decode-0 1); only 2 core(s) available (0,1)")


def test_cpu_tp_worker_binds_one_core_list_per_rank():
    """vLLM on CPU binds rank r's OMP threads to the r-th `|`-separated list."""
    from e2e_test.infra.specs.devices import rank_core_lists
    assert rank_core_lists((0, 1), 2) == "0|1"
    assert rank_core_lists((0, 1, 2, 3, 4), 2) == "0-2|3-4"
    assert rank_core_lists((4, 5, 6), 1) == "4-6"
    with pytest.raises(ConfigError, match="2 ranks need a core each; got 1"):
        rank_core_lists((0,), 2)


def test_cpu_too_many_workers():
    with pytest.raises(ConfigError) as ei:
        plan_cpu(parse("2p1d"), (0, 1))
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg == ("topology '2p1d' needs 3 worker(s) with their own cores; only 2 core(s) "
                   "available (0,1)")


def test_make_plan_cpu_and_unknown_backend():
    assert make_plan(parse("dp2"), SMALL, "cpu", cores=(4, 5)).entries[1].cores == (5,)
    with pytest.raises(ConfigError, match="unknown backend 'rocm'"):
        make_plan(parse("1"), SMALL, "rocm")


# -- GPU: spread ------------------------------------------------------------------------------

def test_gpu_pd_spread_one_device_each():
    plan = plan_gpu(parse("1p1d"), SMALL, (0, 1))
    e = by_name(plan)
    assert e["prefill-0"].gpus == (0,) and e["decode-0"].gpus == (1,)
    assert e["prefill-0"].mem_fraction == 0.1
    assert not plan.packed and plan.devices == (0, 1) and plan.backend == "cuda"


def test_gpu_device_order_is_respected():
    e = by_name(plan_gpu(parse("1e1p1d"), SMALL, (7, 3, 5)))
    assert (e["encode-0"].gpus, e["prefill-0"].gpus, e["decode-0"].gpus) == ((7,), (3,), (5,))


def test_gpu_afd_device_order():
    spec = parse_spec("org/moe", {"weights": {"source": "path", "path": "/m"}, "tp": 1,
                                  "engines": ["vllm"], "topologies": ["afd"]})
    plan = plan_gpu(parse("4a4f"), spec, (0, 2, 4, 6, 1, 3, 5, 7))
    (att,), (ffn,) = plan.by_role("attention"), plan.by_role("ffn")
    assert att.gpus == (0, 2, 4, 6) and (att.dp, att.tp) == (4, 1)
    assert ffn.gpus == (1, 3, 5, 7) and (ffn.dp, ffn.tp) == (4, 1)
    assert not plan.packed


def test_gpu_engine_dp_takes_dp_devices():
    (w,) = plan_gpu(parse("dp2-engine"), LLAMA, (0, 1)).entries
    assert (w.gpus, w.dp, w.tp) == ((0, 1), 2, 1)


def test_gpu_spec_tp2_needs_two_devices_per_worker():
    spec = make_spec(tp=2)
    e = by_name(plan_gpu(parse("1p1d"), spec, (0, 1, 2, 3)))
    assert (e["prefill-0"].gpus, e["prefill-0"].tp) == ((0, 1), 2)
    assert (e["decode-0"].gpus, e["decode-0"].tp) == ((2, 3), 2)
    with pytest.raises(ConfigError, match="needs 4 GPU"):
        plan_gpu(parse("1p1d"), spec, (0, 1, 2))


def test_gpu_topology_tp_option():
    e = by_name(plan_gpu(parse("1p1d,p.tp=2"), LLAMA, (0, 1, 2)))
    assert (e["prefill-0"].gpus, e["prefill-0"].tp) == ((0, 1), 2)
    assert (e["decode-0"].gpus, e["decode-0"].tp) == ((2,), 1)


def test_gpu_extra_devices_unused():
    plan = plan_gpu(parse("1"), LLAMA, (3, 4, 5))
    assert plan.entries[0].gpus == (3,) and plan.devices == (3, 4, 5)


# -- GPU: packing -----------------------------------------------------------------------------

def test_gpu_dp2_packed_on_one_device():
    plan = plan_gpu(parse("dp2"), SMALL, (0,))
    assert [e.gpus for e in plan.entries] == [(0,), (0,)]
    assert [e.mem_fraction for e in plan.entries] == [0.1, 0.1]
    assert plan.packed
    assert plan.notes == ("2 device(s) wanted, 1 available: packed by memory fraction 0.1",)
    assert "(packed)" in plan.describe()


def test_gpu_epd_small_model_on_one_device():
    plan = plan_gpu(parse("1e1p1d"), SMALL, (0,))
    assert plan.packed and [e.gpus for e in plan.entries] == [(0,), (0,), (0,)]


def test_gpu_epd_small_model_on_two_devices():
    # Three workers, two devices: packed, each worker on the device with the most room
    # (the earlier one on a tie), so both devices are used.
    plan = plan_gpu(parse("1e1p1d"), SMALL, (0, 1))
    assert plan.packed
    assert [(e.role, e.gpus) for e in plan.entries] == [
        ("encode", (0,)), ("prefill", (1,)), ("decode", (0,))]


def test_gpu_packing_fills_to_exactly_one():
    spec = make_spec(fraction=0.25)
    plan = plan_gpu(parse("dp4"), spec, (0,))
    assert [e.gpus for e in plan.entries] == [(0,)] * 4
    with pytest.raises(ConfigError):
        plan_gpu(parse("dp5"), spec, (0,))


def test_gpu_packing_balances_devices():
    spec = make_spec(fraction=0.5)
    plan = plan_gpu(parse("dp3"), spec, (0, 1))
    assert [e.gpus for e in plan.entries] == [(0,), (1,), (0,)]
    plan = plan_gpu(parse("dp4"), spec, (5, 2))
    assert [e.gpus for e in plan.entries] == [(5,), (2,), (5,), (2,)]
    with pytest.raises(ConfigError, match="cannot hold it even packed"):
        plan_gpu(parse("dp5"), spec, (0, 1))


def test_gpu_packing_tp2_windows():
    spec = make_spec(tp=2, fraction=0.4)
    plan = plan_gpu(parse("1p1d"), spec, (0, 1))
    assert plan.packed
    assert [(e.gpus, e.tp) for e in plan.entries] == [((0, 1), 2), ((0, 1), 2)]
    plan = plan_gpu(parse("1e1p1d"), spec, (0, 1, 2, 3))
    assert [e.gpus for e in plan.entries] == [(0, 1), (2, 3), (0, 1)]
    # Device 1 would be in every window of 2 out of 3 devices: 3 x 0.4 does not fit.
    with pytest.raises(ConfigError, match="cannot hold it even packed"):
        plan_gpu(parse("1e1p1d"), spec, (0, 1, 2))


def test_gpu_cannot_pack():
    with pytest.raises(ConfigError) as ei:
        plan_gpu(parse("1p1d"), LLAMA, (0,))
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg == ("topology '1p1d' with model 'meta-llama/Llama-3.1-8B-Instruct' needs 2 "
                   "GPU(s) at memory fraction 0.85; 1 device(s) (0) cannot hold it even "
                   "packed")


def test_gpu_no_devices():
    with pytest.raises(ConfigError, match="needs GPUs but none were found"):
        plan_gpu(parse("1"), SMALL, ())


def test_gpu_duplicate_devices():
    with pytest.raises(ConfigError, match=r"device list 0,1,0: duplicate device\(s\) \[0\]"):
        plan_gpu(parse("1p1d"), SMALL, (0, 1, 0))


def test_plan_to_dict_and_describe():
    plan = plan_gpu(parse("1p1d"), SMALL, (0, 1))
    d = plan.to_dict()
    assert d["topology"] == "1p1d" and d["entries"][1]["gpus"] == (1,)
    text = plan.describe()
    assert text.splitlines()[0] == "plan 1p1d on cuda devices 0,1"
    assert "decode-0" in text and "gpu 1 mem 0.10" in text
    assert "cores 0" in plan_cpu(parse("1"), (0,)).describe()


def test_parse_device_list():
    assert parse_device_list("0, 2,4 ,6", "X") == (0, 2, 4, 6)
    assert parse_device_list("3,", "X") == (3,)


@pytest.mark.parametrize("text,expected", [
    ("0,1,0", "X='0,1,0': duplicate device(s) [0]"),
    ("1,1,2,2", "X='1,1,2,2': duplicate device(s) [1, 2]"),
    ("0,gpu1", "X='0,gpu1': device ids must be integers"),
    ("0.5", "X='0.5': device ids must be integers"),
    ("-1", "X='-1': device ids must be >= 0"),
    ("", "X: empty device list"),
    (" , ", "X: empty device list"),
])
def test_parse_device_list_errors(text, expected):
    with pytest.raises(ConfigError) as ei:
        parse_device_list(text, "X")
    assert str(ei.value) == expected


# -- pytest-xdist device leases -----------------------------------------------------------------

def test_xdist_share_partitions_devices():
    from e2e_test.infra.specs.plan import xdist_share
    devs = (0, 1, 2, 3, 4, 5, 6, 7)
    env = {"PYTEST_XDIST_WORKER_COUNT": "2"}
    assert xdist_share(devs, {**env, "PYTEST_XDIST_WORKER": "gw0"}) == (0, 2, 4, 6)
    assert xdist_share(devs, {**env, "PYTEST_XDIST_WORKER": "gw1"}) == (1, 3, 5, 7)
    assert xdist_share(devs, {}) == devs


def test_xdist_share_too_many_workers_is_one_line():
    from e2e_test.infra.specs.plan import xdist_share
    with pytest.raises(ConfigError) as ei:
        xdist_share((0, 1), {"PYTEST_XDIST_WORKER_COUNT": "3", "PYTEST_XDIST_WORKER": "gw2"})
    assert "\n" not in str(ei.value) and "-n 2" in str(ei.value)


def nvml_eight():
    return tuple(range(9))   # a machine whose NVML lists GPUs 0-8: given lists are checked


# -- the plans of the 4- and 8-GPU lanes (issues: EPD on TokenSpeed, AFD 2A2F, AFD 4A4F) ---------

@pytest.mark.parametrize("topo,expected", [
    ("1e1p1d", {"encode-0": (0,), "prefill-0": (1,), "decode-0": (2,)}),
    ("1e2p1d", {"encode-0": (0,), "prefill-0": (1,), "prefill-1": (2,), "decode-0": (3,)}),
    ("2e1p1d", {"encode-0": (0,), "encode-1": (1,), "prefill-0": (2,), "decode-0": (3,)}),
    ("1e1p2d", {"encode-0": (0,), "prefill-0": (1,), "decode-0": (2,), "decode-1": (3,)}),
])
def test_epd_lane_one_worker_per_gpu(topo, expected):
    spec = get_spec("Qwen/Qwen3.5-9B")            # 0.85 of a GPU each: never packed
    plan = make_plan(parse(topo), spec, "cuda", devices=(0, 1, 2, 3))
    assert {e.name: e.gpus for e in plan.entries} == expected and not plan.packed


def test_afd_2a2f_and_native_dp4_on_four_gpus_follow_afd_e2e_devices():
    spec = get_spec("deepseek-ai/DeepSeek-V2-Lite")
    env = {"AFD_E2E_DEVICES": "0,2,1,3"}
    devs = resolve_devices(parse("2a2f"), environ=env, inventory=nvml_eight)
    afd = make_plan(parse("2a2f"), spec, "cuda", devices=devs)
    assert {e.name: e.gpus for e in afd.entries} == {"attention-0": (0, 2), "ffn-0": (1, 3)}
    base = make_plan(parse("native-dp4"), spec, "cuda", devices=devs)
    assert [(e.name, e.gpus, e.dp) for e in base.entries] == [("worker-0", (0, 2, 1, 3), 4)]


def test_afd_large_profile_order_on_eight_gpus():
    spec = get_spec("Qwen/Qwen3.5-122B-A10B")
    devs = resolve_devices(parse("4a4f"), environ={"AFD_E2E_DEVICES": "0,2,4,6,1,3,5,7"},
                           inventory=nvml_eight)
    plan = make_plan(parse("4a4f"), spec, "cuda", devices=devs)
    assert {e.name: e.gpus for e in plan.entries} == {"attention-0": (0, 2, 4, 6),
                                                      "ffn-0": (1, 3, 5, 7)}
    base = make_plan(parse("native-dp4"), spec, "cuda", devices=devs[:4])
    assert base.entries[0].gpus == (0, 2, 4, 6)


# -- place(): the one placement check -----------------------------------------------------------

def test_place_refuses_packing_for_an_engine_that_cannot_share_a_gpu(fake_gpus):
    from e2e_test.infra.engines import afd
    from e2e_test.infra.specs.plan import TooFewDevices, place
    small = parse_spec("s", {"weights": {"source": "path", "path": "/m"}, "engines": ["vllm"],
                             "topologies": ["afd"], "gpu_memory_fraction": 0.3})
    with pytest.raises(TooFewDevices, match=r"'1a1f' \(afd\) needs 2 separate GPU\(s\)"):
        place(parse("1a1f"), small, "cuda", "0", afd.ENGINE)
    # Control: with two devices it is placed, one per role.
    plan = place(parse("1a1f"), small, "cuda", "0,1", afd.ENGINE)
    assert not plan.packed and [e.gpus for e in plan.entries] == [(0,), (1,)]


def test_place_gives_packed_workers_the_engines_start_stages(fake_gpus):
    from e2e_test.infra.engines import tokenspeed, vllm
    from e2e_test.infra.specs.plan import place
    small = parse_spec("s", {"weights": {"source": "path", "path": "/m"},
                             "engines": ["vllm", "tokenspeed"], "topologies": ["pd"],
                             "gpu_memory_fraction": 0.25})
    ts = place(parse("1p1d"), small, "cuda", "0", tokenspeed.ENGINE)
    assert [(e.start_stage, e.mem_fraction) for e in ts.entries] == [(0, 0.25), (1, 0.5)]
    # Control: vLLM workers packed the same way all start at once with their own share.
    v = place(parse("1p1d"), small, "cuda", "0", vllm.ENGINE)
    assert [(e.start_stage, e.mem_fraction) for e in v.entries] == [(0, 0.25), (0, 0.25)]
