"""The comparison oracle's control arm, its negative control, and DP workers against each other.

On the regular topology (`1`): the eval prompts again, a second pass at the same concurrency and
a serial pass, compared token by token with the scored pass: the control arm, the noise floor
of every comparison judged against `1` (oracle.py says how a budget comes from it;
infra/verdicts/baseline.py measures it once per session). It must hold no `mismatch` itself,
or the engine is noisier than the oracle's thresholds.
Then the negative control: GSM8K asked with other few-shot exemplars must be a `mismatch`.
On DP topologies: the same prompts sent to each worker alone, through a gateway pinned to it
(Cluster.pinned), compared with worker 0, a same-path comparison (its first steps ranked
against the control arm's, deciding); and the pin's negative control.
"""

import pytest

from e2e_test.infra.cluster import reach
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.baseline import (
    CONCURRENCY,
    RECALL_N,
    eval_n,
    label,
    max_prompt_tokens,
)
from e2e_test.infra.verdicts.evals import recall

# Every other file of e2e_test/router marks its tests e2e; this one did not, so `-m "not e2e"`
# (the unit tests alone) still booted engines for it.
pytestmark = pytest.mark.e2e
EVALS = ["gsm8k", "mmlu"]


def path_line(name, path) -> str:
    return (f"{name} path arm ({'decides' if path.decides else 'recorded'}): "
            f"{'; '.join(c.line() for c in path.comparisons)} ({path.how})")


@pytest.mark.eval
@pytest.mark.topology_kinds("regular")
@pytest.mark.baseline("name")
@pytest.mark.parametrize("name", EVALS)
def test_control_arm(baseline, cluster, record, name):
    ev = baseline(name)
    arm = ev.control
    record["oracle_control"] = {name: arm.to_dict()}
    if ev.path is not None:
        record["oracle_path_arm"] = {name: ev.path.to_dict()}
        print(path_line(name, ev.path))
    for c in arm.comparisons:
        print(c.line(), f"(max first-step delta {c.summary()['max_first_step_delta']})")
    errors = sum(c.counts()["error"] for c in arm.comparisons)
    assert not errors, f"{name} control arm: {errors} requests failed"
    problems = arm.problems()
    assert not problems, problems[0]
    # The session's item count against what its own control arm needs (docs/accuracy.md,
    # "Items per pass"): from how many items the numerics count can fail at all, and from how
    # many it catches a change of CAUGHT_SHARE of the items (None: not on these). Recorded,
    # not asserted: the shuffle check's nested session asks 4 items, on which it cannot.
    order = sorted(ev.passes)
    can_fail = oracle.items_for_a_count(arm, order)
    caught = oracle.items_for_a_count(arm, order, share=oracle.CAUGHT_SHARE, miss=oracle.MISS)
    record["oracle_items"] = {name: {"n": len(order), "can_fail_from": can_fail,
                                     "caught_from": caught}}
    print(f"{name}: {len(order)} items; the numerics count can fail from {can_fail}, catches a "
          f"change of {oracle.CAUGHT_SHARE:.0%} of the items from {caught}")


@pytest.mark.eval
@pytest.mark.topology_kinds("regular")
@pytest.mark.baseline("gsm8k")
def test_oracle_negative_control(baseline, cluster, record):
    """Other few-shot exemplars (train rows 5-9 instead of 0-4) make other prompts: the
    oracle must call that a mismatch, or it cannot fail at all."""
    ev = baseline("gsm8k")
    other = comparisons.eval_pass(cluster.gateway_url, cluster.model_name, "gsm8k",
                                  eval_n(cluster, "gsm8k"), concurrency=CONCURRENCY,
                                  shot_offset=5,
                                  watchdog=cluster.watchdog("gsm8k negative control"),
                                  logprobs=cluster.driver.top_logprobs,
                                  api=cluster.driver.logprobs_api)
    # No tokens on either side: an error (NoEvidenceError), never a pass: a negative control
    # over nothing would pass for the wrong reason.
    cmp = oracle.compare("gsm8k", ev.label, label(cluster, " other exemplars"), ev.passes,
                         other)
    verdict = oracle.judge(cmp, ev.control)
    record["oracle_negative_control"] = verdict.to_dict()
    print(verdict.message)
    problems = oracle.negative_control_problems(verdict)
    assert not problems, "; ".join(problems)


@pytest.mark.topology_kinds("dp")
@pytest.mark.baseline("name")
@pytest.mark.parametrize("name", EVALS)
def test_dp_workers_agree(baseline, cluster, record, name):
    """Each DP worker, asked alone through a gateway pinned to it (its own endpoint, which
    every worker has, whatever protocol it serves), against worker 0; a single engine with
    internal DP ranks (`dpN-engine`) has one endpoint, so its gateway pass is held against `1`
    instead.
    Both sides compute every step as `1`'s control passes do: the rank test against the
    control arm decides (oracle.judge same_path)."""
    n = eval_n(cluster, name)

    def run(url, what, prime=True):
        # Every side from a reset prefix cache, primed: its first prompt alone computes the
        # few-shot prefix that every other item reuses (comparisons.run_pass). Without both,
        # each worker's prefix KV is whatever its earlier traffic or its first batch made of
        # it, and every item of one side shifts alike (docs/accuracy.md, "One prefix for the
        # whole pass").
        cluster.driver.forget_received_kv(cluster)
        return comparisons.eval_pass(url, cluster.model_name, name, n, concurrency=CONCURRENCY,
                                     max_prompt_tokens=max_prompt_tokens(cluster, name),
                                     watchdog=cluster.watchdog(f"{name} on {what}"),
                                     logprobs=cluster.driver.top_logprobs,
                                     api=cluster.driver.logprobs_api, prime=prime)

    def alone(w):
        with cluster.pinned(w.name) as g:
            return w.name, run(g.url, w.name)

    if len(cluster.workers) > 1:
        (base_label, base), *others = [alone(w) for w in cluster.workers]
        ev = baseline(name)
    else:
        # against `1`'s scored pass, which was not primed: as that pass was run
        others = [(label(cluster), run(cluster.gateway_url, "the gateway", prime=False))]
        ev = baseline(name)
        base_label, base = ev.label, ev.passes
    verdicts = [oracle.judge(oracle.compare(name, base_label, lab, base, p), ev.control,
                             same_path=True)
                for lab, p in others]
    record["oracle_dp"] = {name: [v.to_dict() for v in verdicts]}
    for v in verdicts:
        print(v.message)
    bad = [v.message for v in verdicts if not v.ok]
    assert not bad, bad[0]


PIN_PER_WORKER = 2      # chat completions per worker in each pass of the pin's control


@pytest.mark.topology_kinds("dp")
def test_pinned_gateway_reaches_one_worker(cluster, record):
    """The negative control of test_dp_workers_agree's path: through a gateway pinned to
    worker 0 only worker 0 works (each worker's own work counters); the same requests through
    the topology's own gateway move every worker's, so the measurement would see a pin that
    leaks."""
    if len(cluster.workers) < 2:
        pytest.skip("one worker (internal DP ranks): nothing to pin apart")
    first, names = cluster.workers[0].name, [w.name for w in cluster.workers]
    n = PIN_PER_WORKER * len(names)     # round robin: every worker gets some
    with cluster.pinned(first) as g:
        pinned = reach.work_moved(cluster, g.url, n, expect=[first])
    unpinned = reach.work_moved(cluster, cluster.gateway_url, n, expect=names)
    record["pin"] = {"worker": first, "pinned": pinned, "unpinned": unpinned}
    print(f"pinned to {first}: work {pinned}; unpinned: work {unpinned}")
    problems = reach.pin_problems(first, pinned, unpinned)
    assert not problems, "; ".join(problems)


@pytest.mark.eval
@pytest.mark.topology_kinds("regular")
@pytest.mark.baseline("recall")
def test_kv_recall_baseline(baseline, cluster, record):
    """A ~2k-token prompt hiding a pass code (evals/recall.py), on `1`: how reliably the model
    copies it, and the control arm of these long prompts. test_pd.py then requires every code
    that `1` reproduced of the disaggregated topology, whose decode sees the code only in the
    transferred KV."""
    ev = baseline("recall")
    got, arm = ev.recall, ev.control
    texts, control_texts = got["texts"], got["control_texts"]
    copied, unstable = got["copied"], got["unstable"]
    record["kv_recall"] = {"copied": copied, "unstable": unstable, "of": RECALL_N,
                           "outputs": texts, "control_outputs": control_texts,
                           "prompt_words": got["prompt_words"], "control": arm.to_dict(),
                           **({"path_arm": ev.path.to_dict()} if ev.path else {})}
    print(f"recall on {cluster.topology.name}: {len(copied)}/{RECALL_N} pass codes copied in "
          f"every pass" + (f" (copied in the baseline only: {unstable})" if unstable else "")
          + "; " + "; ".join(c.line() for c in arm.comparisons))
    if ev.path:
        print(path_line("recall", ev.path))
    assert len(texts) == RECALL_N, f"{RECALL_N - len(texts)} recall requests failed"
    assert not arm.problems(), arm.problems()[0]
    # a baseline that copied no code (mid-text or in the last block) cannot test a topology
    recall.recall_problems(copied, copied, RECALL_N, cluster.topology.name)

