"""GSM8K and MMLU through the gateway on every selected topology.

n and the floors (accuracy, format) come from the model's registry entry (E2E_GSM8K_N /
E2E_MMLU_N override n). Every item's greedy tokens with their top-k logprobs are kept for the
comparison oracle (test_oracle.py, test_pd.py).
Transport and HTTP errors are counted apart; above 2% of n they fail the test.
"""

import pytest

from e2e_test.infra.specs import settings
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.evals import gsm8k, mmlu, without_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.eval]
CONCURRENCY = settings.get("E2E_EVAL_CONCURRENCY")


def eval_n(cluster, name) -> int:
    acc = cluster.spec.accuracy.get(name)
    return settings.get(f"E2E_{name.upper()}_N") or (acc.n if acc else 32)


def max_prompt_tokens(cluster, name):
    return (cluster.spec.max_model_len or 4096) - 8 if name == "mmlu" else None


def oracle_pass(cluster, oracle_store, name):
    """The oracle's evidence for `name` on this cluster: the scored pass of test_eval, or,
    where it did not run or its engine returns logprobs on another API than the scored eval's
    (Engine.logprobs_api "chat"), a pass of its own with the same prompts, asked the
    engine's way. Stored for the tests after it."""
    key = (cluster.engine, cluster.topology.name, name)
    if key not in oracle_store.passes:
        oracle_store.passes[key] = comparisons.eval_pass(
            cluster.gateway_url, cluster.model_name, name, eval_n(cluster, name),
            concurrency=CONCURRENCY, max_prompt_tokens=max_prompt_tokens(cluster, name),
            watchdog=cluster.watchdog(f"{name} oracle pass"),
            logprobs=cluster.driver.top_logprobs, api=cluster.driver.logprobs_api)
    return oracle_store.passes[key]


def scored_pass(cluster, oracle_store, name, module):
    """test_eval's traffic: the scored pass, stored as the oracle's evidence too where the
    engine returns logprobs on completions (otherwise it asks none, and oracle_pass runs the
    oracle's own pass). On `1` booted with others it runs ahead (pytest_plugin.ahead)."""
    mpt = max_prompt_tokens(cluster, name)
    scored_lp = cluster.driver.logprobs_api == "completions"
    res = module.run(cluster.gateway_url, cluster.model_name, n=eval_n(cluster, name),
                     concurrency=CONCURRENCY, watchdog=cluster.watchdog(name),
                     logprobs=cluster.driver.top_logprobs if scored_lp else None,
                     **({"max_prompt_tokens": mpt} if mpt else {}))
    if scored_lp:
        oracle_store.passes[(cluster.engine, cluster.topology.name, name)] = \
            oracle.steps_by_index(res.items)
    return res


@pytest.mark.ahead.with_args(scored_pass)
@pytest.mark.parametrize("name,module", [("gsm8k", gsm8k), ("mmlu", mmlu)], ids=["gsm8k", "mmlu"])
def test_eval(eval_data, cluster, record, oracle_store, name, module, ahead):
    res = ahead()
    record.setdefault("evals", {})[name] = res.summary()
    record.setdefault("eval_items", {})[name] = without_logprobs(res.items)
    print(f"{name} on {cluster.topology.name}: {res.summary()}")
    res.check_spec(cluster.spec.accuracy.get(name))
