"""The leg-loss verdict (serving_faults.leg_loss_problems), pure logic, fed with records the
lanes produced: each case below is a real run's LegLoss, and the broken ones are the negative
controls of the rules the serving-fault test checks."""

from e2e_test.infra.load.serving_faults import LegLoss, leg_loss_problems

BOUND = 20.0
DECODE_502 = {"status": 502, "body": '{"error":{"code":"decode_request_failed"}}'}


def decode_loss(**kw) -> LegLoss:
    # CPU lane, 2026-12-01 (window 1p1d): 4 streams, decode SIGKILLed 3 s in.
    base = {"role": "decode", "killed": ["decode-0"], "requests": 4, "errors": 4, "ok": 0,
            "in_flight_at_kill": 4, "past_prefill_at_kill": 2, "errors_before_first_token": 2,
            "max_end_after_kill_s": 0.213, "status_counts": {"200 stream_error": 4},
            "dead": "topology 1p1d (vllm): decode-0 (pid 30805) died: signal 9",
            "after_kill_request": {**DECODE_502, "seconds": 0.907}}
    base.update(kw)
    return LegLoss(**base)


def test_a_decode_loss_that_errors_fast_passes():
    assert leg_loss_problems(decode_loss(), BOUND) == []


def test_a_slow_next_request_fails_and_says_where_the_time_went():
    # The CI run at 05e988f: the next request took 29.689 s to come back 502.
    after = {**DECODE_502, "seconds": 29.689, "gateway_transport_errors": 5,
             "workers": {"prefill-0": {"tokens": 160.0, "busy_s": 28.5}}}
    problems = leg_loss_problems(decode_loss(after_kill_request=after), BOUND)
    assert len(problems) == 1
    assert "took 29.689 s to fail" in problems[0]
    assert "transport errors meanwhile: 5" in problems[0] and "prefill-0" in problems[0]


def test_a_200_after_the_kill_fails():
    problems = leg_loss_problems(
        decode_loss(after_kill_request={"status": 200, "body": "{}", "seconds": 0.2}), BOUND)
    assert problems == ["the next request after the kill answered 200"]


def test_a_hang_and_an_answer_from_a_dead_decode_fail():
    problems = leg_loss_problems(decode_loss(max_end_after_kill_s=None, ok=1, errors=3,
                                             in_flight_at_kill=3), BOUND)
    assert any("still open" in p for p in problems)
    assert any("1/4 answered" in p for p in problems)


def test_silent_errors_and_an_unnamed_death_fail():
    problems = leg_loss_problems(decode_loss(silent_errors=1, dead=None), BOUND)
    assert any("without a message" in p for p in problems)
    assert any("did not name decode-0" in p for p in problems)


def h200_prefill_loss(**kw) -> LegLoss:
    # lane e2e-1gpu-pd on the H200, 2026-12-01, prefill killed 1 s into traffic: every
    # prefill was over before the kill and all 4 requests answered.
    base = {"role": "prefill", "killed": ["prefill-0"], "requests": 4, "errors": 0, "ok": 4,
            "in_flight_at_kill": 0, "past_prefill_at_kill": 2, "errors_before_first_token": 0,
            "max_end_after_kill_s": 1.935, "status_counts": {"200": 4},
            "dead": "topology 1p1d (vllm): prefill-0 (pid 4316) died: signal 9",
            "after_kill_request": {"status": 502, "seconds": 0.448}}
    base.update(kw)
    return LegLoss(**base)


def test_a_prefill_kill_mid_traffic_is_no_verdict():
    problems = leg_loss_problems(h200_prefill_loss(), BOUND)
    assert problems == [("prefill lost mid-traffic: whether a request still needed it is "
                         "unknown (freeze_first=True makes every request wait on it)")]


def test_answers_from_a_frozen_then_killed_prefill_fail():
    problems = leg_loss_problems(h200_prefill_loss(frozen_first=True), BOUND)
    assert len(problems) == 1 and "yet 4/4 answered" in problems[0]


def test_a_frozen_prefill_whose_requests_all_fail_passes():
    ok = h200_prefill_loss(frozen_first=True, errors=4, ok=0, in_flight_at_kill=4,
                           past_prefill_at_kill=0, errors_before_first_token=4,
                           status_counts={"502 prefill_request_failed": 4})
    assert leg_loss_problems(ok, BOUND) == []
