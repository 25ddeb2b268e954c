"""The comparison oracle's control arm, its negative control, and DP workers against each other.

On the regular topology (`1`): the eval prompts again, a second pass at the same concurrency and
a serial pass, compared token by token with the scored pass of test_evals.py: the control arm,
the noise floor of every comparison in the session (oracle.py says how a budget comes from it).
It must hold no `mismatch` itself, or the engine is noisier than the oracle's thresholds.
Then the negative control: GSM8K asked with other few-shot exemplars must be a `mismatch`.
On DP topologies: the same prompts sent to each worker alone, through a gateway pinned to it
(Cluster.pinned), compared with worker 0, a same-path comparison (its first steps ranked
against the control arm's, deciding); and the pin's negative control.
"""

import pytest

from e2e_test.infra.cluster import reach
from e2e_test.infra.verdicts import comparisons, oracle
from e2e_test.infra.verdicts.evals import recall
from e2e_test.router.test_evals import CONCURRENCY, eval_n, max_prompt_tokens, oracle_pass

# Every other file of e2e_test/router marks its tests e2e; this one did not, so `-m "not e2e"`
# (the unit tests alone) still booted engines for it.
pytestmark = pytest.mark.e2e
EVALS = ["gsm8k", "mmlu"]


def _label(cluster, suffix=""):
    return f"{cluster.engine}/{cluster.topology.name}{suffix}"


def control_arm_pass(cluster, oracle_store, name):
    """test_control_arm's traffic (the oracle's pass where the scored one is not its evidence,
    then a second pass and a serial one), stored as the session's control arm."""
    base = oracle_pass(cluster, oracle_store, name)
    arm = comparisons.control_arm(cluster.gateway_url, cluster.model_name, name, base,
                                  _label(cluster), eval_n(cluster, name), concurrency=CONCURRENCY,
                                  max_prompt_tokens=max_prompt_tokens(cluster, name),
                                  watchdog=cluster.watchdog(f"{name} control arm"),
                                  logprobs=cluster.driver.top_logprobs,
                                  api=cluster.driver.logprobs_api)
    oracle_store.control[(cluster.engine, name)] = arm
    path_arm_pass(cluster, oracle_store, name, comparisons.requests(
        name, cluster.model_name, eval_n(cluster, name),
        max_prompt_tokens=max_prompt_tokens(cluster, name),
        logprobs=cluster.driver.top_logprobs, api=cluster.driver.logprobs_api))
    return arm


def path_arm_pass(cluster, oracle_store, name, reqs):
    """The path arm of `reqs` on this regular topology (Engine.first_step_path_arm), stored
    for the disaggregated comparisons of the session, where the engine has one. Runs after
    the control arm's passes: it resets the worker's prefix cache. Prints nothing: it may
    run ahead in a thread (its test prints it, path_line)."""
    path = cluster.driver.first_step_path_arm(cluster, name, reqs, _label(cluster),
                                              CONCURRENCY,
                                              cluster.watchdog(f"{name} path arm"))
    if path is not None:
        oracle_store.path[(cluster.engine, name)] = path
    return path


def path_line(name, path) -> str:
    return (f"{name} path arm ({'decides' if path.decides else 'recorded'}): "
            f"{'; '.join(c.line() for c in path.comparisons)} ({path.how})")


@pytest.mark.eval
@pytest.mark.topology_kinds("regular")
@pytest.mark.ahead.with_args(control_arm_pass)
@pytest.mark.parametrize("name", EVALS)
def test_control_arm(cluster, record, oracle_store, ahead, name):
    arm = ahead()
    record["oracle_control"] = {name: arm.to_dict()}
    path = oracle_store.path.get((cluster.engine, name))
    if path is not None:
        record["oracle_path_arm"] = {name: path.to_dict()}
        print(path_line(name, path))
    for c in arm.comparisons:
        print(c.line(), f"(max first-step delta {c.summary()['max_first_step_delta']})")
    errors = sum(c.counts()["error"] for c in arm.comparisons)
    assert not errors, f"{name} control arm: {errors} requests failed"
    problems = arm.problems()
    assert not problems, problems[0]


def other_exemplars_pass(cluster, oracle_store):
    """test_oracle_negative_control's traffic: the oracle's GSM8K pass, and GSM8K again with
    other few-shot exemplars."""
    base = oracle_pass(cluster, oracle_store, "gsm8k")
    other = comparisons.eval_pass(cluster.gateway_url, cluster.model_name, "gsm8k",
                                  eval_n(cluster, "gsm8k"), concurrency=CONCURRENCY,
                                  shot_offset=5,
                                  watchdog=cluster.watchdog("gsm8k negative control"),
                                  logprobs=cluster.driver.top_logprobs,
                                  api=cluster.driver.logprobs_api)
    return base, other


@pytest.mark.eval
@pytest.mark.topology_kinds("regular")
@pytest.mark.ahead.with_args(other_exemplars_pass)
def test_oracle_negative_control(cluster, record, oracle_store, ahead):
    """Other few-shot exemplars (train rows 5-9 instead of 0-4) make other prompts: the
    oracle must call that a mismatch, or it cannot fail at all."""
    base, other = ahead()
    # No tokens on either side, or no control arm: an error (NoEvidenceError), never a pass:
    # a negative control over nothing would pass for the wrong reason.
    cmp = oracle.compare("gsm8k", _label(cluster), _label(cluster, " other exemplars"), base, other)
    control = oracle_store.control.get((cluster.engine, "gsm8k"))
    if control is None:
        raise oracle.NoEvidenceError("negative control: no gsm8k control arm of this topology "
                                     "in this session (test_control_arm failed or did not run)")
    verdict = oracle.judge(cmp, control)
    record["oracle_negative_control"] = verdict.to_dict()
    print(verdict.message)
    problems = oracle.negative_control_problems(verdict)
    assert not problems, "; ".join(problems)


@pytest.mark.topology_kinds("dp")
@pytest.mark.needs_baseline
@pytest.mark.parametrize("name", EVALS)
def test_dp_workers_agree(cluster, record, oracle_store, name):
    """Each DP worker, asked alone through a gateway pinned to it (its own endpoint, which
    every worker has, whatever protocol it serves), against worker 0; a single engine with
    internal DP ranks (`dpN-engine`) has one endpoint, so its gateway pass is held against `1`
    instead.
    Both sides compute every step as `1`'s control passes do: the rank test against the
    control arm decides (oracle.judge same_path)."""
    oracle_store.settled(cluster.engine)
    control = oracle_store.control.get((cluster.engine, name))
    if control is None:
        pytest.skip(f"needs the control arm of `1` in this session (select `1` with "
                    f"{cluster.topology.name})")
    n = eval_n(cluster, name)

    def run(url, what):
        return comparisons.eval_pass(url, cluster.model_name, name, n, concurrency=CONCURRENCY,
                                     max_prompt_tokens=max_prompt_tokens(cluster, name),
                                     watchdog=cluster.watchdog(f"{name} on {what}"),
                                     logprobs=cluster.driver.top_logprobs,
                                     api=cluster.driver.logprobs_api)

    def alone(w):
        with cluster.pinned(w.name) as g:
            return w.name, run(g.url, w.name)

    if len(cluster.workers) > 1:
        (base_label, base), *others = [alone(w) for w in cluster.workers]
    else:
        base_label = f"{cluster.engine}/1"
        base = oracle_store.passes.get((cluster.engine, "1", name))
        if base is None:
            pytest.skip("needs the eval pass of `1` in this session")
        others = [(_label(cluster), run(cluster.gateway_url, "the gateway"))]
    verdicts = [oracle.judge(oracle.compare(name, base_label, label, base, p), control,
                             same_path=True)
                for label, p in others]
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


RECALL_N = 8


def recall_baseline_pass(cluster, oracle_store):
    """test_kv_recall_baseline's traffic: the recall prompts on `1`, then their control arm;
    stored as the session's recall baseline (the codes every pass copied)."""
    texts: dict = {}
    reqs = comparisons.requests("recall", cluster.model_name, RECALL_N,
                                logprobs=cluster.driver.top_logprobs,
                                api=cluster.driver.logprobs_api)
    base = comparisons.run_pass(cluster.gateway_url, reqs, CONCURRENCY, texts=texts,
                                watchdog=cluster.watchdog("recall"))
    control_texts: list = []
    arm = comparisons.control_arm(cluster.gateway_url, cluster.model_name, "recall", base,
                                  _label(cluster), RECALL_N, concurrency=CONCURRENCY,
                                  watchdog=cluster.watchdog("recall control arm"),
                                  logprobs=cluster.driver.top_logprobs,
                                  api=cluster.driver.logprobs_api, texts=control_texts)
    # The codes required of a disaggregated topology: those `1` copied in its baseline and in
    # every control pass (recall.stable_codes); one it copies only sometimes is a near-tie on
    # `1` itself, not a KV test.
    copied, unstable = recall.stable_codes(texts, control_texts)
    oracle_store.passes[(cluster.engine, cluster.topology.name, "recall")] = base
    oracle_store.control[(cluster.engine, "recall")] = arm
    path = path_arm_pass(cluster, oracle_store, "recall", reqs)
    oracle_store.recall[(cluster.engine, cluster.topology.name)] = copied
    return {"texts": texts, "control_texts": control_texts, "arm": arm, "copied": copied,
            "unstable": unstable, "prompt_words": len(comparisons.prompt_text(reqs[0]).split()),
            "path": path}


@pytest.mark.eval
@pytest.mark.topology_kinds("regular")
@pytest.mark.ahead.with_args(recall_baseline_pass)
def test_kv_recall_baseline(cluster, record, ahead):
    """A ~2k-token prompt hiding a pass code (evals/recall.py), on `1`: how reliably the model
    copies it, and the control arm of these long prompts. test_pd.py then requires every code
    that `1` reproduced of the disaggregated topology, whose decode sees the code only in the
    transferred KV."""
    got = ahead()
    texts, control_texts, arm = got["texts"], got["control_texts"], got["arm"]
    copied, unstable = got["copied"], got["unstable"]
    record["kv_recall"] = {"copied": copied, "unstable": unstable, "of": RECALL_N,
                           "outputs": texts, "control_outputs": control_texts,
                           "prompt_words": got["prompt_words"], "control": arm.to_dict(),
                           **({"path_arm": got["path"].to_dict()} if got.get("path") else {})}
    print(f"recall on {cluster.topology.name}: {len(copied)}/{RECALL_N} pass codes copied in "
          f"every pass" + (f" (copied in the baseline only: {unstable})" if unstable else "")
          + "; " + "; ".join(c.line() for c in arm.comparisons))
    if got.get("path"):
        print(path_line("recall", got["path"]))
    assert len(texts) == RECALL_N, f"{RECALL_N - len(texts)} recall requests failed"
    assert not arm.problems(), arm.problems()[0]
    # a baseline that copied no code (mid-text or in the last block) cannot test a topology
    recall.recall_problems(copied, copied, RECALL_N, cluster.topology.name)
