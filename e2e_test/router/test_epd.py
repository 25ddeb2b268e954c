"""EPD topologies (TokenSpeed behind smg's EPD mode): the encoder ran for every image request
and its output reached prefill; text-only chat still answers."""

import re

import pytest

from e2e_test.infra.errors import HarnessError
from e2e_test.infra.load import load
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


IMAGE_SEEDS = range(8)
IMAGE_MAX_TOKENS = 16


def _image_requests(cluster) -> list:
    reqs = []
    for seed in IMAGE_SEEDS:
        body = proof.image_chat_body(cluster.model_name, "Describe this picture.",
                                     proof.random_png_data_uri(seed), max_tokens=IMAGE_MAX_TOKENS)
        body.update(logprobs=True, top_logprobs=cluster.driver.top_logprobs)
        reqs.append(load.Request("/v1/chat/completions", body, tag=seed))
    return reqs


@pytest.mark.epd
@pytest.mark.engines("tokenspeed")
@pytest.mark.topology_kinds("regular", "epd")
def test_epd_image_outputs_match_aggregated(cluster, record, oracle_store):
    """The same images, greedy, on aggregated `1` (baseline and control arm) and on EPD,
    judged by the comparison oracle: the encoder output that EPD moved must give the same
    computation as the aggregated worker's own tower. Different images give different outputs
    (checked on the baseline), so a wrong or missing image shows as a mismatch."""
    reqs = _image_requests(cluster)
    mine = comparisons.run_pass(cluster.gateway_url, reqs, concurrency=len(reqs),
                                watchdog=cluster.watchdog("image prompts"))
    assert all(mine.values()), f"image requests without an answer: {mine}"
    label = f"{cluster.engine}/{cluster.topology.name}"
    key = (cluster.engine, "image-prompts")
    if cluster.topology.kind == "regular":
        distinct = len({tuple(s.token for s in steps) for steps in mine.values()})
        assert distinct > 1, "every image gave the same output: the image does not reach the model"
        arm = comparisons.control_arm_of(cluster.gateway_url, reqs, mine, label, "image-prompts",
                                         len(reqs))
        oracle_store.passes[(cluster.engine, "1", "image-prompts")] = mine
        oracle_store.control[key] = arm
        record["oracle_control"] = {"image-prompts": arm.to_dict()}
        assert not arm.problems(), arm.problems()[0]
        return
    base = oracle_store.passes.get((cluster.engine, "1", "image-prompts"))
    if base is None:
        pytest.skip("needs aggregated `1` of the same model earlier in the session")
    verdict = oracle.judge(oracle.compare("image-prompts", f"{cluster.engine}/1", label, base,
                                          mine), oracle_store.control[key])
    record["oracle"] = verdict.to_dict()
    print(verdict.message)
    assert verdict.ok, verdict.message
