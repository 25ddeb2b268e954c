"""Every field and every first line the oracle records, pinned: answers as the engines return
them (completions and chat logprobs, streamed chunks, eval item records with their text) go
through steps_by_index and compare, and verdicts through judge; each case's record
(Comparison.to_dict, Verdict.to_dict, verdict_line) must equal the one committed in
tests/data/mutation_oracle_records.json. A change of any verdict, reason, position, token or
number shows as a diff there. After an intended change, rewrite it with
    E2E_WRITE_ORACLE_RECORDS=1 python -m pytest tests/test_mutation_oracle_records.py
and read the diff before committing it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from e2e_test.infra.verdicts import oracle

DATA = Path(__file__).resolve().parent / "data" / "mutation_oracle_records.json"


def comp(*steps):
    """Completions-format logprobs from (token, logprob, {alternative: logprob}) steps."""
    return {"tokens": [t for t, _, _ in steps], "token_logprobs": [lp for _, lp, _ in steps],
            "top_logprobs": [dict(top, **{t: lp}) if top is not None else None
                             for t, lp, top in steps]}


def chat(*steps):
    return {"content": [{"token": t, "logprob": lp,
                         "top_logprobs": [{"token": k, "logprob": v}
                                          for k, v in dict(top or {}, **{t: lp}).items()]}
                        for t, lp, top in steps]}


ALT = {"x": -3.0, "y": -4.0}


def s(tok, lp=-0.1, top=ALT):
    return tok, lp, top


def k0(tok, lp):
    """A step of an engine that reports the sampled token's logprob alone (top-k 0)."""
    return tok, lp, {}


# another item of the same pass, with logprobs: a pass that carries none at all is no evidence
K0_OTHER = {"index": 99, "text": "a", "logprobs": comp(k0("a", -0.1))}

# (name, baseline items, candidate items): eval item records as the runs write them
CASES = [
    ("identical, the largest later-step delta kept",
     [{"index": 0, "text": "abc", "logprobs": comp(s("a"), s("b", -0.1, {"x": -3.3}),
                                                   s("c", -0.1, {"x": -3.1}))}],
     [{"index": 0, "text": "abc", "logprobs": comp(s("a"), s("b"), s("c"))}]),
    ("near-tie inside both top-k",
     [{"index": 1, "text": "ab", "logprobs": comp(s("a"), s("b", -0.7, {"c": -0.8}))}],
     [{"index": 1, "text": "ac", "logprobs": comp(s("a"), s("c", -0.6, {"b": -0.9}))}]),
    ("wide gap inside both top-k",
     [{"index": 2, "text": "ab", "logprobs": comp(s("a"), s("b", -0.1, {"c": -2.5}))}],
     [{"index": 2, "text": "ac", "logprobs": comp(s("a"), s("c", -0.1, {"b": -2.5}))}]),
    ("the candidate's token outside the baseline's top-k",
     [{"index": 3, "text": "ab", "logprobs": comp(s("a"), s("b"))}],
     [{"index": 3, "text": "az", "logprobs": comp(s("a"), s("z", -0.1, {"b": -0.3}))}]),
    ("the baseline's token outside the candidate's top-k",
     [{"index": 4, "text": "ab", "logprobs": comp(s("a"), s("b", -0.1, {"z": -0.3}))}],
     [{"index": 4, "text": "az", "logprobs": comp(s("a"), s("z"))}]),
    ("the candidate stopped (top-k reported)",
     [{"index": 5, "text": "abc", "logprobs": comp(s("a"), s("b"), s("c"))}],
     [{"index": 5, "text": "ab", "logprobs": comp(s("a"), s("b"))}]),
    ("the baseline stopped (top-k reported)",
     [{"index": 6, "text": "a", "logprobs": comp(s("a"))}],
     [{"index": 6, "text": "ab", "logprobs": comp(s("a"), s("b"))}]),
    ("top-k 0: the candidate stopped, its stop token not reported",
     [{"index": 7, "text": "ab", "logprobs": comp(k0("a", -0.1), k0("b", math.log(0.6)))}],
     [{"index": 7, "text": "a", "logprobs": comp(k0("a", -0.1))}]),
    ("top-k 0: the baseline stopped, its stop token not reported",
     [{"index": 8, "text": "a", "logprobs": comp(k0("a", -0.1))}],
     [{"index": 8, "text": "ab", "logprobs": comp(k0("a", -0.1), k0("b", math.log(0.3)))}]),
    ("top-k 0 on one side only",
     [{"index": 9, "text": "ab", "logprobs": comp(s("a"), s("b", -0.5, {"c": -0.9}))}],
     [{"index": 9, "text": "ac", "logprobs": comp(k0("a", -0.1), k0("c", math.log(0.4)))}]),
    ("first steps share no token, then a divergence",
     [{"index": 10, "text": "ab", "logprobs": comp(s("a", -0.1, {"x": -1}), s("b"))}],
     [{"index": 10, "text": "qb", "logprobs": comp(s("q", -0.1, {"w": -1}), s("b"))}]),
    ("the candidate's first token without a logprob, matched by text",
     [{"index": 11, "text": "Hello there", "logprobs": comp(s("Hel"), s("lo"), s(" there"))}],
     [{"index": 11, "text": "Hello there", "logprobs": comp(s(" there"))}]),
    ("the baseline's first token without a logprob, matched by text",
     [{"index": 12, "text": "Hello there", "logprobs": comp(s(" there"))}],
     [{"index": 12, "text": "Hello there", "logprobs": comp(s("Hello"), s(" there"))}]),
    ("a lead that the other side's first steps do not spell",
     [{"index": 13, "text": "Hello there", "logprobs": comp(s("Help"), s(" there"))}],
     [{"index": 13, "text": "Hello there", "logprobs": comp(s(" there"))}]),
    ("leads that differ in text",
     [{"index": 14, "text": "Ab c", "logprobs": comp(s(" c"))}],
     [{"index": 14, "text": "Xy c", "logprobs": comp(s(" c"))}]),
    ("top-k 0: a lead against the baseline's first sampled token",
     [{"index": 15, "text": "No", "logprobs": comp(k0("No", math.log(0.55)))}, K0_OTHER],
     [{"index": 15, "text": "Yes", "logprobs": comp()}, K0_OTHER]),
    ("top-k 0: a lead against the candidate's first sampled token",
     [{"index": 16, "text": "Yes", "logprobs": comp()}, K0_OTHER],
     [{"index": 16, "text": "No", "logprobs": comp(k0("No", math.log(0.7)))}, K0_OTHER]),
    ("an empty answer against one that went on",
     [{"index": 17, "text": "", "logprobs": comp()}, K0_OTHER],
     [{"index": 17, "text": "a", "logprobs": comp(s("a"))}, K0_OTHER]),
    ("a request failed on the candidate, one not asked there",
     [{"index": 18, "text": "a", "logprobs": comp(s("a"))},
      {"index": 19, "text": "a", "logprobs": comp(s("a"))}, K0_OTHER],
     [{"index": 18, "error": "HTTP 500"}, K0_OTHER]),
    ("a request failed on both sides",
     [{"index": 20, "error": "HTTP 500"}, {"index": 21, "text": "a", "logprobs": comp(s("a"))}],
     [{"index": 20, "error": "HTTP 503"}, {"index": 21, "text": "a", "logprobs": comp(s("a"))}]),
    ("chat logprobs, a near-tie",
     [{"index": 22, "text": "ab", "logprobs": chat(s("a"), s("b", -0.7, {"c": -0.8}))}],
     [{"index": 22, "text": "ac", "logprobs": chat(s("a"), s("c", -0.7, {"b": -0.8}))}]),
    ("a stop entry past the text is dropped (top-k 0)",
     [{"index": 23, "text": "ab", "logprobs": comp(k0("a", -0.1), k0("b", -0.1),
                                                   k0("", -0.2))}],
     [{"index": 23, "text": "ab", "logprobs": comp(k0("a", -0.1), k0("b", -0.1))}]),
]


def _compare_case(base_items, cand_items):
    base, cand = oracle.steps_by_index(base_items), oracle.steps_by_index(cand_items)
    out = {"structural": oracle.compare("t", "v/1", "v/1p1d", base, cand).to_dict(),
           "bounded": oracle.compare("t", "v/1", "v/1p1d", base, cand, gap_max=0.5,
                                     first_step_max=0.25).to_dict()}
    return out


def _noise(n, seed, scale, name="t", shift=0.0, b="v/1 again"):
    import random
    rnd = random.Random(seed)
    c = oracle.Comparison(name, "v/1", b)
    c.items = [oracle.ItemVerdict(index=i, verdict="identical", compared=4,
                                  first_step_delta=round(abs(rnd.gauss(0, scale)) + shift, 5),
                                  max_step_delta=round(abs(rnd.gauss(0, scale)), 5))
               for i in range(n)]
    return c


def _judge_cases():
    control = oracle.ControlArm([_noise(12, 1, 0.05), _noise(12, 2, 0.05)])
    path = oracle.PathArm([_noise(12, 3, 0.05, shift=0.05)], how="prefix cache", why="test")
    deciding = oracle.PathArm([_noise(12, 3, 0.05, shift=0.05)], how="prefix cache",
                              decides=True, why="measured")
    healthy = _noise(12, 4, 0.05, shift=0.05, b="v/1p1d")
    shifted = _noise(12, 4, 0.05, shift=0.15, b="v/1p1d")
    for it in shifted.items:                  # each under the per-item bound (0.213)
        it.first_step_delta = min(it.first_step_delta, 0.2)
    with_inf = _noise(12, 5, 0.05, b="v/1p1d")
    with_inf.items[0].first_step_delta = math.inf
    with_inf.items[0].reason = "first-step top-k sets share no token"
    numerics = _noise(12, 6, 0.01, b="v/1p1d")
    for it in numerics.items[:6]:
        it.verdict, it.divergence, it.position, it.tokens, it.gap = (
            "numerics", "top-k", 1, ("a", "b"), 0.01)
    errors = _noise(12, 7, 0.01, b="v/1p1d")
    errors.items.append(oracle.ItemVerdict(index=12, verdict="error",
                                           reason="request failed on the candidate"))
    bad_control = oracle.ControlArm([_noise(12, 1, 0.05),
                                     oracle.Comparison("t", "v/1", "v/1 serial", [
                                         oracle.ItemVerdict(index=0, verdict="error",
                                                            reason="request failed")])])
    return {
        "healthy, path arm recorded": oracle.judge(healthy, control, path=path),
        "healthy, path arm decides": oracle.judge(healthy, control, path=deciding),
        "shifted, path arm decides": oracle.judge(shifted, control, path=deciding),
        "shifted, path arm recorded": oracle.judge(shifted, control, path=path),
        "a first step sharing no token": oracle.judge(with_inf, control, path=deciding),
        "numerics over the budget": oracle.judge(numerics, control),
        "an item not compared": oracle.judge(errors, control),
        "a control arm with a failed request": oracle.judge(healthy, bad_control),
    }


def _stream_cases():
    return {
        "completions chunks": oracle.merge_stream_logprobs([
            {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}]},
            None, {}, {"tokens": ["b"]},
            {"tokens": ["c"], "token_logprobs": [-0.3], "top_logprobs": [None]}]),
        "chat chunks": oracle.merge_stream_logprobs([
            {"content": [{"token": "a", "logprob": -0.1}]}, {"content": None},
            {"content": [{"token": "b", "logprob": -0.2}]}]),
        "nothing": oracle.merge_stream_logprobs([None, {}]),
    }


def _steps_cases():
    def st(lp):
        return [[x.token, x.logprob, x.top] for x in oracle.steps_from_openai(lp)]
    return {
        "short lists": st({"tokens": ["a", "b", "c"], "token_logprobs": [-0.1, None],
                           "top_logprobs": [{"a": -0.1, "x": -2}, {"b": -0.4}]}),
        "chat without top": st({"content": [{"token": "a", "logprob": -0.5},
                                            {"token": "b", "logprob": -0.6,
                                             "top_logprobs": None}]}),
        "none": st(None), "empty chat": st({"content": None}),
    }


def _evidence_cases():
    out = {}
    nine = oracle.Pass({i: [] for i in range(9)})
    nine[9] = oracle.steps_from_openai(comp(s("a")))
    nine.shape = "/v1/completions logprobs=5"
    eight = oracle.Pass({i: [] for i in range(8)})
    eight[8] = oracle.steps_from_openai(comp(s("a")))
    full = oracle.Pass({0: oracle.steps_from_openai(comp(s("a")))})
    for name, base, cand in (("nine without logprobs", full, nine),
                             ("eight without logprobs", eight, full),
                             ("nothing answered", full, oracle.Pass({0: None, 1: None}))):
        with pytest.raises(oracle.NoEvidenceError) as e:
            oracle.compare("t", "v/1", "v/1p1d", base, cand)
        out[name] = str(e.value)
    return out


def records() -> dict:
    return json.loads(json.dumps({
        "compare": {name: _compare_case(b, c) for name, b, c in CASES},
        "judge": {name: dict(v.to_dict(), line=oracle.verdict_line(v.to_dict()),
                             negative_control=oracle.negative_control_problems(v))
                  for name, v in _judge_cases().items()},
        "streams": _stream_cases(),
        "steps": _steps_cases(),
        "evidence": _evidence_cases(),
    }))


def test_every_record_is_the_committed_one():
    got = records()
    if os.environ.get("E2E_WRITE_ORACLE_RECORDS") == "1":
        DATA.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(DATA.read_text())
    for part in want:
        for name in want[part]:
            assert got[part][name] == want[part][name], (part, name)
    assert got.keys() == want.keys() and all(got[p].keys() == want[p].keys() for p in got)


def test_the_committed_records_say_what_each_case_is():
    """A few fields read by eye, so the committed file is known to hold the right verdicts,
    not merely the current ones."""
    want = json.loads(DATA.read_text())
    items = {name: r["bounded"]["items"] for name, r in want["compare"].items()}
    assert items["identical, the largest later-step delta kept"][0]["max_step_delta"] == 0.3
    assert items["near-tie inside both top-k"][0]["verdict"] == "numerics"
    assert items["wide gap inside both top-k"][0]["verdict"] == "mismatch"
    assert "baseline's top" in items["the candidate's token outside the baseline's top-k"][0][
        "reason"]
    assert "candidate's top" in items["the baseline's token outside the candidate's top-k"][0][
        "reason"]
    assert items["the candidate stopped (top-k reported)"][0]["reason"] == (
        "token 2: the candidate stopped, the baseline went on")
    assert items["the baseline stopped (top-k reported)"][0]["reason"] == (
        "token 1: the baseline stopped, the candidate went on")
    assert items["top-k 0: the candidate stopped, its stop token not reported"][0][
        "tokens"] == ["b", "<stop>"]
    assert items["top-k 0: the baseline stopped, its stop token not reported"][0][
        "tokens"] == ["<stop>", "b"]
    assert items["top-k 0 on one side only"][0]["divergence"] == "bound"
    assert items["first steps share no token, then a divergence"][0]["reason"].startswith(
        "first-step top-k sets share no token; ")
    for name in ("the candidate's first token without a logprob, matched by text",
                 "the baseline's first token without a logprob, matched by text"):
        assert items[name][0]["verdict"] == "identical" and items[name][0]["text_only"] >= 1
    assert items["top-k 0: a lead against the candidate's first sampled token"][0][
        "tokens"] == ["Yes", "No"]
    assert items["top-k 0: a lead against the baseline's first sampled token"][0][
        "tokens"] == ["No", "Yes"]
    assert [i["reason"] for i in items["a request failed on the candidate, one not asked "
                                       "there"]][:2] == ["request failed on the candidate",
                                                         "not asked on the candidate"]
    assert items["a request failed on both sides"][0]["reason"] == "request failed on both sides"
    judged = want["judge"]
    assert sorted(n for n, v in judged.items() if v["ok"]) == [
        "healthy, path arm decides", "healthy, path arm recorded", "shifted, path arm recorded"]
    assert judged["shifted, path arm decides"]["line"].startswith("FAILED: t v/1p1d vs v/1: ")
    assert "first steps shifted against the path arm" in judged["shifted, path arm decides"][
        "message"]
    assert judged["a first step sharing no token"]["path_rank_test"]["median"] != "inf"
