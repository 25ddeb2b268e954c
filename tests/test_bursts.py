"""The burst verdicts (bursts.check_within_capacity, bursts.check_admission) on request results
built here: the shape every recorded run had passes, and each way a gateway or an engine can get
a burst wrong fails, naming it. A burst with no result, or fewer results than requests sent, is
an error. Then the bound on "queue full" refusals against every recorded H200 burst."""

import dataclasses
from pathlib import Path

import pytest

from e2e_test.infra.cluster.gateway import Admission
from e2e_test.infra.errors import HarnessError
from e2e_test.infra.load import bursts, load

ROOT = Path(__file__).resolve().parent.parent
ADMISSION = Admission(max_concurrent_requests=2, queue_size=2, queue_timeout_secs=5)


def _ok(i, tokens=64, latency=3.0):
    return load.RequestResult(index=i, status=200, output_tokens=tokens, latency_s=latency)


def _refused(i, status=429, code="admission_queue_full", retry="1", latency=0.04):
    return load.RequestResult(index=i, status=status, error=f"HTTP {status}", error_code=code,
                              retry_after=retry, latency_s=latency)


def _window(results=None, requested=16, delta=12):
    """As every recorded versus-window burst: 16 at once against 2 running + 2 queued, 4
    answered with 64 tokens, 12 refused at once as queue full, smg's counter up by 12."""
    if results is None:
        results = [_ok(i) for i in range(4)] + [_refused(i) for i in range(4, 16)]
    return bursts.BurstResult("versus-window-1", load.RunReport(results, wall_s=7.0), 64,
                              rejected_metric_delta=delta, requested=requested)


def _with(i, **change):
    """The healthy burst with result i changed."""
    res = _window()
    res.report.results[i] = dataclasses.replace(res.report.results[i], **change)
    return res


def test_the_recorded_shape_passes():
    assert bursts.check_admission(_window(), ADMISSION) == {"refused": 12, "ok": 4,
                                                            "p99_refusal_s": 0.04}


@pytest.mark.parametrize("res, says", [
    (_with(5, error_code="rate_limited"),
     "HTTP 429 with code 'rate_limited', expected 'admission_queue_full'"),
    (_with(5, retry_after=None), "HTTP 429 admission_queue_full without a retry-after header"),
    (_with(5, latency_s=2.0), "429 refusals not fast: slowest 2.00 s > 1.0 s"),
    (_with(5, status=503, error_code="admission_queue_timeout", latency_s=10.0),
     "503 after 10.0 s, queue timeout is 5"),
    (_with(0, output_tokens=63), "admitted request 0 returned 63 tokens, expected 64"),
    (_with(0, status=500, error="HTTP 500", error_code=""),
     "1 request(s) failed other than by admission: 500 HTTP 500"),
    (_with(0, latency_s=70.0), "a request took 70.0 s (queue timeout 5 s + 60.0 s slack)"),
    (_window(delta=11), "smg_admission_queue_rejected_total grew by 11, client counted 12"),
    (_window([_ok(i) for i in range(16)], delta=0),
     "16 requests against a capacity of 4 and none was refused"),
    # one request that had a queue slot refused as queue full too (an off-by-one in the queue)
    (_window([_ok(i) for i in range(3)] + [_refused(i) for i in range(3, 16)], delta=13),
     ("13 of 16 refused as queue full, but a capacity of 4 (2 running + 2 queued) leaves at "
      "most 12 to find it full")),
    # every request refused, the queued ones by timeout: nothing admitted was tested
    (_window([_refused(i) for i in range(12)]
             + [_refused(i, 503, "admission_queue_timeout", latency=5.1) for i in range(12, 16)],
             delta=16), "no request was admitted and completed"),
], ids=["code", "retry-after", "slow-429", "late-503", "tokens", "500", "hang", "metric",
        "none-refused", "queue-off-by-one", "none-admitted"])
def test_each_admission_fault_fails_naming_it(res, says):
    with pytest.raises(HarnessError) as e:
        bursts.check_admission(res, ADMISSION)
    assert says in str(e.value), str(e.value)


@pytest.mark.parametrize("check", [lambda r: bursts.check_admission(r, ADMISSION),
                                   bursts.check_within_capacity], ids=["admission", "capacity"])
def test_a_burst_over_nothing_or_short_of_its_requests_is_an_error(check):
    with pytest.raises(HarnessError, match="versus-window-1: no request ran: nothing to judge"):
        check(_window([], delta=0))
    res = _window()
    res.report.results.pop()
    with pytest.raises(HarnessError, match="15 results for 16 requests sent"):
        check(res)


def test_within_capacity_wants_every_request_200_with_its_tokens():
    def burst(results):
        return bursts.BurstResult("within-capacity-plain", load.RunReport(results, wall_s=1.0),
                                  32, requested=16)
    bursts.check_within_capacity(burst([_ok(i, 32, 1.0) for i in range(16)]))
    bad = [_ok(i, 32, 1.0) for i in range(14)] + [_ok(14, 31), _refused(15, 500, "")]
    with pytest.raises(HarnessError, match=r"2/16 requests not 200 with 32 tokens; first: "
                                           r"status 200, 31 tokens"):
        bursts.check_within_capacity(burst(bad))


def test_every_recorded_window_burst_keeps_the_queue_full_bound():
    """The bound, on what the H200 runs recorded (status counts and admission): it must
    hold on every healthy run it would have judged."""
    from e2e_test.infra.reports import index
    seen = 0
    for line in index.read(ROOT / "docs" / "validation" / "index.jsonl"):
        for f, bs in sorted(line["bursts"].items()):
            if "versus_window" not in f:
                continue
            for b in bs:
                adm = b.get("admission")
                if not adm:
                    continue
                full = sum(v for k, v in b["status_counts"].items() if k.startswith("429"))
                cap = adm["max_concurrent_requests"] + adm["queue_size"]
                assert full <= max(b["n"] - cap, 0) and b["ok"] >= 1, (f, b["status_counts"])
                seen += 1
    assert seen >= 50, seen
