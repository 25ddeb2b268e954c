"""A null logprob (what an engine writes for a non-finite value: NaN logits from corrupted
KV) makes its item an error with a reason, never a crash of the pass nor a step compared."""

import pytest

from e2e_test.infra.load import load
from e2e_test.infra.verdicts import comparisons, oracle


def _chat_lp(lp, top=-0.5):
    return {"content": [{"token": "A", "logprob": -0.1,
                         "top_logprobs": [{"token": "A", "logprob": -0.1}]},
                        {"token": "B", "logprob": lp,
                         "top_logprobs": [{"token": "B", "logprob": top}]}]}


def test_a_finite_chat_answer_gives_its_steps():
    steps = oracle.steps_from_openai(_chat_lp(-0.2))
    assert [(s.token, s.logprob) for s in steps] == [("A", -0.1), ("B", -0.2)]


@pytest.mark.parametrize("lp,top", [(None, -0.5), (-0.2, None)])
def test_a_null_logprob_is_bad_not_a_number_or_a_crash(lp, top):
    with pytest.raises(oracle.BadLogprob, match="token 'B': logprob null"):
        oracle.steps_from_openai(_chat_lp(lp, top))


def test_a_completions_token_without_its_own_logprob_stays_not_given():
    lp = {"tokens": ["A"], "token_logprobs": [None], "top_logprobs": [{"A": -0.3}]}
    assert oracle.steps_from_openai(lp)[0].logprob == -0.3
    with pytest.raises(oracle.BadLogprob):
        oracle.steps_from_openai({"tokens": ["A"], "token_logprobs": [-0.3],
                                  "top_logprobs": [{"A": None}]})


def test_run_pass_records_the_item_as_an_error_with_its_reason(monkeypatch):
    results = [load.RequestResult(0, tag=0, status=200, text="AB", logprobs=_chat_lp(-0.2)),
               load.RequestResult(1, tag=1, status=200, text="AB", logprobs=_chat_lp(None))]
    monkeypatch.setattr(load, "run", lambda *a, **k: load.RunReport(results, 1.0))
    reqs = [load.Request("/v1/chat/completions", {"messages": [], "logprobs": True,
                                                  "top_logprobs": 5, "max_tokens": 4}, i)
            for i in (0, 1)]
    p = comparisons.run_pass("http://127.0.0.1:1", reqs, concurrency=1)
    assert [s.token for s in p[0]] == ["A", "B"]
    assert p[1] is None and "logprob null" in p.errors[1]
    assert p.subset([1]).errors == {1: p.errors[1]}
