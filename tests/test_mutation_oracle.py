"""Negative controls for the pass/fail branches of e2e_test/infra/verdicts/oracle.py that a
mutant showed no other unit test caught (docs/mutation.md): the tail bound's median and its
strict excess, both bounds of compare_item given alone, the rank test over nothing, the
window and top-k the records were judged at, each verdict's first line as
scripts/rejudge_oracle.py and the reports read it, and every record field by a round trip
(write, read back, re-judge: the same verdict)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_oracle import _cmp, _control, _healthy_and_shifted, _noisy, _path, seq

from e2e_test.infra.verdicts import oracle
from e2e_test.infra.verdicts.oracle import NoEvidenceError, Step, compare_item

VALIDATION = Path(__file__).resolve().parent.parent / "docs" / "validation"


# -- tail_bound -------------------------------------------------------------------------------

def test_tail_bound_of_a_mostly_zero_control_counts_only_values_above_the_median():
    """Where most first steps are bit-exact (deltas 0), the median is 0 and the tail is the
    mean of the values above it: counting the zeros as excess too made the bound 6x tighter."""
    xs = [0.0] * 40 + [0.05, 0.1, 0.15, 0.2, 0.05, 0.1, 0.15, 0.2]
    m, alpha = 32, 0.001
    mu = sum(x for x in xs if x > 0) / 8
    b = oracle.tail_bound(xs, m, alpha)
    assert b == pytest.approx(mu * math.log(m / (2 * alpha)))
    assert round(b, 3) == 1.210
    th = oracle.Thresholds.from_control(xs, m, alpha)
    assert th.control_median == 0.0 and th.control_mean_excess == pytest.approx(mu)
    assert th.first_step_max == pytest.approx(b) and th.gap_max == pytest.approx(2 * b)


@pytest.mark.parametrize("xs, median", [([1.0, 2.0, 10.0], 2.0), ([1.0, 2.0, 4.0, 10.0], 3.0),
                                        ([5.0], 5.0), ([0.3, 0.1, 0.2, 0.9, 0.5], 0.3)])
def test_tail_bound_median_of_odd_and_even_counts(xs, median):
    excess = [x - median for x in xs if x > median]
    mu = sum(excess) / len(excess) if excess else 0.0
    assert oracle.tail_bound(xs, 10, 0.01) == pytest.approx(
        median + mu * math.log(10 / 0.02))
    th = oracle.Thresholds.from_control(xs, 10, 0.01)
    assert th.control_median == pytest.approx(median) and th.control_n == len(xs)
    assert th.control_max == max(xs) and th.control_mean_excess == pytest.approx(mu)
    assert oracle._median(xs) == pytest.approx(median)


def test_tail_bound_covers_at_least_one_item_and_skips_what_is_not_a_number():
    xs = [0.0, 0.1, 0.3, None, math.inf]
    assert oracle.tail_bound(xs, 0) == oracle.tail_bound(xs, 1) == pytest.approx(
        0.1 + 0.2 * math.log(1 / 0.002))
    with pytest.raises(NoEvidenceError, match="^no first-step deltas to derive a bound from$"):
        oracle.tail_bound([None, math.inf], 4)
    with pytest.raises(NoEvidenceError, match="^the control arm has no first-step delta"):
        oracle.Thresholds.from_control([math.nan], 4)


def test_step_noise_raises_the_bound_and_the_gap_is_twice_it():
    th = oracle.Thresholds.from_control([0.0] * 10, 8, step_deltas=[0.25, None, 0.5, math.inf])
    assert (th.first_step_tail, th.step_noise_max, th.first_step_max, th.gap_max) == (
        0.0, 0.5, 0.5, 1.0)
    th = oracle.Thresholds.from_control([0.0, 1.0], 8, step_deltas=[0.25])
    assert th.first_step_max == th.first_step_tail > 0.25 and th.step_noise_max == 0.25


# -- compare_item and classify ----------------------------------------------------------------

WIDE = (seq("a", "b", top={1: {"c": -2.4}}), seq("a", "c", top={1: {"b": -0.2}}))  # gap 2.3


def test_either_bound_given_alone_is_applied():
    """A 2.3-nat divergence is a mismatch under a gap bound of 1 even with no first-step bound
    given; a first step past its bound is a mismatch with no gap bound given."""
    v = compare_item(0, *WIDE, gap_max=1.0)
    assert v.verdict == "mismatch" and v.gap == pytest.approx(2.3)
    assert v.reason == "token 1: 'b' vs 'c', gap 2.300 nats > 1.000 (not a tie)"
    assert compare_item(0, *WIDE, gap_max=2.3).verdict == "numerics"
    assert compare_item(0, *WIDE).verdict == "numerics"              # structural only
    shifted = [Step("a", -0.5, {"a": -0.5, "x": -3.0})] + seq("b")
    v = compare_item(0, seq("a", "b"), shifted, first_step_max=0.3)
    assert v.verdict == "mismatch"
    assert v.reason == "first-step distribution differs by 0.400 nats (> 0.300)"
    assert compare_item(0, seq("a", "b"), shifted, first_step_max=0.4).verdict == "identical"


def test_classify_at_the_gap_bound_and_its_reasons():
    near = (seq("a", "b", top={1: {"c": -0.6}}), seq("a", "c", top={1: {"b": -0.2}}))
    v = compare_item(3, *near, gap_max=0.5, first_step_max=1.0)
    assert v.verdict == "numerics" and v.reason == ("token 1: near-tie 'b'/'c', gap 0.500 nats "
                                                    "<= 0.500")
    assert compare_item(3, *near, gap_max=0.499, first_step_max=1.0).verdict == "mismatch"
    bound = ([Step("a", -0.1, {"a": -0.1}), Step("b", math.log(0.6), {"b": math.log(0.6)})],
             [Step("a", -0.1, {"a": -0.1}), Step("c", math.log(0.55), {"c": math.log(0.55)})])
    v = compare_item(0, *bound, gap_max=1.0, first_step_max=1.0)
    assert v.reason == ("token 1: near-tie 'b'/'c', gap 0.405 nats (top-k not reported: at "
                        "least) <= 1.000")
    v = compare_item(0, *bound, gap_max=0.1, first_step_max=1.0)
    assert v.reason == ("token 1: 'b' vs 'c', gap at least 0.405 nats > 0.100 (not a tie; top-k "
                        "not reported: a confident token)")
    err = oracle.ItemVerdict(index=0, verdict="error", reason="x")
    assert oracle.classify(err, 0.0, 0.0) is err


def test_the_window_compared_is_64_tokens():
    """WINDOW: a divergence at the 65th token is past the comparison (the requests ask 64
    tokens); one at the 64th is in it."""
    assert oracle.WINDOW == 64
    toks = [f"t{i}" for i in range(70)]
    for at, verdict in ((64, "identical"), (63, "mismatch")):
        cand = list(toks)
        cand[at] = "zz"
        v = compare_item(0, seq(*toks), seq(*cand), gap_max=1.0, first_step_max=1.0)
        assert v.verdict == verdict and v.compared == 64
    assert compare_item(0, seq(*toks), seq(*toks)).compared == 64


def test_the_records_were_judged_at_top_k_5_and_window_64():
    """TOP_K and WINDOW are what every recorded run asked and judged at: a re-judge of those
    records (scripts/rejudge_oracle.py) holds them to the same; a verdict writes both."""
    assert oracle.TOP_K == 5
    seen = set()
    for f in sorted(VALIDATION.glob("*/tests/*kv_corrupt*.json"))[:3]:
        for v in (json.loads(f.read_text()).get("kv_corrupt") or {}).values():
            if isinstance(v, dict) and "thresholds" in v:
                seen.add((v["thresholds"]["top_k"], v["thresholds"]["window"]))
    assert seen == {(oracle.TOP_K, oracle.WINDOW)}
    v = oracle.judge(_noisy(seed=9), _control())
    assert (v.to_dict()["thresholds"]["top_k"], v.to_dict()["thresholds"]["window"]) == (5, 64)


# -- the rank test ----------------------------------------------------------------------------

def test_a_rank_test_over_an_empty_sample_is_an_error():
    for x, y in (([], [1.0]), ([1.0], []), ([], [])):
        with pytest.raises(NoEvidenceError, match="^rank test over an empty sample$"):
            oracle.mann_whitney_greater(x, y)


def test_rank_test_values():
    assert oracle.mann_whitney_greater([1.0] * 4, [1.0] * 4) == (8.0, 1.0)
    u, p = oracle.mann_whitney_greater([5.0, 6.0, 7.0, 8.0], [1.0, 2.0, 3.0, 4.0])
    assert u == 16.0 and p == pytest.approx(0.0152, abs=1e-4)
    u, p = oracle.mann_whitney_greater([1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0])
    assert u == 0.0 and p > 0.99
    u, p = oracle.mann_whitney_greater([1.0, 2.0, 2.0, 9.0], [2.0, 3.0, 3.0, 0.5])
    assert u == 8.0 and p == pytest.approx(0.5 * math.erfc(
        (8.0 - 8 - 0.5) / math.sqrt(16 / 12 * (9 - 30 / 56)) / math.sqrt(2)))


# -- first lines of the verdicts, as scripts and reports read them ----------------------------

def test_each_failed_verdicts_first_line():
    control = _control()
    v = oracle.judge(_cmp(["identical", "mismatch"]), control)
    assert not v.ok and v.message.startswith("t x/1 vs x/1: 1 identical, 0 numerics, 1 mismatch "
                                             "(numerics budget ")
    assert v.message.endswith("; item 1: ")
    assert oracle.verdict_line(v.to_dict()).startswith("FAILED: t x/1 vs x/1: 1 identical")
    c = _cmp(["identical", "identical"])
    c.items.append(oracle.ItemVerdict(index=2, verdict="error", reason="request failed on the "
                                      "candidate"))
    v = oracle.judge(c, control)
    assert not v.ok and v.message.endswith(
        "; 1 of 3 items not compared (item 2: request failed on the candidate): every item "
        "must be compared")
    assert ", 1 errors (not compared)" in v.message
    v = oracle.judge(_cmp(["numerics"] * 20), control)
    assert not v.ok and " numerics > budget " in v.message
    assert v.message.endswith("(control arm 0/40 on the same items)")
    bad = oracle.ControlArm([_cmp(["mismatch"])])
    v = oracle.judge(_cmp(["identical"]), bad)
    assert not v.ok and v.message.endswith("; control arm t x/1 vs x/1: 0 identical, 0 "
                                           "numerics, 1 mismatch: ")


def test_a_passing_verdicts_line_and_its_path_arm_parts():
    control = _control()
    v = oracle.judge(_noisy(seed=9), control)
    assert v.ok and v.message.startswith("t x/1 again vs x/1: 32 identical, 0 numerics, 0 "
                                         "mismatch (numerics budget ")
    assert ", near-tie gap bound " in v.message and "first steps" not in v.message
    line = oracle.verdict_line(v.to_dict())
    assert line.startswith("ok: ") and line.endswith(
        f"; max first-step delta {v.to_dict()['comparison']['max_first_step_delta']} nats")
    healthy, shifted = _healthy_and_shifted(control.thresholds(32))
    deciding = _path(scale=0.1, shift=0.05)
    deciding.decides = True
    v = oracle.judge(shifted, control, path=deciding)
    assert not v.ok and "; first steps shifted against the path arm: p = " in v.message
    assert f" < 0.001 (median {v.path_rank_test['median']} against the arm's " \
           f"{v.path_rank_test['path_median']} nats)" in v.message
    ok = oracle.judge(healthy, control, path=deciding)
    assert ok.ok and ok.message.endswith(f"; first steps against the path arm: p = "
                                         f"{ok.path_rank_test['p']:.2g}")


# -- record round trip: write, read back, re-judge ---------------------------------------------

def _rejudge(record: dict, path_record: dict | None) -> oracle.Verdict:
    rec = json.loads(json.dumps(record))
    return oracle.judge(oracle.Comparison.from_dict(rec["comparison"]),
                        oracle.ControlArm.from_record(rec["control"]),
                        path=oracle.PathArm.from_dict(path_record) if path_record else None)


def _at_record_resolution(*comparisons):
    """First-step deltas as the records keep them (4 decimals), so the live verdict and its
    re-judge see the same numbers."""
    for c in comparisons:
        for it in c.items:
            if it.first_step_delta is not None:
                it.first_step_delta = round(it.first_step_delta, 4)


@pytest.mark.parametrize("case", ["healthy", "shifted", "mismatch", "numerics", "error"])
def test_a_record_rejudges_to_the_same_verdict(case):
    control = _control()
    healthy, shifted = _healthy_and_shifted(control.thresholds(32))
    deciding = _path(scale=0.1, shift=0.05)
    _at_record_resolution(*control.comparisons, healthy, shifted, *deciding.comparisons)
    deciding.decides, deciding.why, deciding.how = True, "measured", "prefix cache"
    cmp = {"healthy": healthy, "shifted": shifted,
           "mismatch": _cmp(["identical", "mismatch"]),
           "numerics": _cmp(["numerics"] * 20),
           "error": _cmp(["identical", "identical"])}[case]
    if case == "error":
        cmp.items.append(oracle.ItemVerdict(index=2, verdict="error", reason="failed"))
    path = deciding if case in ("healthy", "shifted") else None
    live = oracle.judge(cmp, control, path=path)
    rec = live.to_dict()
    again = _rejudge(rec, rec.get("path_arm"))
    assert (again.ok, again.message, again.budget) == (live.ok, live.message, live.budget)
    assert again.to_dict()["comparison"] == rec["comparison"]
    assert again.to_dict()["control"] == rec["control"]
    if path:
        assert rec["path_arm"]["decides"] is True and again.path.decides
        assert (again.path.how, again.path.why) == ("prefix cache", "measured")
        assert again.to_dict()["path_arm"] == rec["path_arm"]
    assert live.ok == (case == "healthy")


def test_item_records_keep_every_field():
    it = oracle.ItemVerdict(index=("gsm8k", 3), verdict="numerics", position=4,
                            tokens=("a", "b"), gap=0.123456, first_step_delta=math.inf,
                            max_step_delta=0.5, compared=5, reason="token 4: near-tie",
                            divergence="top-k", text_only=1)
    d = json.loads(json.dumps(it.to_dict()))
    assert d == {"index": "('gsm8k', 3)", "verdict": "numerics", "position": 4,
                 "tokens": ["a", "b"], "gap": 0.1235, "first_step_delta": "inf",
                 "max_step_delta": 0.5, "compared": 5, "reason": "token 4: near-tie",
                 "divergence": "top-k", "text_only": 1}
    back = oracle.ItemVerdict.from_dict(d)
    assert back == oracle.ItemVerdict(index="('gsm8k', 3)", verdict="numerics", position=4,
                                      tokens=("a", "b"), gap=0.1235,
                                      first_step_delta=math.inf, max_step_delta=0.5,
                                      compared=5, reason="token 4: near-tie",
                                      divergence="top-k", text_only=1)


@pytest.mark.parametrize("reason, extra, div", [
    ("token 1: 'a' vs 'b'; the other side's token is not in the baseline's top-5", {},
     "outside"),
    ("token 2: the candidate stopped, the baseline went on", {}, "stopped"),
    ("token 1: possible near-tie 'a'/'b' (top-k not reported; gap at least 0.1 nats)",
     {"position": 1, "gap": 0.1}, "bound"),
    ("token 1: near-tie 'a'/'b', gap 0.1 nats", {"position": 1, "gap": 0.1}, "top-k"),
    ("token 1: near-tie 'a'/'b', gap 0.1 nats", {"position": 1}, None),
])
def test_an_item_from_before_divergence_was_kept_reads_it_from_its_reason(reason, extra, div):
    d = {"index": 0, "verdict": "numerics", "reason": reason, **extra}
    assert oracle.ItemVerdict.from_dict(d).divergence == div
    assert oracle.ItemVerdict.from_dict(dict(d, verdict="identical")).divergence is None
    assert oracle.ItemVerdict.from_dict(dict(d, divergence="top-k")).divergence == "top-k"


def test_a_control_record_round_trips():
    arm = _control()
    back = oracle.ControlArm.from_record(json.loads(json.dumps(arm.to_dict())))
    assert back.to_dict() == arm.to_dict()
    assert back.thresholds(32).first_step_max == pytest.approx(
        arm.thresholds(32).first_step_max, abs=1e-3)          # records keep 4 decimals
    assert arm.summary()["compared"] == 64 and arm.summary()["numerics"] == 0


def test_rank_test_of_one_value_against_two():
    """Spread below 1 (variance 2/3): still a p-value from the normal approximation."""
    u, p = oracle.mann_whitney_greater([5.0], [1.0, 2.0])
    assert u == 2.0 and p == pytest.approx(0.5 * math.erfc(0.5 / math.sqrt(2 / 3) / math.sqrt(2)))


def test_a_path_rank_exactly_at_alpha_passes():
    """The path arm decides below alpha, not at it."""
    control = _control()
    _, shifted = _healthy_and_shifted(control.thresholds(32))
    deciding = _path(scale=0.1, shift=0.05)
    deciding.decides = True
    p = oracle.judge(shifted, control, path=deciding).path_rank_test["p"]
    v = oracle.judge(shifted, control, alpha=p, path=deciding)
    assert v.path_rank_test["p"] == p and v.path_rank_test["alpha"] == p
    assert v.ok, v.message
    assert not oracle.judge(shifted, control, alpha=p * 1.01, path=deciding).ok
