"""Eval scoring and prompts: GSM8K strict-match (as lm-eval's gsm8k task) and MMLU letters.

Pure functions only, on real rows from the offline dataset copies; nothing is sent anywhere.
"""

import pytest

from e2e_test.infra.verdicts.datasets import GSM8KRow, MMLURow, load_gsm8k, load_mmlu
from e2e_test.infra.verdicts.evals import gsm8k, mmlu

# -- GSM8K strict-match -----------------------------------------------------------------------


@pytest.mark.parametrize("output,reference", [
    ("#### 18", "18"),
    ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
    ("#### 18.", "18"),                       # trailing "." ignored
    ("#### 18\n\nQuestion: next", "18"),
    ("#### 2125", "2,125"),                   # "," ignored on both sides
    ("#### 2,125", "2,125"),
    ("#### 2,125", "2125"),
    ("#### 1450000", "1,450,000"),
    ("#### 1,450,000.", "1,450,000"),
    ("#### -10", "-10"),
    ("#### -3.", "-3"),
    ("#### 70000", "70000"),
    ("#### 5 apples", "5"),
])
def test_gsm8k_strict_match_correct(output, reference):
    assert gsm8k.is_correct(output, reference)


@pytest.mark.parametrize("output,reference", [
    ("The answer is 18", "18"),               # no "####": strict-match finds nothing
    ("#### $18.", "18"),                      # the regex wants a digit right after "#### "
    ("####18", "18"),                         # no space after ####
    ("#### 17", "18"),
    ("#### 10", "-10"),                       # the sign counts
    ("#### -10", "10"),
    ("#### 18.00", "18"),                     # only one trailing "." is ignored, not ".00"
    ("#### 1.8", "18"),
    ("", "18"),
    ("#### 17\n#### 18", "18"),               # the first #### wins
])
def test_gsm8k_strict_match_wrong(output, reference):
    assert not gsm8k.is_correct(output, reference)


def test_gsm8k_first_match_wins():
    assert gsm8k.is_correct("#### 18\nQuestion: ... #### 17", "18")
    assert gsm8k.extract("x #### 3 y #### 4") == "3"
    assert gsm8k.extract("no marker") is None
    assert gsm8k.extract("#### 1,450,000.") == "1,450,000."


def test_gsm8k_normalize():
    assert gsm8k.normalize("1,450,000") == "1450000"
    assert gsm8k.normalize("$18.") == "18"
    assert gsm8k.normalize("-3") == "-3"
    # The reference may still be a whole answer: everything up to "#### " is dropped.
    assert gsm8k.normalize("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"


def test_gsm8k_every_test_reference_scores(real_datasets):
    rows = load_gsm8k("test")
    assert len(rows) == 1319
    for i, row in enumerate(rows):
        ref = row.reference
        assert ref and ref == row.answer.split("#### ")[-1].strip(), i
        assert gsm8k.is_correct(f"#### {ref}", ref), (i, ref)
        assert gsm8k.is_correct(f"{row.answer}", ref), (i, ref)
    refs = {r.reference for r in rows}
    assert {"18", "2,125", "1,450,000", "-10", "-3"} <= refs


def test_gsm8k_reference_forms():
    assert GSM8KRow("q", "steps\n#### 2,125").reference == "2,125"
    assert GSM8KRow("q", "#### -3 ").reference == "-3"


def test_gsm8k_fewshot_prefix_uses_first_5_train_rows(real_datasets):
    train = load_gsm8k("train")
    prefix = gsm8k.fewshot_prefix(train)
    expected = "".join(f"Question: {r.question}\nAnswer: {r.answer}\n\n" for r in train[:5])
    assert prefix == expected
    assert prefix.count("Question: ") == 5 and prefix.count("#### ") == 5
    assert train[5].question not in prefix
    assert gsm8k.fewshot_prefix(train, 0) == ""
    assert gsm8k.fewshot_prefix(train, 2).count("Question: ") == 2


def test_gsm8k_requests(real_datasets):
    reqs, rows = gsm8k.requests("m", 3)
    test, train = load_gsm8k("test"), load_gsm8k("train")
    assert rows == test[:3]
    assert [r.tag for r in reqs] == [0, 1, 2]
    body = reqs[1].body
    assert reqs[1].path == "/v1/completions"
    assert body["prompt"] == (gsm8k.fewshot_prefix(train) + f"Question: {test[1].question}"
                              "\nAnswer:")
    assert (body["model"], body["max_tokens"], body["temperature"], body["stop"]) == (
        "m", 256, 0, ["Question:", "</s>", "<|im_end|>"])


# -- MMLU letter extraction -------------------------------------------------------------------


@pytest.mark.parametrize("output,expected", [
    (" B", "B"),
    ("B", "B"),
    ("B. blue", "B"),
    ("Answer: C", "C"),              # the "A" of "Answer" is inside a word: not a letter
    ("Answer:  D", "D"),
    (" (D)", "D"),
    ("D)", "D"),
    (" C\n", "C"),
    ("The answer is B", "B"),
    ("A good one", "A"),             # a standalone A counts, even as an article
    ("Because", None),               # a word starting with B is not an answer
    ("C2", None),
    ("b", None),                     # case-sensitive
    ("E", None),
    ("", None),
    ("   ", None),
    ("The correct answer is (B)", None),   # only the first 20 characters are searched
])
def test_mmlu_extract(output, expected):
    assert mmlu.extract(output) == expected


# -- MMLU prompts -----------------------------------------------------------------------------

ROW = MMLURow("high_school_biology", "What colour is the sky?", ("red", "blue", "green", "grey"),
              "B")
SHOT = MMLURow("high_school_biology", " What is 1+1? ", ("1", "2", "3", "4"), "B")


def test_mmlu_format_question():
    assert mmlu.format_question(ROW, False) == (
        "What colour is the sky?\nA. red\nB. blue\nC. green\nD. grey\nAnswer:")
    assert mmlu.format_question(SHOT, True) == (
        "What is 1+1?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: B\n\n")


def test_mmlu_build_prompt():
    p = mmlu.build_prompt(ROW, [SHOT, SHOT])
    assert p.startswith("The following are multiple choice questions (with answers) about "
                        "high school biology.\n\n")
    assert p.endswith("D. grey\nAnswer:")
    assert p.count("Answer: B\n\n") == 2
    assert p == ("The following are multiple choice questions (with answers) about high school "
                 "biology.\n\n" + mmlu.format_question(SHOT, True) * 2
                 + mmlu.format_question(ROW, False))
    assert "_" not in p.splitlines()[0]


def test_mmlu_fitted_prompt_drops_shots():
    shots = [SHOT] * 5
    full = mmlu.build_prompt(ROW, shots)
    assert mmlu.fitted_prompt(ROW, shots, None) == full
    assert mmlu.fitted_prompt(ROW, shots, 10_000) == full
    # Room for exactly two exemplars.
    budget = len(mmlu.build_prompt(ROW, shots[:2])) / mmlu.CHARS_PER_TOKEN
    fitted = mmlu.fitted_prompt(ROW, shots, budget)
    assert fitted == mmlu.build_prompt(ROW, shots[:2])
    assert fitted.count("Answer: B\n\n") == 2
    # Nothing fits: zero-shot, even when that is still too long.
    assert mmlu.fitted_prompt(ROW, shots, 1) == mmlu.build_prompt(ROW, [])


def test_mmlu_sample_spread_and_determinism():
    rows = list(range(100))
    assert mmlu.sample(rows, 4) == [0, 25, 50, 75]
    assert mmlu.sample(rows, 3) == [0, 33, 66]
    assert mmlu.sample(rows, 100) == rows and mmlu.sample(rows, 500) == rows
    assert mmlu.sample(rows, 7) == mmlu.sample(rows, 7)
    assert len(set(mmlu.sample(rows, 64))) == 64


def test_mmlu_sample_spreads_over_subjects(real_datasets):
    rows = load_mmlu("test")
    assert len(rows) == 14042
    s = mmlu.sample(rows, 64)
    assert s == mmlu.sample(rows, 64)
    assert s[0] == rows[0]
    assert len({r.subject for r in s}) >= 40      # the file is sorted by subject


def test_mmlu_requests_use_subject_dev_shots(real_datasets):
    reqs, rows = mmlu.requests("m", 4, k_shot=5)
    dev = [r for r in load_mmlu("dev") if r.subject == rows[2].subject]
    assert len(dev) == 5
    body = reqs[2].body
    assert body["prompt"] == mmlu.build_prompt(rows[2], dev)
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("m", 2, 0)
    assert [r.tag for r in reqs] == [0, 1, 2, 3]
    short, _ = mmlu.requests("m", 4, k_shot=5, max_prompt_tokens=50)
    assert short[2].body["prompt"].count("\nAnswer: ") < 5
    assert short[2].body["prompt"].endswith("Answer:")


# --- floors of the registry fail on plausible broken outputs -------------------------------

from e2e_test.infra.errors import HarnessError as _HarnessError  # noqa: E402
from e2e_test.infra.load.load import RequestResult as _RR  # noqa: E402
from e2e_test.infra.load.load import RunReport as _Report
from e2e_test.infra.specs.model_specs import get_spec as _get_spec  # noqa: E402
from e2e_test.infra.verdicts.evals import collect as _collect  # noqa: E402

_BROKEN = {
    "truncated": lambda good: good[: len(good) // 3],
    "garbled": lambda good: "\ufffd\ufffd q#z\u0000 ~~ " * 3,
    "empty": lambda good: "",
}
_GOOD = {"gsm8k": "She sells 16 - 3 - 4 = 9 eggs. 9 * 2 = 18.\n#### 18",
         "mmlu": " B"}


def _scored(name, texts):
    from e2e_test.infra.verdicts.evals import gsm8k as g
    from e2e_test.infra.verdicts.evals import mmlu as m
    rep = _Report([_RR(index=i, tag=i, status=200, text=t) for i, t in enumerate(texts)], 1.0)
    if name == "gsm8k":
        return _collect(name, rep, lambda r: (g.extract(r.text), False))
    return _collect(name, rep, lambda r: (m.extract(r.text), m.extract(r.text) == "B"))


@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
def test_default_model_floors_pass_healthy_output(name):
    acc = _get_spec("SmolLM2-135M-Instruct").accuracy[name]
    _scored(name, [_GOOD[name]] * acc.n).check_spec(acc)


@pytest.mark.parametrize("broken", sorted(_BROKEN))
@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
def test_default_model_floors_fail_on_broken_output(name, broken):
    acc = _get_spec("SmolLM2-135M-Instruct").accuracy[name]
    texts = [_BROKEN[broken](_GOOD[name])] * acc.n
    with pytest.raises(_HarnessError, match="format floor"):
        _scored(name, texts).check_spec(acc)


@pytest.mark.parametrize("floors", [{}, {"floor": 0.0, "format_floor": 0.5}],
                         ids=["no-floors", "floors"])
def test_an_eval_of_no_item_is_an_error_not_a_pass(floors):
    """With no floor (a model without an accuracy entry) it passed; with a format floor it
    failed for the wrong reason (0/0 below the floor)."""
    with pytest.raises(_HarnessError, match="gsm8k: no item was asked: nothing to judge"):
        _scored("gsm8k", []).check(**floors)


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-4B-Instruct-2507"])
def test_real_model_accuracy_floor_fails_on_wrong_answers(model):
    acc = _get_spec(model).accuracy["mmlu"]
    with pytest.raises(_HarnessError, match="below floor"):
        _scored("mmlu", [" C"] * acc.n).check_spec(acc)       # well formatted, all wrong


@pytest.mark.parametrize("broken", sorted(_BROKEN))
@pytest.mark.parametrize("name", ["gsm8k", "mmlu"])
def test_default_model_format_floors_on_partial_breakage(name, broken):
    """Part of the outputs broken: at the floor's count of well-formed outputs the floor
    holds; one fewer fails it (GSM8K 13/32, MMLU 22/32: docs/accuracy.md)."""
    acc = _get_spec("SmolLM2-135M-Instruct").accuracy[name]
    need = round(acc.format_floor * acc.n)
    assert 0 < need < acc.n
    good, bad = _GOOD[name], _BROKEN[broken](_GOOD[name])
    _scored(name, [good] * need + [bad] * (acc.n - need)).check_spec(acc)
    with pytest.raises(_HarnessError, match=f"{need - 1}/{acc.n} outputs have an extractable"):
        _scored(name, [good] * (need - 1) + [bad] * (acc.n - need + 1)).check_spec(acc)


def test_format_floor_counts_errors_apart_from_broken_outputs():
    """Failed requests are errors (their own budget), never counted as unformatted."""
    acc = _get_spec("SmolLM2-135M-Instruct").accuracy["gsm8k"]
    rep = _Report([_RR(index=i, tag=i, status=200, text=_GOOD["gsm8k"]) for i in range(31)]
                  + [_RR(index=31, tag=31, status=500, error="boom")], 1.0)
    from e2e_test.infra.verdicts.evals import gsm8k as g
    res = _collect("gsm8k", rep, lambda r: (g.extract(r.text), False))
    assert (res.errors, res.formatted, res.scored) == (1, 31, 31)
    with pytest.raises(_HarnessError, match="1/32 requests failed"):
        res.check_spec(acc)
