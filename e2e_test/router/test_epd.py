"""EPD topologies (TokenSpeed behind smg's EPD mode): the encoder ran for every image request
and its output reached prefill; text-only chat still answers."""

import re

import pytest

from e2e_test.infra.errors import HarnessError
from e2e_test.infra.load import load
from e2e_test.infra.verdicts import baseline as evidence
from e2e_test.infra.verdicts import comparisons, oracle, proof

pytestmark = [pytest.mark.e2e, pytest.mark.topology_kinds("epd")]
# Every test here sends images: a session whose model lacks a feature named here deselects
# them at collection (pytest_lanes._runner_deselection), never a skip at run time.
NEEDS_FEATURES = ("multimodal",)


def test_epd_encoder_proof(cluster, record):
    p = cluster.driver.epd_proof(cluster)          # engines/tokenspeed.epd_encoder_ran
    record["epd_proof"] = p.to_dict()
    print(f"EPD proof: {p.to_dict()}")


@pytest.mark.epd
@pytest.mark.engines("tokenspeed")
@pytest.mark.topology_kinds("regular")
def test_epd_proof_fails_where_nothing_moved(cluster, record):
    """The engine's EPD proof read on the regular `1` (its one worker read as encode, prefill
    and decode): the image requests are answered, but no encoder output moves between
    workers, so the proof must fail for the reason the engine names (Engine.proof_misses)."""
    reason = cluster.driver.proof_misses.get("epd")
    assert reason, f"engine {cluster.engine} declares no proof_misses['epd']"
    roles = {r: cluster.workers for r in ("encode", "prefill", "decode")}
    with pytest.raises(HarnessError) as ei:
        cluster.driver.epd_proof(cluster, roles=roles)
    msg = str(ei.value).splitlines()[0]
    record["epd_proof_negative_control"] = msg
    print(f"EPD proof read on {cluster.topology.name}: {msg}")
    assert re.search(reason, msg), f"the proof failed, but not for moving nothing: {msg}"


def test_epd_image_chat_streams(cluster, record):
    body = proof.image_chat_body(cluster.model_name, "What is in this picture?",
                                 proof.random_png_data_uri(7), max_tokens=16)
    rep = load.run(cluster.gateway_url, [load.Request("/v1/chat/completions", body)],
                   concurrency=1, stream=True)
    res = rep.results[0]
    assert res.ok, f"{res.status} {res.error}"
    assert res.output_tokens > 0 and res.prompt_tokens > 0
    record["epd_image_stream"] = res.to_dict()


@pytest.mark.epd
@pytest.mark.engines("tokenspeed")
@pytest.mark.topology_kinds("regular", "epd")
@pytest.mark.baseline("image-prompts")
def test_epd_image_outputs_match_aggregated(baseline, cluster, record):
    """The same images, greedy, on aggregated `1` (baseline and control arm) and on EPD,
    judged by the comparison oracle: the encoder output that EPD moved must give the same
    computation as the aggregated worker's own tower. Different images give different outputs
    (checked on the baseline), so a wrong or missing image shows as a mismatch."""
    if cluster.topology.kind == "regular":
        ev = baseline("image-prompts")
        assert all(ev.passes.values()), f"image requests without an answer: {ev.passes}"
        distinct = len({tuple(s.token for s in steps) for steps in ev.passes.values()})
        assert distinct > 1, "every image gave the same output: the image does not reach the model"
        record["oracle_control"] = {"image-prompts": ev.control.to_dict()}
        assert not ev.control.problems(), ev.control.problems()[0]
        return
    reqs = evidence.image_requests(cluster)
    mine = comparisons.run_pass(cluster.gateway_url, reqs, concurrency=len(reqs),
                                watchdog=cluster.watchdog("image prompts"))
    assert all(mine.values()), f"image requests without an answer: {mine}"
    label = f"{cluster.engine}/{cluster.topology.name}"
    ev = baseline("image-prompts")
    verdict = oracle.judge(oracle.compare("image-prompts", ev.label, label, ev.passes, mine),
                           ev.control)
    record["oracle"] = verdict.to_dict()
    print(verdict.message)
    assert verdict.ok, verdict.message
