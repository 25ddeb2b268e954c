"""A primed pass (comparisons.run_pass prime=True) sends its first request alone and the rest
at the pass's concurrency, and keeps every answer as an unprimed pass does: load.run is
replaced by a recorder here (pure logic: no engine)."""

from e2e_test.infra.load import load
from e2e_test.infra.verdicts import comparisons

LP = {"tokens": ["A"], "token_logprobs": [-0.1], "top_logprobs": [{"A": -0.1}]}


def _recorder(monkeypatch):
    calls = []

    def run(url, reqs, concurrency, **kw):
        calls.append(([r.tag for r in reqs], concurrency))
        return load.RunReport([load.RequestResult(i, tag=r.tag, status=200, text="A",
                                                  logprobs=LP) for i, r in enumerate(reqs)],
                              1.0)
    monkeypatch.setattr(load, "run", run)
    return calls


def _reqs(n):
    return [load.Request("/v1/completions", {"prompt": f"p{i}", "logprobs": 5,
                                             "max_tokens": 4}, i) for i in range(n)]


def test_primed_the_first_request_goes_alone_then_the_rest_together(monkeypatch):
    calls = _recorder(monkeypatch)
    p = comparisons.run_pass("http://127.0.0.1:1", _reqs(4), concurrency=16, prime=True)
    assert calls == [([0], 1), ([1, 2, 3], 16)]
    assert sorted(p) == [0, 1, 2, 3]


def test_unprimed_or_a_single_request_is_one_run(monkeypatch):
    calls = _recorder(monkeypatch)
    comparisons.run_pass("http://127.0.0.1:1", _reqs(4), concurrency=16)
    comparisons.run_pass("http://127.0.0.1:1", _reqs(1), concurrency=16, prime=True)
    assert calls == [([0, 1, 2, 3], 16), ([0], 16)]
