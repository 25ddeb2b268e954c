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
from test_oracle import _cmp, _control, _healthy_and_shifted, _noisy, _path, _tripled, seq

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
                        path=oracle.PathArm.from_dict(path_record) if path_record else None,
                        same_path="same_path_rank_test" in rec)


def _at_record_resolution(*comparisons):
    """First-step deltas as the records keep them (4 decimals), so the live verdict and its
    re-judge see the same numbers."""
    for c in comparisons:
        for it in c.items:
            if it.first_step_delta is not None:
                it.first_step_delta = round(it.first_step_delta, 4)


@pytest.mark.parametrize("case", ["healthy", "shifted", "mismatch", "numerics", "error",
                                  "same_healthy", "same_tripled"])
def test_a_record_rejudges_to_the_same_verdict(case):
    control = _control()
    healthy, shifted = _healthy_and_shifted(control.thresholds(32))
    tripled = _tripled(control.thresholds(32))
    deciding = _path(scale=0.1, shift=0.05)
    _at_record_resolution(*control.comparisons, healthy, shifted, tripled,
                          *deciding.comparisons)
    deciding.decides, deciding.why, deciding.how = True, "measured", "prefix cache"
    cmp = {"healthy": healthy, "shifted": shifted,
           "mismatch": _cmp(["identical", "mismatch"]),
           "numerics": _cmp(["numerics"] * 20),
           "error": _cmp(["identical", "identical"]),
           "same_healthy": _noisy(seed=5), "same_tripled": tripled}[case]
    if case == "error":
        cmp.items.append(oracle.ItemVerdict(index=2, verdict="error", reason="failed"))
    path = deciding if case in ("healthy", "shifted") else None
    same = case.startswith("same_")
    live = oracle.judge(cmp, control, path=path, same_path=same)
    rec = live.to_dict()
    again = _rejudge(rec, rec.get("path_arm"))
    assert (again.ok, again.message, again.budget) == (live.ok, live.message, live.budget)
    assert again.to_dict()["comparison"] == rec["comparison"]
    assert again.to_dict()["control"] == rec["control"]
    if path:
        assert rec["path_arm"]["decides"] is True and again.path.decides
        assert (again.path.how, again.path.why) == ("prefix cache", "measured")
        assert again.to_dict()["path_arm"] == rec["path_arm"]
    if same:
        assert again.to_dict()["same_path_rank_test"] == rec["same_path_rank_test"]
    assert ("same_path_rank_test" in rec) == same
    assert live.ok == (case in ("healthy", "same_healthy"))


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


# -- the same-path rank test --------------------------------------------------------------------

def test_a_same_path_rank_exactly_at_alpha_passes():
    """The same-path rank test decides below alpha, not at it, at the alpha judge was given."""
    control = _control()
    tripled = _tripled(control.thresholds(32))
    p = oracle.judge(tripled, control, same_path=True).same_path_rank_test["p"]
    v = oracle.judge(tripled, control, alpha=p, same_path=True)
    assert v.same_path_rank_test["p"] == p and v.same_path_rank_test["alpha"] == p
    assert v.ok, v.message
    assert not oracle.judge(tripled, control, alpha=p * 1.01, same_path=True).ok


def test_the_same_path_verdicts_lines():
    """The reason a same-path verdict fails with (p, both medians, a control pass left out)
    and the part a passing one adds; a comparison across paths has neither."""
    control = _control()
    tripled = _tripled(control.thresholds(32))
    v = oracle.judge(tripled, control, same_path=True)
    s = v.same_path_rank_test
    assert not v.ok and v.message.endswith(
        f" nats); first steps shifted against the control arm (same path): p = {s['p']:.2g} "
        f"< 0.001 (median {s['median']} against the control's {s['control_median']} nats)")
    ok = oracle.judge(_noisy(seed=5), control, same_path=True)
    assert ok.ok and ok.message.endswith(
        f" nats); first steps against the control arm (same path): p = "
        f"{ok.same_path_rank_test['p']:.2g}")
    assert ok.to_dict()["same_path_rank_test"] == ok.same_path_rank_test
    plain = oracle.judge(_noisy(seed=5), control)
    assert plain.ok and "same path" not in plain.message
    assert "same_path_rank_test" not in plain.to_dict() and plain.same_path_rank_test is None
    exact = oracle.Comparison("t", "x/1", "x/1 second pass", [
        oracle.ItemVerdict(index=i, verdict="identical", first_step_delta=0.0)
        for i in range(32)])
    serial = _noisy(seed=1)
    serial.b = "x/1 serial"
    mixed = oracle.ControlArm([exact, serial])
    v = oracle.judge(_tripled(mixed.thresholds(32)), mixed, same_path=True)
    s = v.same_path_rank_test
    assert not v.ok and v.message.endswith(
        f"; first steps shifted against the control arm (same path): p = {s['p']:.2g} < 0.001 "
        f"(median {s['median']} against the control's {s['control_median']} nats; its quieter "
        f"pass x/1 second pass left out)")
    again = oracle.Comparison("t", "x/1", "x/1 third pass", exact.items)
    three = oracle.ControlArm([exact, serial, again])
    v = oracle.judge(_tripled(three.thresholds(32)), three, same_path=True)
    assert not v.ok and v.message.endswith(
        " nats; its quieter pass x/1 second pass left out; its quieter pass x/1 third pass "
        "left out)")


def test_same_path_and_a_path_arm_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        oracle.judge(_noisy(seed=5), _control(), path=_path(), same_path=True)
    assert str(e.value) == ("t x/1 again vs x/1: same_path and a path arm: a comparison takes "
                            "the control's path or another")
    assert oracle.judge(_noisy(seed=5), _control(), path=_path()).same_path_rank_test is None


def test_a_same_path_candidate_without_a_first_step_delta_is_not_ranked():
    """No first-step delta on the candidate (top-k 0 and every first token differs): nothing to
    rank; the other verdicts stand."""
    cand = _cmp(["identical"] * 4, fs=None)
    v = oracle.judge(cand, _control(), same_path=True)
    assert v.ok and v.same_path_rank_test is None and "same path" not in v.message


def _deltas(name, values):
    return oracle.Comparison("t", "x/1", name, [
        oracle.ItemVerdict(index=i, verdict="identical", first_step_delta=x)
        for i, x in enumerate(values)])


def test_same_path_rank_record():
    """Every field of the record; medians at 4 decimals (0.10005 is 0.1)."""
    control = oracle.ControlArm([_deltas("x/1 again", [0.1, 0.1001]),
                                 _deltas("x/1 serial", [0.1, 0.1001, None])])
    got = oracle.same_path_rank([0.2, 0.2001], control, alpha=0.01)
    u, p = oracle.mann_whitney_greater([0.2, 0.2001], [0.1, 0.1001, 0.1, 0.1001])
    assert got == {"u": u, "p": float(f"{p:.4g}"), "alpha": 0.01, "n": 2, "control_n": 4,
                   "median": round(0.20005, 4), "control_median": round(0.10005, 4),
                   "against": ["x/1 again", "x/1 serial"], "left_out": []}
    assert got["median"] != 0.20005 and got["control_median"] != 0.10005


def test_same_path_rank_holds_the_noisiest_pass_by_median_not_by_name_or_order():
    """The noisiest pass (by median) decides which passes are held; a pass it ranks above at
    p < alpha is left out with that p, one level with it (p >= alpha) is held; a pass with no
    first-step delta is skipped."""
    noisy = _noisy(seed=1, scale=0.1)
    noisy.b = "x/1 a"
    exact = _deltas("x/1 b", [0.0] * 32)
    empty = _deltas("x/1 c", [None] * 4)
    control = oracle.ControlArm([exact, empty, noisy])
    got = oracle.same_path_rank([0.05] * 8, control)
    apart = oracle.mann_whitney_greater(oracle._finite(noisy.first_step_deltas()), [0.0] * 32)[1]
    assert got["against"] == ["x/1 a"] and got["control_n"] == 32
    assert got["left_out"] == [{"pass": "x/1 b", "p": float(f"{apart:.4g}")}]
    # at exactly the p that set it apart, the quieter pass is held
    got = oracle.same_path_rank([0.05] * 8, control, alpha=apart)
    assert got["against"] == ["x/1 b", "x/1 a"] and got["left_out"] == []
    with pytest.raises(NoEvidenceError) as e:
        oracle.same_path_rank([0.1], oracle.ControlArm([empty]))
    assert str(e.value) == ("no control pass has a first-step delta: nothing to rank a "
                            "same-path candidate against")


# -- old records, control arm problems, evidence ------------------------------------------------

def test_an_old_item_record_reads_its_defaults_and_a_mismatch_its_divergence():
    it = oracle.ItemVerdict.from_dict({"index": 0, "verdict": "mismatch", "reason":
                                       "token 1: 'a' vs 'b'; the other side's token is not in "
                                       "the baseline's top-5"})
    assert (it.compared, it.text_only, it.divergence) == (0, 0, "outside")
    arm = oracle.PathArm.from_dict({"comparisons": []})
    assert (arm.how, arm.decides, arm.why) == ("", False, "")


def test_control_arm_problems_say_what_is_wrong():
    assert oracle.ControlArm().problems() == ["no control arm ran"]
    failed = oracle.Comparison("t", "v/1", "v/1 again", [
        oracle.ItemVerdict(index=0, verdict="error", reason="request failed on both sides")])
    assert oracle.ControlArm([failed]).problems() == [
        ("no control arm compared anything in this session: the oracle's bounds cannot be "
         "derived")]
    with pytest.raises(NoEvidenceError, match="^no control arm compared anything in this "
                                              "session: the oracle's bounds cannot be derived$"):
        oracle.ControlArm([failed]).thresholds(4)
    mixed = oracle.Comparison("t", "v/1", "v/1 serial", [
        oracle.ItemVerdict(index=0, verdict="identical", first_step_delta=0.0),
        oracle.ItemVerdict(index=1, verdict="error", reason="request failed on the candidate")])
    assert oracle.ControlArm([mixed]).problems() == [
        ("control arm t v/1 serial vs v/1: 1 identical, 0 numerics, 0 mismatch, 1 errors (not "
         "compared): request failed on the candidate")]
    assert oracle.ControlArm([_noisy()]).thresholds(8, alpha=0.01).alpha == 0.01


def test_max_gap_is_over_numerics_only():
    c = _cmp(["numerics", "mismatch", "identical"])
    c.items[0].gap, c.items[1].gap = 0.2, 3.0
    assert c.max_gap() == 0.2
    assert _cmp(["identical"]).max_gap() is None


@pytest.mark.parametrize("base, cand, side", [([], [], "either side"),
                                              ([], seq("a"), "the baseline"),
                                              (seq("a"), [], "the candidate")])
def test_an_item_without_tokens_names_the_side(base, cand, side):
    with pytest.raises(NoEvidenceError, match=f"^item 4: no tokens on {side}$"):
        compare_item(4, base, cand)


def _with_lead(base_steps, cand_steps, lead):
    a, b = oracle.Pass({0: base_steps}), oracle.Pass({0: cand_steps})
    b.lead[0] = lead
    return a, b


def test_positions_after_a_lead_count_the_leads_tokens():
    """A divergence after tokens matched by text alone is at its answer position, its reason
    rewritten to it, whatever the tokens hold (a ":" too)."""
    base = seq("Hel", "lo", " a:b", top={2: {" c:d": -0.2}})
    cand = seq(" c:d", top={0: {" a:b": -0.25}})
    a, b = _with_lead(base, cand, "Hello")
    (it,) = oracle.compare("t", "v/1", "v/1p1d", a, b).items
    assert (it.position, it.compared, it.text_only) == (2, 3, 2)
    assert it.reason == "token 2: near-tie ' a:b'/' c:d', gap 0.150 nats"
    shifted = [Step(" x", -0.6, {" x": -0.6, "q": -3.0}), Step("y", -0.1, {"y": -0.1, "z": -0.2})]
    base = seq("Hel", "lo", " x", "z", top={3: {"y": -0.3}})
    a, b = _with_lead(base, shifted, "Hello")
    (it,) = oracle.compare("t", "v/1", "v/1p1d", a, b, gap_max=1.0, first_step_max=0.1).items
    assert it.verdict == "mismatch" and it.position == 3
    assert it.reason.startswith("first-step distribution differs by 0.500 nats (> 0.100); "
                                "token 3: near-tie 'z'/'y'")


def test_small_pieces_of_the_item_comparison():
    assert math.isfinite(oracle._logit_floor(0.0)) and oracle._logit_floor(0.0) > 27
    # the chosen token counts among a step's reported ones even where top-k omits it
    a, b = Step("a", -0.1, {"x": -2.0}), Step("a", -0.5, {"x": -2.0})
    assert oracle.first_step_delta(a, b) == pytest.approx(0.4)
    # no shared token, and only one side reported alternatives: unknown, not infinite
    assert oracle.first_step_delta(Step("a", -0.1, {"a": -0.1, "x": -2.0}),
                                   Step("b", -0.2, {"b": -0.2})) is None
    inf = Step("a", -math.inf, {})
    assert oracle.step_delta(inf, inf) is None
    v = compare_item(0, [Step("a", -0.1, {"a": -0.1, "x": -1})] + seq("b"),
                     [Step("q", -0.1, {"q": -0.1, "w": -1})] + seq("b"))
    assert v.reason == ("first-step top-k sets share no token; token 0: 'a' vs 'q'; the other "
                        "side's token is not in the baseline's top-2")
    v = compare_item(0, [Step("a", -0.1, {"a": -0.1, "x": -1})],
                     [Step("a", -0.1, {"a": -0.1, "w": -1})])
    assert v.verdict == "identical"
    v = compare_item(0, [Step("a", -0.1, {"x": -1})], [Step("b", -0.1, {"w": -1})])
    assert v.reason == "first-step top-k sets share no token; token 0: 'a' vs 'b'; the other " \
                       "side's token is not in the baseline's top-1"
    only = compare_item(0, [Step("a", -0.1, {"a": -0.1, "x": -1})],
                        [Step("q", -0.1, {"q": -0.1, "w": -1})], window=0)
    assert only.reason == "first-step top-k sets share no token"


def test_a_longer_answer_past_the_window_is_no_stop():
    toks = [f"t{i}" for i in range(65)]
    v = compare_item(0, seq(*toks), seq(*toks[:64]), window=64)
    assert v.verdict == "identical" and v.compared == 64


def test_classify_keeps_a_mismatchs_reason_and_adds_a_first_step_excess_to_a_tie():
    wide = compare_item(0, seq("a", "b", top={1: {"c": -2.5}}), seq("a", "c", top={1: {"b": -2.5}}))
    wide.first_step_delta = 0.9
    assert oracle.classify(wide, 0.5, 0.1).reason == (
        "token 1: 'b' vs 'c', gap 2.400 nats > 0.500 (not a tie)")
    tie = compare_item(0, seq("a", "b", top={1: {"c": -0.2}}), seq("a", "c", top={1: {"b": -0.2}}))
    tie.first_step_delta = 0.9
    assert oracle.classify(tie, 0.5, 0.1).reason == (
        "first-step distribution differs by 0.900 nats (> 0.100); token 1: near-tie 'b'/'c', "
        "gap 0.100 nats <= 0.500")


def _p(items: dict, texts: dict | None = None, other=True) -> oracle.Pass:
    """A pass from {index: steps}, read against `texts` like add_answer."""
    p = oracle.Pass()
    for i, st in items.items():
        oracle.add_answer(p, i, None, None)
        p[i] = st
        if texts and i in texts:
            p[i] = oracle.trim_stop_entry(st, texts[i])
            lead = oracle.text_lead(st, texts[i])
            if lead:
                p.lead[i] = lead
            if texts[i] == "" and not st:
                p.empty_answers.add(i)
    if other:
        p[99] = seq("z")
    return p


def test_compare_alignment_edges():
    # both sides spelled by text alone: identical, its tokens counted
    (it, _) = oracle.compare("t", "a", "b", _p({0: seq("Hi")}, {0: "Hi"}),
                             _p({0: []}, {0: "Hi"})).items
    assert (it.index, it.verdict, it.compared, it.text_only) == (0, "identical", 1, 1)
    # the same lead on both sides, the baseline without tokens after it: no evidence there
    with pytest.raises(NoEvidenceError, match="^item 0: no tokens on the baseline$"):
        oracle.compare("t", "a", "b", _p({0: []}, {0: "Hi"}),
                       _p({0: seq(" there")}, {0: "Hi there"}))
    # one token matched by text, the candidate had nothing more: it stopped
    (it, _) = oracle.compare("t", "a", "b", _p({0: seq("Hel", "lo")}, {0: "Hello"}),
                             _p({0: []}, {0: "Hel"})).items
    assert it.verdict == "mismatch" and it.reason == "token 1: the candidate stopped, the " \
                                                     "baseline went on"
    # an empty answer on the candidate's side
    (it, _) = oracle.compare("t", "a", "b", _p({0: seq("a")}, {0: "a"}),
                             _p({0: []}, {0: ""})).items
    assert it.reason == "token 0: the candidate stopped, the baseline went on"
    # text that the candidate's first steps do not spell
    (it, _) = oracle.compare("t", "a", "b", _p({0: seq(" there")}, {0: "Hello there"}),
                             _p({0: seq("Help", " there")}, {0: "Hello there"})).items
    assert it.reason == "token 0: 'Hello' (text, no logprob reported) vs the candidate's " \
                        "'Help there'"
    # leads that differ, top-k 0 after them: a mismatch of text, no near-tie
    (it, _) = oracle.compare("t", "a", "b", _p({0: [Step(" c", -0.1, {" c": -0.1})]},
                                               {0: "Ab c"}),
                             _p({0: [Step(" c", -0.1, {" c": -0.1})]}, {0: "Xyz c"})).items
    assert it.verdict == "mismatch" and it.reason == "answer starts 'Ab' vs 'Xyz' (text)"


def test_items_of_mixed_index_types_are_compared_in_a_stable_order():
    a = oracle.Pass({1: seq("a"), "q": seq("b"), 0: seq("c")})
    c = oracle.compare("t", "a", "b", a, a)
    assert [it.index for it in c.items] == [0, 1, "q"]


def test_evidence_names_items_in_text_order():
    base = oracle.Pass({2: [], 10: [], 0: seq("a")})
    with pytest.raises(NoEvidenceError, match=r"\(none on items 10, 2\)"):
        oracle.compare("t", "a", "b", base, base)


def test_steps_take_the_sampled_logprob_before_the_top_ks():
    (st,) = oracle.steps_from_openai({"tokens": ["a"], "token_logprobs": [-0.1],
                                      "top_logprobs": [{"a": -0.3}]})
    assert st.logprob == -0.1
    (st,) = oracle.steps_from_openai({"tokens": ["a"], "top_logprobs": [{"a": -0.3}]})
    assert st.logprob == -0.3


def test_verdict_records_without_parts():
    assert oracle.verdict_line({"ok": True, "message": "m"}) == "ok: m"
    assert oracle.verdict_line({"ok": False, "message": "m", "comparison": {}}) == "FAILED: m"
    v = oracle.Verdict(True, "m", 0, _cmp(["identical"]), _control())
    assert v.to_dict()["thresholds"] == {"top_k": 5, "window": 64}
    assert oracle.ControlArm().budget(5) == 0
    p = oracle.Pass({0: []}, q=seq("a"))
    assert set(p) == {0, "q"} and p.shape is None


def test_judge_at_another_alpha_uses_it_everywhere():
    control = _control()
    v = oracle.judge(_noisy(seed=9), control, alpha=0.2)
    assert v.thresholds.alpha == 0.2 and v.rank_test["alpha"] == 0.2
    assert v.thresholds == oracle.Thresholds.from_control(control.first_step_deltas(), 32, 0.2,
                                                          step_deltas=control.step_deltas())
    th = oracle.Thresholds.from_control([0.0, 0.1, 0.3], 10, 0.01)
    assert th.first_step_tail == pytest.approx(oracle.tail_bound([0.0, 0.1, 0.3], 10, 0.01))
    with pytest.raises(NoEvidenceError, match="^the control arm has no first-step delta: no "
                                              "noise to derive the oracle's bounds from$"):
        oracle.Thresholds.from_control([], 4)


def test_judge_control_classified_at_the_judges_alpha():
    """The control arm's own near-ties are counted under the bounds at the judge's alpha: a
    tie of the control wide enough to be a mismatch at a large alpha leaves the budget."""
    control = _control()
    tie = control.comparisons[0].items[0]
    tie.verdict, tie.divergence, tie.position, tie.tokens = "numerics", "top-k", 1, ("a", "b")
    loose, tight = control.thresholds(32, 0.001), control.thresholds(32, 0.45)
    tie.gap = (loose.gap_max + tight.gap_max) / 2
    cand = _noisy(seed=9)
    assert oracle.judge(cand, control, alpha=0.45).budget == \
        control.classified(tight).budget(32, 0.45, set(range(32)))
    assert control.classified(tight).numerics()[0] == 0
    assert control.classified(loose).numerics()[0] == 1


def test_judge_without_first_steps_records_no_rank_and_over_nothing_says_so():
    control = _control()
    flat = _cmp(["identical"] * 4)
    for it in flat.items:
        it.first_step_delta = None
    v = oracle.judge(flat, control)
    assert v.rank_test is None and v.ok and v.message.endswith(" nats)")
    with pytest.raises(NoEvidenceError) as e:
        oracle.judge(oracle.Comparison("t", "a", "b", [
            oracle.ItemVerdict(index=0, verdict="error", reason="x")]), control)
    assert str(e.value) == "t b vs a: no item compared (1 items, all failed or missing)"
    lone = oracle.Comparison("t", "a", "b", [
        oracle.ItemVerdict(index=50, verdict="identical", first_step_delta=0.0),
        oracle.ItemVerdict(index=0, verdict="error", reason="x")])
    with pytest.raises(NoEvidenceError) as e:
        oracle.judge(lone, control)
    assert str(e.value) == ("t b vs a: the control arm compared none of the 1 items compared "
                            "here: no noise measured for them")
    with pytest.raises(NoEvidenceError) as e:
        oracle.judge(_noisy(seed=9), control, path=oracle.PathArm([]))
    assert str(e.value) == ("t x/1 again vs x/1: the path arm has no first-step delta: nothing "
                            "to hold the disaggregated first step against")


def test_a_path_arm_median_of_first_steps_sharing_nothing():
    control = _control()
    cand = _noisy(seed=9)
    for it in cand.items:
        it.first_step_delta = math.inf
    v = oracle.judge(cand, control, path=_path())
    assert v.path_rank_test["median"] == 1e9 and not v.ok


def test_rank_record_keeps_half_ranks():
    assert oracle._rank_test([1.0, 2.0], [1.0, 3.0], 0.1, "ref")["u"] == 1.5


def test_only_the_reasons_own_position_is_rewritten_after_a_lead():
    base = seq("Hel", "lo", " token 7:", top={2: {" x": -0.2}})
    cand = seq(" x", top={0: {" token 7:": -0.25}})
    a, b = _with_lead(base, cand, "Hello")
    (it,) = oracle.compare("t", "v/1", "v/1p1d", a, b).items
    assert it.reason == "token 2: near-tie ' token 7:'/' x', gap 0.150 nats"


def test_a_first_step_bound_alone_leaves_the_gap_unbounded():
    tie = (seq("a", "b", top={1: {"c": -5.0}}), seq("a", "c", top={1: {"b": -5.0}}))
    v = compare_item(0, *tie, first_step_max=1.0)
    assert v.verdict == "numerics" and v.reason.endswith("gap 4.900 nats <= inf")


def test_judge_classifies_the_control_arm_over_all_its_items():
    """The control arm's own ties are judged under the bound of all the items it compared
    (m = its largest comparison), not of one item."""
    control = _control()
    tie = control.comparisons[0].items[0]
    tie.verdict, tie.divergence, tie.position, tie.tokens = "numerics", "top-k", 1, ("a", "b")
    over_all, one = control.thresholds(32), control.thresholds(1)
    tie.gap = (over_all.gap_max + one.gap_max) / 2
    assert control.classified(over_all).numerics()[0] == 1
    assert control.classified(one).numerics()[0] == 0
    v = oracle.judge(_noisy(seed=9), control)
    assert v.budget == control.classified(over_all).budget(32, oracle.ALPHA, set(range(32)))
    assert v.budget != control.classified(one).budget(32, oracle.ALPHA, set(range(32)))
