"""The pass-code recall probe (evals/recall.py): a code mid-text and one in the prompt's last
block, and its verdict rule (recall_problems): a baseline that copied nothing is an error."""

import pytest

from e2e_test.infra.evals import recall
from e2e_test.infra.oracle import NoEvidenceError


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
