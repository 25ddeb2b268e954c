"""GSM8K and MMLU through the gateway on every selected topology.

n and the floor come from the model's registry entry (E2E_GSM8K_N / E2E_MMLU_N override n).
Transport and HTTP errors are counted apart; above 2% of n they fail the test.
"""

import pytest

from e2e_test.infra import settings
from e2e_test.infra.evals import gsm8k, mmlu

pytestmark = [pytest.mark.e2e, pytest.mark.eval]
CONCURRENCY = settings.get("E2E_EVAL_CONCURRENCY")


def _n_floor(cluster, name):
    acc = cluster.spec.accuracy.get(name)
    n = settings.get(f"E2E_{name.upper()}_N") or (acc.n if acc else 32)
    return n, (acc.floor if acc else None)


@pytest.mark.parametrize("name,module", [("gsm8k", gsm8k), ("mmlu", mmlu)], ids=["gsm8k", "mmlu"])
def test_eval(eval_data, cluster, record, request, name, module):
    n, floor = _n_floor(cluster, name)
    res = module.run(cluster.gateway_url, cluster.model_name, n=n, concurrency=CONCURRENCY,
                     watchdog=cluster.watchdog(name),
                     **({"max_prompt_tokens": (cluster.spec.max_model_len or 4096) - 8}
                        if name == "mmlu" else {}))
    record.setdefault("evals", {})[name] = res.summary()
    record.setdefault("eval_items", {})[name] = res.items
    store = request.config.__dict__.setdefault("_e2e_eval_items", {})
    store[(cluster.engine, cluster.topology.name, name)] = res.items
    print(f"{name} on {cluster.topology.name}: {res.summary()}")
    res.check(floor=floor)
