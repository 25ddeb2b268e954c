"""PD topologies: the KV really moved, and the answers are the same computation as `1`'s.

The answers are held against `1` by the comparison oracle (e2e_test/infra/verdicts/oracle.py): token by
token with top-k logprobs, the first decode step's distribution included (it depends only on
the transferred KV), within the numerics budget of `1`'s control arm (the `baseline` fixture:
measured once per session, on `1` booted for it where no other test did). No tolerance is set
by hand.
"""

import re

import pytest

from e2e_test.infra.engines.vllm import pd_transfer
from e2e_test.infra.errors import HarnessError
from e2e_test.infra.verdicts import baseline as evidence
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.baseline import RECALL_N
from e2e_test.infra.verdicts.evals import recall

pytestmark = [pytest.mark.e2e, pytest.mark.topology_kinds("pd")]


@pytest.mark.pd_sweep
def test_pd_kv_transfer_proof(cluster, record):
    p = cluster.driver.pd_proof(cluster)
    record["pd_proof"] = p.to_dict()
    print(f"PD proof: {p.to_dict()}")


@pytest.mark.pd_sweep
def test_pd_every_leg_took_traffic(cluster, record):
    """Every prefill and every decode worker took traffic in its own role, and none in the
    other's (Engine.pd_legs: per worker, the engine's own counters over fresh prompts through
    the gateway): the shapes smg's topology suite sweeps (1p2d, 2p1d, 2p2d) assert the same
    from its pairing."""
    p = cluster.driver.pd_legs(cluster)
    record["pd_legs"] = p.to_dict()
    print(f"PD legs ({p.requests} requests): {p.legs}")


@pytest.mark.engines("vllm")
def test_pd_kv_transfer_proof_negative_control(cluster, record):
    """The same proof with its prompts sent straight to the decode worker (a kv_both vLLM
    worker serves them itself): nothing moves, so it must fail on a real engine, naming the
    missing transfer and the recomputed prompt tokens."""
    decode = cluster.role("decode")[0]
    with pytest.raises(HarnessError) as ei:
        pd_transfer(cluster, via=decode.http_url)
    msg = str(ei.value).splitlines()[0]
    record["pd_proof_negative_control"] = msg
    print(f"PD proof asked of {decode.name} alone: {msg}")
    assert "decode received KV for 0 of" in msg and "decode recomputed" in msg, msg


@pytest.mark.pd
@pytest.mark.topology_kinds("regular")
def test_pd_proof_fails_where_nothing_moved(cluster, record):
    """The engine's PD proof, exactly as test_pd_kv_transfer_proof runs it, read on the
    regular `1` (its one worker read as prefill and as decode): the prompts are answered but no
    KV moves, so the proof must fail, and for the reason the engine names for "nothing moved"
    (Engine.proof_misses). Runs in every lane that runs PD (marker pd) and selects `1`."""
    reason = cluster.driver.proof_misses.get("pd")
    assert reason, f"engine {cluster.engine} declares no proof_misses['pd']"
    roles = {"prefill": cluster.workers, "decode": cluster.workers}
    with pytest.raises(HarnessError) as ei:
        cluster.driver.pd_proof(cluster, roles=roles)
    msg = str(ei.value).splitlines()[0]
    record["pd_proof_negative_control"] = msg
    print(f"PD proof read on {cluster.topology.name}: {msg}")
    assert re.search(reason, msg), f"the proof failed, but not for moving nothing: {msg}"
    # the per-leg proof too (test_pd_every_leg_took_traffic): no request went to a prefill
    # or a decode worker
    with pytest.raises(HarnessError) as ei:
        cluster.driver.pd_legs(cluster, roles=roles)
    legs = str(ei.value).splitlines()[0]
    record["pd_legs_negative_control"] = legs
    print(f"PD legs read on {cluster.topology.name}: {legs}")
    assert "the gateway picked prefill 0 and decode 0 times" in legs, legs


@pytest.mark.pd_sweep
@pytest.mark.baseline("name")
@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
def test_pd_answers_match_regular(baseline, cluster, record, name):
    mine = evidence.own_pass(cluster, name)     # its own traffic first, then `1`'s evidence
    ev = baseline(name)
    verdict = oracle.judge(oracle.compare(name, ev.label,
                                          f"{cluster.engine}/{cluster.topology.name}",
                                          ev.passes, mine), ev.control, path=ev.path)
    record["pd_vs_regular"] = {name: verdict.to_dict()}
    record["oracle"] = verdict.to_dict()
    print(verdict.message)
    assert verdict.ok, verdict.message


@pytest.mark.pd_sweep
@pytest.mark.baseline("recall")
def test_pd_kv_recall(baseline, cluster, record):
    """The long pass-code prompts of `1`'s recall baseline through the disaggregated topology:
    the oracle's verdict against `1` (first step included), and every pass code that `1`
    copied must come back here too, where the decode sees it only in the transferred KV."""
    texts: dict = {}
    reqs = comparisons.requests("recall", cluster.model_name, RECALL_N,
                                logprobs=cluster.driver.top_logprobs,
                                api=cluster.driver.logprobs_api)
    mine = comparisons.run_pass(cluster.gateway_url, reqs, 16, texts=texts,
                                watchdog=cluster.watchdog("recall"))
    ev = baseline("recall")
    base = ev.passes
    # the prompts `1` was asked (its baseline holds every index it sent, None where it failed)
    mine = mine.subset(base)
    texts = {i: t for i, t in texts.items() if i in base}
    copied = sorted(i for i, t in texts.items() if recall.reproduced(i, t))
    want = ev.recall["copied"]
    verdict = oracle.judge(oracle.compare("recall", ev.label,
                                          f"{cluster.engine}/{cluster.topology.name}", base, mine),
                           ev.control, path=ev.path)
    record["kv_recall"] = {"copied": copied, "baseline_copied": want, "of": len(base),
                           "outputs": texts, "oracle": verdict.to_dict()}
    print(f"recall: {len(copied)}/{len(base)} copied (`1`: {len(want)}); {verdict.message}")
    problems = recall.recall_problems(want, copied, len(base), cluster.topology.name)
    assert not problems, f"{problems[0]} (outputs: {texts})"
    assert verdict.ok, verdict.message
