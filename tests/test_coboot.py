"""The lane-level placement (e2e_test/infra/specs/coboot.py): which of a session's shared topologies
boot together, from their plans, the backend, the GPUs' free memory and the cores. Pure: real
plans of the default model, no engine starts."""

from dataclasses import replace

import pytest

from e2e_test.infra.specs import coboot
from e2e_test.infra.specs import plan as planner
from e2e_test.infra.specs import topology as topologies
from e2e_test.infra.engines import for_topology
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


def test_the_cpu_lane_keeps_todays_order_and_says_why():
    keyed = [(ONE, placed("1", "cpu")), (("vllm", "dp2"), placed("dp2", "cpu")),
             (PD, placed("1p1d", "cpu"))]
    s = coboot.schedule(keyed, "cpu", None, cores=2)
    assert s.mode == "serial" and not s.together
    assert s.waves == ((ONE,), (("vllm", "dp2"),), (PD,))
    assert "backend cpu" in s.reason and "68-74 %" in s.reason


def test_the_registry_fractions_boot_the_pd_lane_at_once_on_an_h200():
    """SmolLM2 takes 0.1 of a GPU per worker (its KV pinned by kv_budget_tokens): `1`, 1p1d
    and the window 1p1d (5 workers, 0.5) fit under 0.9 together."""
    s = coboot.schedule(pd_lane(), "cuda", {0: 1.0}, cores=16)
    assert s.mode == "together" and s.waves == ((ONE, PD, WINDOW),)
    assert s.shares == {0: {0: 0.5}}


def test_shares_that_do_not_fit_at_once_wave():
    """At 0.2 a worker (SmolLM2's share while vLLM sized its KV from it): `1` (0.2) and 1p1d
    (0.4) fit together under 0.9; the window 1p1d (0.4 more) does not, so it waves."""
    s = coboot.schedule(pd_lane(0.2), "cuda", {0: 1.0}, cores=16)
    assert s.mode == "waves"
    assert s.waves == ((ONE, PD), (WINDOW,))
    assert s.shares == {0: {0: 0.6}, 1: {0: 0.4}}
    assert "2 waves" in s.reason


def test_small_shares_boot_every_topology_at_once():
    s = coboot.schedule(pd_lane(0.05), "cuda", {0: 0.99}, cores=16)
    assert s.mode == "together" and s.waves == ((ONE, PD, WINDOW),)
    assert "every topology fits at once" in s.reason and "GPU 0 0.25" in s.reason


def test_memory_held_by_others_keeps_them_apart():
    s = coboot.schedule(pd_lane(0.2), "cuda", {0: 0.5}, cores=16)
    assert s.mode == "serial" and s.waves == ((ONE,), (PD,), (WINDOW,))
    assert "no two topologies fit at once" in s.reason and "GPU 0 0.50 free" in s.reason


def test_too_few_cores_keep_boots_apart():
    """Five workers at 2 cores each need 10; 4 cores boot two workers at a time."""
    s = coboot.schedule(pd_lane(0.05), "cuda", {0: 1.0}, cores=4)
    assert s.waves == ((ONE,), (PD,), (WINDOW,))
    s = coboot.schedule(pd_lane(0.05), "cuda", {0: 1.0}, cores=6)
    assert s.waves == ((ONE, PD), (WINDOW,))


def test_a_topology_that_does_not_fit_alone_is_its_own_wave():
    keyed = [(ONE, with_fraction(placed("1"), 0.05)), (PD, with_fraction(placed("1p1d"), 0.6)),
             (("vllm", "dp2"), with_fraction(placed("dp2"), 0.05))]
    s = coboot.schedule(keyed, "cuda", {0: 1.0}, cores=16)
    # 1p1d at 0.6 + 0.6 exceeds the device even alone: planned for it as it is today
    assert s.waves == ((ONE,), (PD,), (("vllm", "dp2"),))


def test_devices_are_counted_apart():
    """Two GPUs: a topology on GPU 0 and one on GPU 1 fit together even at 0.85 each."""
    a = with_fraction(placed("1", devices=(0,)), 0.85)
    b = with_fraction(placed("1", devices=(1,)), 0.85)
    s = coboot.schedule([(("vllm", "1"), a), (("tokenspeed", "1"), b)], "cuda",
                        {0: 1.0, 1: 1.0}, cores=16)
    assert s.mode == "together"
    s = coboot.schedule([(("vllm", "1"), a), (("tokenspeed", "1"), a)], "cuda",
                        {0: 1.0, 1: 1.0}, cores=16)
    assert s.mode == "serial"


@pytest.mark.parametrize("keyed, free, why", [
    ([], {0: 1.0}, "0 shared topology"),
    ([(ONE, placed("1"))], {0: 1.0}, "1 shared topology"),
    (None, None, "GPU free memory unknown"),
])
def test_nothing_to_decide_is_serial_with_its_reason(keyed, free, why):
    s = coboot.schedule(pd_lane() if keyed is None else keyed, "cuda", free, cores=16)
    assert s.mode == "serial" and why in s.reason


def test_the_record_names_the_keys():
    s = coboot.schedule(pd_lane(0.2), "cuda", {0: 1.0}, cores=16)
    d = s.to_dict()
    assert d["waves"] == [["vllm/1", "vllm/1p1d"], ["vllm/1p1d[window]"]]
    assert d["mode"] == "waves" and d["reason"] == s.reason
    assert s.wave_of(WINDOW) == 1 and s.wave_of(ONE) == 0
    with pytest.raises(KeyError):
        s.wave_of(("vllm", "dp2"))


def test_an_engine_that_sizes_from_free_memory_boots_alone_and_says_why():
    """TokenSpeed sizes its KV pool from the device's free memory at start
    (Engine.boots_beside_others): its topologies boot one at a time, with its reason."""
    from e2e_test.infra.engines.tokenspeed import ENGINE as TS
    assert TS.boots_beside_others and "free memory" in TS.boots_beside_others
    assert for_topology("vllm", topologies.parse("1")).boots_beside_others is None
    unbounded = replace(SPEC, kv_budget_tokens=None)
    assert TS.alone_reason(unbounded) == TS.boots_beside_others
    lane = [(("tokenspeed",) + k[1:], p) for k, p in pd_lane(0.05)]
    alone = {k: TS.boots_beside_others for k, _ in lane}
    s = coboot.schedule(lane, "cuda", {0: 1.0}, cores=16, alone=alone)
    assert s.mode == "serial" and len(s.waves) == 3
    assert s.reason.startswith("tokenspeed boots alone: TokenSpeed sizes its KV pool")
    # one such key among others: the others still share a wave
    mixed = pd_lane(0.05) + [(("tokenspeed", "1"), with_fraction(placed("1"), 0.05))]
    s = coboot.schedule(mixed, "cuda", {0: 1.0}, cores=16,
                        alone={("tokenspeed", "1"): TS.boots_beside_others})
    assert s.waves == ((ONE, PD, WINDOW), (("tokenspeed", "1"),)) and s.mode == "waves"


def test_vllm_boots_beside_others_only_with_its_kv_pinned():
    """vLLM profiles device-wide memory to size its KV unless --kv-cache-memory-bytes pins it
    (engines/vllm.py kv_cache_bytes): a model with kv_budget_tokens may co-boot, one without
    boots alone and says why."""
    vl = for_topology("vllm", topologies.parse("1"))
    assert SPEC.kv_budget_tokens and vl.alone_reason(SPEC) is None
    llama = get_spec("meta-llama/Llama-3.1-8B-Instruct")
    assert not llama.kv_budget_tokens
    assert "profiling device-wide memory" in vl.alone_reason(llama)


def test_tokenspeed_with_its_pool_bounded_boots_beside_others_at_the_waves_share():
    """With kv_budget_tokens (--max-total-tokens) a TokenSpeed worker holds about its share,
    so it may co-boot; each of its workers then runs at the wave's total share on its device
    (its pool budget is free_now - total x (1 - utilization): at least its own share whatever
    the others hold), inside one topology as across topologies."""
    from e2e_test.infra.engines.tokenspeed import ENGINE as TS
    assert SPEC.kv_budget_tokens and TS.alone_reason(SPEC) is None
    pd = placed("1p1d", engine="tokenspeed")
    assert [e.mem_fraction for e in pd.entries] == [0.1, 0.2]      # packed_schedule
    lane = [(("tokenspeed", "1"), placed("1", engine="tokenspeed")),
            (("tokenspeed", "1p1d"), pd), (("tokenspeed", "1p1d", "window"), pd)]
    # what 1p1d holds is its largest cumulative share (0.2), not their sum (0.3)
    assert TS.held_share(pd) == {0: 0.2} and coboot.device_share(pd) == {0: 0.3}
    s = coboot.schedule(lane, "cuda", {0: 1.0}, cores=16,
                        alone={k: w for k, _ in lane if (w := TS.alone_reason(SPEC))},
                        held={k: TS.held_share(p) for k, p in lane})
    assert s.mode == "together" and s.shares == {0: {0: 0.5}}
    got = TS.beside(pd, s.shares[0])
    assert [e.mem_fraction for e in got.entries] == [0.5, 0.5]
    assert TS.beside(pd, {}) is pd
    # a worker on a device the wave does not share keeps its own
    other = placed("1", devices=(1,), engine="tokenspeed")
    assert TS.beside(other, {0: 0.7}).entries == other.entries
    # vLLM's workers hold their own planned share (KV pinned): unchanged beside others
    vl = placed("1p1d")
    vdriver = for_topology("vllm", topologies.parse("1p1d"))
    assert vdriver.beside(vl, {0: 0.5}) is vl and vdriver.held_share(vl) is None


def test_tokenspeed_serving_a_hybrid_model_boots_alone():
    """The tiny VLM (Qwen3.5, Gated DeltaNet layers): TokenSpeed sizes its recurrent-state
    pool from the utilization, unbounded by --max-total-tokens, so the EPD lane's topologies
    boot one at a time even with a KV budget."""
    from e2e_test.infra.engines.tokenspeed import ENGINE as TS
    vlm = get_spec("tiny-random/Qwen3.5-VL")
    assert vlm.kv_budget_tokens and "hybrid" in vlm.features
    assert "hybrid" in TS.alone_reason(vlm)
