"""AFD topologies (vLLM + afd-plugin) and the native DP/EP baseline behind the gateway.

Every AFD-kind topology (`XaYf` and `native-dpN`): chat completes through smg, a small GSM8K
sample completes without errors (no accuracy floor: the suite is meant to run on a tiny
random-weight MoE, see e2e_test/infra/tiny_models.py), and the same greedy prompts are
judged by the comparison oracle between the native baseline and AFD. On `XaYf` only: the FFN server really served
the requests (Engine.ffn_proof: engines/afd.afd_ffn_served, from the plugin's FFN step traces).
"""


import pytest

from e2e_test.infra.engines import afd
from e2e_test.infra.specs import settings
from e2e_test.infra.verdicts import baseline as evidence
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.evals import gsm8k

pytestmark = [pytest.mark.e2e, pytest.mark.topology_kinds("afd")]
GSM8K_N = settings.get("E2E_AFD_GSM8K_N")
GSM8K_MAX_TOKENS = settings.get("E2E_AFD_GSM8K_MAX_TOKENS")
MAX_TOKENS = 16


def test_afd_chat(cluster, record):
    r = cluster.client.post("/v1/chat/completions", json={
        "model": cluster.model_name, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    usage = body["usage"]
    assert body["choices"] and body["choices"][0]["message"]["content"] is not None
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= MAX_TOKENS
    record["chat"] = {"text": body["choices"][0]["message"]["content"], "usage": usage}


@pytest.mark.not_native_baseline    # no FFN server there: never selected on native-dpN
def test_afd_ffn_served(cluster, record):
    assert not cluster.topology.native_baseline, "not_native_baseline: never selected there"
    p = cluster.driver.ffn_proof(cluster)          # engines/afd.afd_ffn_served, n=4
    record["afd_ffn_proof"] = p.to_dict()
    print(f"AFD FFN proof: {p.to_dict()}")


def test_afd_gsm8k_completes(eval_data, cluster, record):
    """Completion only: every item answered (HTTP 200, text). Accuracy is recorded, not
    checked (random weights)."""
    res = gsm8k.run(cluster.gateway_url, cluster.model_name, n=GSM8K_N, concurrency=GSM8K_N,
                    max_tokens=GSM8K_MAX_TOKENS, watchdog=cluster.watchdog("gsm8k"))
    record.setdefault("evals", {})["gsm8k"] = res.summary()
    print(f"gsm8k on {cluster.topology.name}: {res.summary()}")
    assert res.n == GSM8K_N
    assert res.errors == 0, f"{res.errors}/{res.n} GSM8K requests failed: {res.error_samples}"
    assert all(i.get("output") for i in res.items), "a GSM8K item came back with empty text"


@pytest.mark.baseline("afd-prompts")
def test_afd_outputs_vs_native(baseline, cluster, record):
    """The same greedy prompts on the native baseline and on AFD, judged by the comparison
    oracle (token by token with top-k logprobs). On the native baseline this measures the
    control arm (a second pass and a serial pass against the first): with random weights
    near-ties are everywhere, and the control arm is what says how many flips that noise
    makes. AFD is then held to that budget, with no mismatch allowed (the native baseline:
    the session's native-dpN, booted for it where no other test did)."""
    label = f"{cluster.engine}/{cluster.topology.name}"
    if cluster.topology.native_baseline:
        ev = baseline("afd-prompts")
        failed = [i for i, steps in ev.passes.items() if steps is None]
        assert not failed, f"prompts without an answer on {cluster.topology.name}: {failed}"
        assert all(ev.passes.values()), "a completion without tokens"
        arm = ev.control
        record["oracle_control"] = {"afd-prompts": arm.to_dict()}
        print("; ".join(c.line() for c in arm.comparisons))
        assert not arm.problems(), arm.problems()[0]
        return
    reqs = evidence.afd_requests(cluster)
    mine = comparisons.run_pass(cluster.gateway_url, reqs, concurrency=len(reqs),
                                watchdog=cluster.watchdog("afd prompts"))
    failed = [i for i, steps in mine.items() if steps is None]
    assert not failed, f"prompts without an answer on {cluster.topology.name}: {failed}"
    assert all(mine.values()), "a completion without tokens"
    ev = baseline("afd-prompts")
    verdict = oracle.judge(oracle.compare("afd-prompts", ev.label, label, ev.passes, mine),
                           ev.control)
    record[afd.NATIVE_COMPARISON_KEY] = verdict.to_dict()
    record["oracle"] = verdict.to_dict()
    print(verdict.message)
    assert verdict.ok, verdict.message
