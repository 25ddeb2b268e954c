"""The device-aware assignment (e2e_test/infra/specs/coboot.py): how many of a session's
topologies run at once (pytest-xdist workers), from their plans, the backend, the GPUs' free
memory and the cores. Pure: real plans of the default model, no engine starts."""

from dataclasses import replace

import pytest

from e2e_test.infra.engines import for_topology
from e2e_test.infra.specs import coboot
from e2e_test.infra.specs import plan as planner
from e2e_test.infra.specs import topology as topologies
from e2e_test.infra.specs.model_specs import DEFAULT_MODEL, get_spec

SPEC = get_spec(DEFAULT_MODEL)


def placed(name: str, backend: str = "cuda", devices=(0,), engine: str = "vllm"):
    topo = topologies.parse(name)
    return planner.place(topo, SPEC, backend, devices if backend == "cuda" else (0, 1),
                         for_topology(engine, topo))


def with_fraction(plan, frac: float):
    return replace(plan, entries=tuple(replace(e, mem_fraction=frac) for e in plan.entries))


# The e2e-1gpu-pd lane on one H200: `1`, 1p1d and the window profile's 1p1d.
ONE, PD = ("vllm", "1"), ("vllm", "1p1d")
WINDOW = ("vllm", "1p1d", "window")


def pd_lane(frac: float | None = None):
    plans = [(ONE, placed("1")), (PD, placed("1p1d")), (WINDOW, placed("1p1d"))]
    return [(k, with_fraction(p, frac) if frac else p) for k, p in plans]


def test_the_cpu_lane_runs_one_topology_at_a_time_and_says_why():
    keyed = [(ONE, placed("1", "cpu")), (("vllm", "dp2"), placed("dp2", "cpu")),
             (PD, placed("1p1d", "cpu"))]
    a = coboot.assign(keyed, "cpu", None, cores=2)
    assert a.workers == 1 and a.shares == {}
    assert "backend cpu" in a.reason and "68-74 %" in a.reason


def test_the_registry_fractions_run_four_pd_lane_topologies_at_once_on_an_h200():
    """SmolLM2 takes 0.1 of a GPU per worker (its KV pinned by kv_budget_tokens): the largest
    topology (1p1d, 0.2) fits four times under 0.9, and 16 cores boot four 2-worker topologies
    at once (the lane's `1`, 1p1d and window 1p1d, and a disposable one, all up together)."""
    a = coboot.assign(pd_lane(), "cuda", {0: 1.0}, cores=16)
    assert a.workers == 4 and a.shares == {0: 0.8}
    assert a.reason.startswith("4 topologies at once: the largest takes GPU 0 0.20")


def test_larger_shares_fewer_workers():
    """At 0.2 a worker (1p1d 0.4): two fit under 0.9."""
    a = coboot.assign(pd_lane(0.2), "cuda", {0: 1.0}, cores=16)
    assert a.workers == 2 and a.shares == {0: 0.8}


def test_memory_held_by_others_keeps_them_apart():
    a = coboot.assign(pd_lane(0.2), "cuda", {0: 0.5}, cores=16)
    assert a.workers == 1 and a.shares == {}
    assert a.reason.startswith("one topology at a time") and "GPU 0 0.50 free" in a.reason


def test_too_few_cores_keep_boots_apart():
    """A 2-worker topology at 2 cores a booting worker needs 4 cores; 4 cores run one."""
    assert coboot.assign(pd_lane(0.05), "cuda", {0: 1.0}, cores=4).workers == 1
    assert coboot.assign(pd_lane(0.05), "cuda", {0: 1.0}, cores=8).workers == 2


def test_a_topology_that_does_not_fit_twice_runs_beside_smaller_ones_that_fit_with_it():
    """Two copies of 1p1d at 0.3 a worker (0.6) exceed 0.9, but 1p1d and `1` (0.05) take
    0.65 together: two workers, sharing 0.65. Negative controls: with 1p1d at 0.44 a worker
    the two take 0.93, and at 0.6 1p1d alone takes 1.2: one at a time; a third topology as
    large as 1p1d leaves two workers only where the two largest fit together."""
    small = (ONE, with_fraction(placed("1"), 0.05))
    a = coboot.assign([small, (PD, with_fraction(placed("1p1d"), 0.3))], "cuda", {0: 1.0},
                      cores=16)
    assert (a.workers, a.shares) == (2, {0: 0.65})
    assert a.reason.startswith("2 topologies at once: the 2 largest take GPU 0 0.65 together")
    for frac in (0.44, 0.6):
        keyed = [small, (PD, with_fraction(placed("1p1d"), frac))]
        a = coboot.assign(keyed, "cuda", {0: 1.0}, cores=16)
        assert (a.workers, a.shares) == (1, {}) and a.reason.startswith("one topology")
    three = [small, (PD, with_fraction(placed("1p1d"), 0.3)),
             (WINDOW, with_fraction(placed("1p1d"), 0.3))]
    assert coboot.assign(three, "cuda", {0: 1.0}, cores=16).workers == 1
    three[2] = (WINDOW, with_fraction(placed("1p1d"), 0.1))
    a = coboot.assign(three, "cuda", {0: 1.0}, cores=16)
    assert (a.workers, a.shares) == (3, {0: 0.85})
    # too few cores for two booting at once: one, whatever the memory
    assert coboot.assign([small, (PD, with_fraction(placed("1p1d"), 0.3))], "cuda",
                         {0: 1.0}, cores=4).workers == 1


@pytest.mark.parametrize("keyed, free, why", [
    ([], {0: 1.0}, "no topology"),
    (None, None, "GPU free memory unknown"),
])
def test_nothing_to_decide_is_one_worker_with_its_reason(keyed, free, why):
    a = coboot.assign(pd_lane() if keyed is None else keyed, "cuda", free, cores=16)
    assert a.workers == 1 and why in a.reason


def test_the_record_round_trips():
    a = coboot.assign(pd_lane(), "cuda", {0: 1.0}, cores=16)
    assert coboot.Assignment.from_dict(a.to_dict()) == a
    assert a.to_dict()["shares"] == {"0": 0.8}
    assert coboot.key_name(WINDOW) == "vllm/1p1d[window]"


def test_an_engine_that_sizes_from_free_memory_runs_alone_and_says_why():
    """TokenSpeed sizes its KV pool from the device's free memory at start
    (Engine.boots_beside_others): one topology at a time, with its reason."""
    from e2e_test.infra.engines.tokenspeed import ENGINE as TS
    assert TS.boots_beside_others and "free memory" in TS.boots_beside_others
    assert for_topology("vllm", topologies.parse("1")).boots_beside_others is None
    unbounded = replace(SPEC, kv_budget_tokens=None)
    assert TS.alone_reason(unbounded) == TS.boots_beside_others
    lane = [(("tokenspeed",) + k[1:], p) for k, p in pd_lane(0.05)]
    alone = {k: TS.boots_beside_others for k, _ in lane}
    a = coboot.assign(lane, "cuda", {0: 1.0}, cores=16, alone=alone)
    assert a.workers == 1
    assert a.reason.startswith("tokenspeed boots alone: TokenSpeed sizes its KV pool")
    # the negative control: with no engine alone, the same lane runs four at once
    assert coboot.assign(lane, "cuda", {0: 1.0}, cores=16).workers == 4


def test_vllm_boots_beside_others_only_with_its_kv_pinned():
    """vLLM profiles device-wide memory to size its KV unless --kv-cache-memory-bytes pins it
    (engines/vllm.py kv_cache_bytes): a model with kv_budget_tokens may co-boot, one without
    boots alone and says why."""
    vl = for_topology("vllm", topologies.parse("1"))
    assert SPEC.kv_budget_tokens and vl.alone_reason(SPEC) is None
    llama = get_spec("meta-llama/Llama-3.1-8B-Instruct")
    assert not llama.kv_budget_tokens
    assert "profiling device-wide memory" in vl.alone_reason(llama)


def test_tokenspeed_with_its_pool_bounded_runs_beside_others_at_their_total_share():
    """With kv_budget_tokens (--max-total-tokens) a TokenSpeed worker holds about its share,
    so its topologies may run beside others; each of its workers then runs at the total share
    the workers may hold on its device (its pool budget is free_now - total x (1 -
    utilization): at least its own share whatever the others hold), inside one topology as
    across topologies."""
    from e2e_test.infra.engines.tokenspeed import ENGINE as TS
    assert SPEC.kv_budget_tokens and TS.alone_reason(SPEC) is None
    pd = placed("1p1d", engine="tokenspeed")
    assert [e.mem_fraction for e in pd.entries] == [0.1, 0.2]      # packed_schedule
    lane = [(("tokenspeed", "1"), placed("1", engine="tokenspeed")),
            (("tokenspeed", "1p1d"), pd), (("tokenspeed", "1p1d", "window"), pd)]
    # what 1p1d holds is its largest cumulative share (0.2), not their sum (0.3)
    assert TS.held_share(pd) == {0: 0.2} and coboot.device_share(pd) == {0: 0.3}
    a = coboot.assign(lane, "cuda", {0: 1.0}, cores=16,
                      alone={k: TS.alone_reason(SPEC) for k, _ in lane},
                      held={k: TS.held_share(p) for k, p in lane})
    assert a.workers == 4 and a.shares == {0: 0.8}
    got = TS.beside(pd, a.shares)
    assert [e.mem_fraction for e in got.entries] == [0.8, 0.8]
    assert TS.beside(pd, {}) is pd
    # a worker on a device the others do not share keeps its own
    other = placed("1", devices=(1,), engine="tokenspeed")
    assert TS.beside(other, {0: 0.7}).entries == other.entries
    # vLLM's workers hold their own planned share (KV pinned): unchanged beside others
    vl = placed("1p1d")
    vdriver = for_topology("vllm", topologies.parse("1p1d"))
    assert vdriver.beside(vl, {0: 0.5}) is vl and vdriver.held_share(vl) is None


def test_tokenspeed_serving_a_hybrid_model_boots_alone_on_0_1_0(monkeypatch):
    """The tiny VLM (Qwen3.5, Gated DeltaNet layers): TokenSpeed 0.1.0 sizes its
    recurrent-state pool from the utilization, unbounded by --max-total-tokens, so the EPD
    lane's topologies boot one at a time even with a KV budget; 0.1.1's token limit caps KV
    and state together, so they boot at once (the negative control: the same spec)."""
    from e2e_test.infra.engines import tokenspeed
    TS = tokenspeed.ENGINE
    vlm = get_spec("tiny-random/Qwen3.5-VL")
    assert vlm.kv_budget_tokens and "hybrid" in vlm.features
    monkeypatch.setattr(tokenspeed, "installed_versions",
                        lambda: {"tokenspeed": "0.1.0", "servicer": "0.7.0"})
    assert "hybrid" in TS.alone_reason(vlm)
    monkeypatch.setattr(tokenspeed, "installed_versions",
                        lambda: {"tokenspeed": "0.1.1", "servicer": "0.9.1"})
    assert TS.alone_reason(vlm) is None


def test_the_epd_lane_on_tokenspeed_0_1_1_boots_its_two_topologies_together(monkeypatch):
    """The EPD lane on an H200 (NVML reports a little under the whole device free):
    `1e1p1d` holds 0.45 (packed_schedule's cumulative 0.15, 0.30, 0.45) and `1` 0.15; two
    copies of 0.45 exceed 0.995 less the headroom, the two together (0.60) do not. TokenSpeed's
    workers then run at that total (beside)."""
    from e2e_test.infra.engines import tokenspeed
    TS = tokenspeed.ENGINE
    monkeypatch.setattr(tokenspeed, "installed_versions",
                        lambda: {"tokenspeed": "0.1.1", "servicer": "0.9.1"})
    vlm = get_spec("tiny-random/Qwen3.5-VL")

    def vplaced(name):
        topo = topologies.parse(name)
        return planner.place(topo, vlm, "cuda", (0,), for_topology("tokenspeed", topo))
    lane = [(("tokenspeed", "1"), vplaced("1")), (("tokenspeed", "1e1p1d"), vplaced("1e1p1d"))]
    held = {k: TS.held_share(p) for k, p in lane}
    assert held == {("tokenspeed", "1"): {0: 0.15}, ("tokenspeed", "1e1p1d"): {0: 0.45}}
    a = coboot.assign(lane, "cuda", {0: 0.995}, cores=16,
                      alone={k: TS.alone_reason(vlm) for k, _ in lane}, held=held)
    assert (a.workers, a.shares) == (2, {0: 0.6})
    assert {e.mem_fraction for e in TS.beside(lane[1][1], a.shares).entries} == {0.6}
