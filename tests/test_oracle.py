"""The comparison oracle on synthetic logprob sequences: it says `mismatch` where it must."""

import math

import pytest

from e2e_test.infra import oracle
from e2e_test.infra.oracle import Step, compare_item
from e2e_test.infra.stats import wilson_upper


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
    v = compare_item(0, a, b)
    assert v.verdict == "mismatch" and v.gap == pytest.approx(1.9)


def sampled_only(*pairs):
    """Steps of an engine that reports only the sampled token's logprob (top-k 0)."""
    return [Step(t, lp, {t: lp}) for t, lp in pairs]


def test_top_k_zero_bounds_the_gap_from_the_sampled_logprob():
    # p = 0.55 and 0.5 on the two sides: another token may be within logit(0.55) = 0.2 nats
    a = sampled_only(("a", -0.1), ("b", math.log(0.55)))
    b = sampled_only(("a", -0.1), ("c", math.log(0.5)))
    v = compare_item(0, a, b)
    assert v.verdict == "numerics" and v.gap == pytest.approx(math.log(0.55 / 0.45))
    assert v.first_step_delta == 0.0


def test_top_k_zero_confident_divergence_is_mismatch():
    # p = 0.95 on the baseline: any other token is at least logit(0.95) = 2.9 nats behind
    a = sampled_only(("a", -0.1), ("b", math.log(0.95)))
    b = sampled_only(("a", -0.1), ("c", math.log(0.5)))
    v = compare_item(0, a, b)
    assert v.verdict == "mismatch" and "confident" in v.reason


def test_top_k_zero_first_step_shift_of_the_same_token_is_mismatch():
    a = sampled_only(("a", -0.1), ("b", -0.1))
    b = sampled_only(("a", -2.5), ("b", -0.1))
    v = compare_item(0, a, b)
    assert v.verdict == "mismatch" and v.first_step_delta == pytest.approx(2.4)


def test_top_k_zero_divergence_at_the_first_token_has_no_first_step_delta():
    v = compare_item(0, sampled_only(("a", math.log(0.5))), sampled_only(("b", math.log(0.5))))
    assert v.verdict == "numerics" and v.first_step_delta is None


def test_first_step_divergence_is_mismatch_when_tokens_agree():
    a = seq("a", "b", top={0: {"x": -3.0}})
    b = seq("a", "b", top={0: {"x": -0.5}})          # same greedy token, x moved 2.5 nats
    v = compare_item(0, a, b)
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


def test_empty_side_is_mismatch():
    assert compare_item(0, [], seq("a")).verdict == "mismatch"


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


def _cmp(verdicts, name="t"):
    c = oracle.Comparison(name, "x/1", "x/1")
    c.items = [oracle.ItemVerdict(index=i, verdict=v) for i, v in enumerate(verdicts)]
    return c


def test_budget_comes_from_the_control_arm():
    quiet = oracle.ControlArm([_cmp(["identical"] * 32), _cmp(["identical"] * 32)])
    noisy = oracle.ControlArm([_cmp(["numerics"] * 4 + ["identical"] * 12)])
    assert quiet.budget(32) < noisy.budget(32)
    assert quiet.budget(32) == math.ceil(32 * wilson_upper(0, 64))
    assert wilson_upper(0, 64) < 0.1 < wilson_upper(4, 16)


def test_judge_fails_on_mismatch_numerics_over_budget_and_bad_control():
    control = oracle.ControlArm([_cmp(["identical"] * 32)])
    assert oracle.judge(_cmp(["identical"] * 32), control).ok
    bad = _cmp(["identical"] * 31 + ["mismatch"])
    bad.items[-1].reason = "token 0: 'a' vs 'b'"
    v = oracle.judge(bad, control)
    assert not v.ok and "item 31" in v.message
    budget = control.budget(32)
    v = oracle.judge(_cmp(["numerics"] * (budget + 1) + ["identical"] * (31 - budget)), control)
    assert not v.ok and "> budget" in v.message
    assert oracle.judge(_cmp(["numerics"] * budget + ["identical"] * (32 - budget)), control).ok
    broken_control = oracle.ControlArm([bad])
    assert not oracle.judge(_cmp(["identical"] * 32), broken_control).ok
    assert not oracle.judge(_cmp(["identical"] * 32), oracle.ControlArm()).ok
    assert not oracle.judge(_cmp(["error"] * 4), control).ok


def test_compare_marks_errors_apart():
    s = seq("a")
    c = oracle.compare("t", "a", "b", {0: s, 1: None, 2: s}, {0: s, 1: s, 2: None, 3: s})
    assert c.counts() == {"identical": 1, "numerics": 0, "mismatch": 0, "error": 2}
    assert c.compared == 1
