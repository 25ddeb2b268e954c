"""The pass-code recall probe (evals/recall.py): a code mid-text and one in the prompt's last
block, and its verdict rule (recall_problems): a baseline that copied nothing is an error."""

import pytest

from e2e_test.infra.verdicts.evals import recall
from e2e_test.infra.verdicts.oracle import NoEvidenceError


def test_odd_items_carry_the_code_at_the_very_end():
    for i in range(8):
        p = recall.prompt(i)
        c = recall.code(i)
        assert p.count(c) == 1
        if recall.at_tail(i):
            assert p.endswith(f"The pass code is {c}. The pass code is")
            assert len(p) - p.index(c) < 40        # a few tokens from the end
        else:
            assert p.index(c) < len(p) * 0.8 and p.endswith("The pass code is")
    assert [recall.at_tail(i) for i in range(4)] == [False, True, False, True]


def test_recall_passes_when_every_baseline_code_comes_back():
    assert recall.recall_problems([0, 1, 2, 3], [0, 1, 2, 3, 5], 8, "1p1d") == []


def test_a_lost_tail_code_fails_naming_it():
    probs = recall.recall_problems([0, 1, 2, 3], [0, 2, 3], 8, "1p1d")
    assert probs == ["pass codes that `1` copied and 1p1d did not: items [1] (tail)"]


def test_baseline_without_copied_codes_is_an_error_not_a_pass():
    with pytest.raises(NoEvidenceError, match="copied none of the 8 pass codes"):
        recall.recall_problems([], [], 8, "1p1d")
    # A kind `1` never copied is not checked for copying, and named: the H200 TokenSpeed
    # baseline copied tail codes 1, 5, 7 and no mid-text one.
    assert recall.recall_problems([1, 5, 7], [1, 5, 7], 8, "1p1d") == []
    assert recall.recall_problems([1, 5, 7], [1, 7], 8, "1p1d") == [
        "pass codes that `1` copied and 1p1d did not: items [5] (tail)"]
    assert recall.untested_kinds([1, 5, 7]) == ["mid-text"]
    assert recall.untested_kinds([0, 2, 4]) == ["tail (last block)"]
    assert recall.untested_kinds([0, 1]) == []


def test_reproduced():
    assert recall.reproduced(1, f" {recall.code(1)}.")
    assert not recall.reproduced(1, " 0-0-0")


def test_only_codes_that_1_copies_in_every_pass_are_required():
    """The H200 case (vLLM 0.26): `1` copied item 1's code in its baseline, its
    control pass began at the near-tie ' a' and lost it, and so did 1p1d. Required of 1p1d
    are the codes copied in the baseline and in every control pass; item 1 is named as
    unstable, not required. A code lost by 1p1d that `1` copied every time still fails."""
    c = {i: f" {recall.code(i)}. The pass code" for i in range(8)}
    baseline = {i: c[i] for i in (0, 1, 2, 4, 6)} | {3: " a", 5: " a", 7: " a"}
    control = [baseline | {1: " a sequence of 0s and 1s that is used to create a"},
               dict(baseline)]
    stable, unstable = recall.stable_codes(baseline, control)
    assert stable == [0, 2, 4, 6] and unstable == [1]
    pd_copied = [0, 2, 4, 6]
    assert recall.recall_problems(stable, pd_copied, 8, "1p1d") == []
    # a stable code lost is still a failure (the tail code 4 of a stale last block, say)
    assert recall.recall_problems(stable, [0, 2, 6], 8, "1p1d")
    # a control pass that did not answer an item leaves that item unproven: not required
    stable, unstable = recall.stable_codes(baseline, [{k: v for k, v in baseline.items()
                                                        if k != 2}])
    assert 2 not in stable and 2 in unstable
    # no control pass at all: the baseline alone decides (nothing to measure it against)
    assert recall.stable_codes(baseline, []) == ([0, 1, 2, 4, 6], [])


def test_codes_copied_only_sometimes_leave_nothing_required_is_an_error():
    baseline = {1: f" {recall.code(1)}."}
    stable, unstable = recall.stable_codes(baseline, [{1: " a"}])
    assert stable == [] and unstable == [1]
    with pytest.raises(NoEvidenceError):
        recall.recall_problems(stable, [], 8, "1p1d")
