"""GSM8K and MMLU through the gateway on every selected topology.

n and the floors (accuracy, format) come from the model's registry entry (E2E_GSM8K_N /
E2E_MMLU_N override n). Every item's greedy tokens with their top-k logprobs are kept for the
comparison oracle (test_oracle.py, test_pd.py).
Transport and HTTP errors are counted apart; above 2% of n they fail the test.
"""

import pytest

from e2e_test.infra import oracle, settings
from e2e_test.infra.evals import gsm8k, mmlu, without_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.eval]
CONCURRENCY = settings.get("E2E_EVAL_CONCURRENCY")


def eval_n(cluster, name) -> int:
    acc = cluster.spec.accuracy.get(name)
    return settings.get(f"E2E_{name.upper()}_N") or (acc.n if acc else 32)


def max_prompt_tokens(cluster, name):
    return (cluster.spec.max_model_len or 4096) - 8 if name == "mmlu" else None


@pytest.mark.parametrize("name,module", [("gsm8k", gsm8k), ("mmlu", mmlu)], ids=["gsm8k", "mmlu"])
def test_eval(eval_data, cluster, record, oracle_store, name, module):
    n = eval_n(cluster, name)
    mpt = max_prompt_tokens(cluster, name)
    res = module.run(cluster.gateway_url, cluster.model_name, n=n, concurrency=CONCURRENCY,
                     watchdog=cluster.watchdog(name), logprobs=cluster.driver.top_logprobs,
                     **({"max_prompt_tokens": mpt} if mpt else {}))
    record.setdefault("evals", {})[name] = res.summary()
    record.setdefault("eval_items", {})[name] = without_logprobs(res.items)
    oracle_store.passes[(cluster.engine, cluster.topology.name, name)] = \
        oracle.steps_by_index(res.items)
    print(f"{name} on {cluster.topology.name}: {res.summary()}")
    res.check_spec(cluster.spec.accuracy.get(name))
