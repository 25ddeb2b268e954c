"""GSM8K and MMLU through the gateway on every selected topology.

n and the floors (accuracy, format) come from the model's registry entry (E2E_GSM8K_N /
E2E_MMLU_N override n). Every item's greedy tokens with their top-k logprobs are kept for the
comparison oracle (infra/verdicts/baseline.py: the topology's own pass, which test_pd.py
judges, and on `1` the baseline's).
Transport and HTTP errors are counted apart; above 2% of n they fail the test.
"""

import pytest

from e2e_test.infra.verdicts import baseline as evidence
from e2e_test.infra.verdicts.evals import without_logprobs

pytestmark = [pytest.mark.e2e, pytest.mark.eval]


@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
def test_eval(eval_data, cluster, record, name):
    res = evidence.scored_pass(cluster, name)
    record.setdefault("evals", {})[name] = res.summary()
    record.setdefault("eval_items", {})[name] = without_logprobs(res.items)
    print(f"{name} on {cluster.topology.name}: {res.summary()}")
    res.check_spec(cluster.spec.accuracy.get(name))
