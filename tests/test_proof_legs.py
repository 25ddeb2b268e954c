"""The per-leg PD proof (proof.legs_problems): every prefill and every decode worker moved its
own role's counter, and none moved the other role's. Pure: scrapes as metrics.parse gives them."""

from e2e_test.infra.verdicts import proof
from e2e_test.infra.engines.vllm import SRC

COMPUTED = proof.leg(SRC, {"source": "local_compute"})
RECEIVED = proof.leg(SRC, {"source": "external_kv_transfer"})
OWN = {"prefill": [COMPUTED], "decode": [RECEIVED]}
FOREIGN = {"prefill": [RECEIVED], "decode": [COMPUTED]}
WORKERS = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"),
           ("decode-1", "decode")]


def scrape(local: float = 0, external: float = 0) -> dict:
    return {(SRC, (("source", "local_compute"),)): local,
            (SRC, (("source", "external_kv_transfer"),)): external}


def test_a_2p2d_where_every_leg_worked_in_its_role_passes():
    before = [scrape()] * 4
    after = [scrape(local=700), scrape(local=650), scrape(external=700), scrape(external=650)]
    legs, problems = proof.legs_problems(WORKERS, before, after, OWN, FOREIGN)
    assert problems == []
    assert legs["decode-1"] == {"role": "decode",
                                f"{SRC}{{source=external_kv_transfer}}": 650,
                                f"{SRC}{{source=local_compute}}": 0}


def test_an_idle_leg_and_a_decode_that_computed_prompts_fail_by_name():
    before = [scrape()] * 4
    # prefill-1 got nothing; decode-1 computed its prompts itself (the KV never came)
    after = [scrape(local=1350), scrape(), scrape(external=700), scrape(local=650)]
    _, problems = proof.legs_problems(WORKERS, before, after, OWN, FOREIGN)
    assert problems == [
        f"prefill-1 (prefill) took no traffic: {SRC}{{source=local_compute}} did not move",
        f"decode-1 (decode) took no traffic: {SRC}{{source=external_kv_transfer}} did not move",
        f"decode-1 (decode) acted as another role: {SRC}{{source=local_compute}} moved by 650"]


def test_a_prefill_that_received_kv_acted_as_a_decode():
    before = [scrape(local=10, external=5)] + [scrape()] * 3
    after = [scrape(local=710, external=305), scrape(local=600), scrape(external=700),
             scrape(external=600)]
    _, problems = proof.legs_problems(WORKERS, before, after, OWN, FOREIGN)
    assert problems == [f"prefill-0 (prefill) acted as another role: "
                        f"{SRC}{{source=external_kv_transfer}} moved by 300"]


def _gw(selected: float, http: float) -> dict:
    sel = proof.SELECTIONS
    return {(sel, (("worker_type", "prefill"),)): selected,
            (sel, (("worker_type", "decode"),)): selected,
            ("smg_http_requests_total", (("method", "POST"),)): http}


def test_dispatch_evidence_tells_a_skipped_counter_from_a_frozen_page():
    """Where smg's picks fall short of the requests served, the record says whether its request
    counter moved over them and what a later scrape saw."""
    skipped = proof.dispatch_evidence(_gw(83, 190), _gw(83, 194), _gw(83, 194))
    assert skipped == {"http_requests": 4, "selections_1s_later": {"prefill": 0, "decode": 0}}
    # the dispatch verdict itself is unchanged: 0 of 4 fails
    gw = proof.gateway_dispatch(_gw(83, 190), _gw(83, 194))
    assert proof.dispatch_problems(type("P", (), gw), 4) == [
        "the gateway picked prefill 0 and decode 0 times for 4 requests"]
    frozen = proof.dispatch_evidence(_gw(83, 190), _gw(83, 190), _gw(87, 194))
    assert frozen == {"http_requests": 0, "selections_1s_later": {"prefill": 4, "decode": 4}}


def _fallbacks(overload: float = 0, liveness: float = 0, stage: str = "selection") -> dict:
    return {("smg_worker_overload_fallback_total", (("stage", stage),)): overload,
            ("smg_worker_liveness_fallback_total", (("stage", stage),)): liveness}


def test_pd_pairs_of_smgs_veto_fallback_count_as_picks_of_both_legs():
    """smg 1.13.0 counts a PD pair its veto fallback picked (placement.rs relaxed_pair) under
    its fallback counters only. On an H200 the prefill's overload veto (waiting 15 > 8) can
    hold through the KV proof and the legs test: selections stand still, every request a
    fallback pick. In a PD gateway each such pick is one prefill and one decode."""
    before = {**_gw(83, 190), **_fallbacks()}
    after = {**_gw(83, 194), **_fallbacks(overload=3, liveness=1)}
    gw = proof.gateway_dispatch(before, after, pd=True)
    assert (gw["gateway_prefill_selections"], gw["gateway_decode_selections"],
            gw["gateway_fallback_pairs"]) == (4, 4, 4)
    assert proof.dispatch_problems(type("P", (), gw), 4) == []
    # Negative controls: a gateway that is not PD (the proof's negative control reads a
    # regular topology as both legs) gets no credit for fallbacks; fallbacks at another stage
    # (dispatch, PD admission) are no picks; and with nothing counted the proof fails.
    for gw in (proof.gateway_dispatch(before, after),
               proof.gateway_dispatch(before, {**_gw(83, 194),
                                               **_fallbacks(overload=4, stage="dispatch")},
                                      pd=True),
               proof.gateway_dispatch(before, {**_gw(83, 194), **_fallbacks()}, pd=True)):
        assert proof.dispatch_problems(type("P", (), gw), 4) == [
            "the gateway picked prefill 0 and decode 0 times for 4 requests"]
    # Selections and fallback picks add up; a short count still fails.
    gw = proof.gateway_dispatch(before, {**_gw(85, 194), **_fallbacks(overload=1)}, pd=True)
    assert proof.dispatch_problems(type("P", (), gw), 4) == [
        "the gateway picked prefill 3 and decode 3 times for 4 requests"]


def test_a_role_with_no_counter_of_its_own_is_an_error_not_a_pass():
    """An engine that named counters for the prefill only: the decode legs were read for
    nothing (only the foreign counter, which an idle leg keeps at 0) and passed."""
    before = [scrape()] * 4
    after = [scrape(local=700), scrape(local=650), scrape(), scrape()]
    _, problems = proof.legs_problems(WORKERS, before, after, {"prefill": [COMPUTED]}, FOREIGN)
    why = ("the engine names no counter of that role's own work: whether the leg took "
           "traffic cannot be told")
    assert problems == [f"decode-0 (decode): {why}", f"decode-1 (decode): {why}"]
