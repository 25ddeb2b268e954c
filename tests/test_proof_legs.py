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
