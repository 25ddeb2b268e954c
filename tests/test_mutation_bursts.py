"""Negative controls for every pass/fail branch of e2e_test/infra/load/bursts.py, each a bug a
mutant of it showed no other unit test caught (docs/mutation.md): the window preflight's
smallest stage, its bounds at exactly the window, the admission verdict's bounds at their
edges (the 429 count, the 503 lateness, the 429 speed, the slack), and the functions that talk
HTTP (burst, effective_window, read_windows, preflight) against a server in this process."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
from local_http import serve

from e2e_test.infra.cluster.gateway import Admission
from e2e_test.infra.engines.vllm import ENGINE as VLLM
from e2e_test.infra.errors import HarnessError
from e2e_test.infra.load import bursts, load
from e2e_test.infra.load.bursts import WindowError, check_window

ADM = Admission(max_concurrent_requests=2, queue_size=2, queue_timeout_secs=5)


def w(n, stage=None, source="/server_info", **kw):
    d = {"max_num_seqs": n, "source": source, **kw}
    if stage:
        d["stage"] = stage
    return d


def ok(i, tokens=8, latency=1.0):
    return load.RequestResult(index=i, status=200, output_tokens=tokens, latency_s=latency)


def refused(i, status=429, latency=0.05, code=None, retry="1"):
    return load.RequestResult(index=i, status=status, error=f"HTTP {status}",
                              error_code=code or bursts.ADMISSION_CODES[status],
                              retry_after=retry, latency_s=latency)


def res(results, requested=None, delta=None, tokens=8, name="b"):
    return bursts.BurstResult(name, load.RunReport(list(results), wall_s=1.0), tokens,
                              rejected_metric_delta=delta,
                              requested=len(results) if requested is None else requested)


def fails(r, adm=ADM, **kw) -> str:
    with pytest.raises(HarnessError) as e:
        bursts.check_admission(r, adm, **kw)
    return str(e.value)


# -- window preflight -------------------------------------------------------------------------

def test_pd_smallest_stage_is_judged_not_the_first_by_name():
    """A prefill window of 2 and a decode window of 8 against a burst of 8 without admission:
    the prefill holds 2 at once, so the preflight fails on it (the alphabetically first stage,
    decode, holds the burst)."""
    wins = {"prefill-0": w(2, "prefill"), "decode-0": w(8, "decode")}
    with pytest.raises(WindowError) as e:
        check_window(wins, 8, None)
    assert str(e.value) == (
        "window preflight: a burst of 8 with no admission configured, but the window is 2: "
        "prefill (prefill-0: 2) runs at most 2 request(s) at once (max_num_seqs); configure "
        "admission (smg --max-concurrent-requests <= 2) or give a window >= 8")
    # with admission at the prefill's window it passes, and every stage's capacity is returned
    assert check_window(wins, 8, Admission(2)) == {"prefill": 2, "decode": 8}
    with pytest.raises(WindowError, match=r"smg admits 3 at once, but the window is 2: prefill "
                       r"\(prefill-0: 2\) \(max_num_seqs\); set --max-concurrent-requests <= 2 "
                       r"or give a window >= 3$"):
        check_window(wins, 8, Admission(3))


@pytest.mark.parametrize("window, burst, passes", [(8, 8, True), (8, 9, False), (9, 8, True)])
def test_window_of_exactly_the_burst_passes_one_less_fails(window, burst, passes):
    wins = {"worker-0": w(window)}
    if passes:
        assert check_window(wins, burst, None) == {"regular": window}
    else:
        with pytest.raises(WindowError, match=f"a burst of {burst} with no admission"):
            check_window(wins, burst, None)


@pytest.mark.parametrize("admits, passes", [(4, True), (5, False), (3, True)])
def test_admission_of_exactly_the_window_passes_one_more_fails(admits, passes):
    wins = {"a": w(2, "decode"), "b": w(2, "decode")}       # a stage sums its workers
    adm = Admission(max_concurrent_requests=admits)
    if passes:
        assert check_window(wins, 64, adm) == {"decode": 4}
    else:
        with pytest.raises(WindowError, match=r"smg admits 5 at once, but the window is 4: "
                                              r"decode \(a: 2, b: 2\)"):
            check_window(wins, 64, adm)


def test_unknown_windows_are_named_with_their_source_and_error():
    wins = {"w0": w(4), "w1": {"max_num_seqs": "4"}, "w2": w(None, source="log", error="boom")}
    with pytest.raises(WindowError) as e:
        check_window(wins, 4, Admission(1))
    assert str(e.value) == (
        "window preflight: the running window of w1, w2 is unknown (w1: unknown; w2: log "
        "(boom)) before a burst of 4; give the window (--max-num-seqs: "
        "EngineOptions(max_num_seqs=N), E2E_BURST_WINDOW) so it can be checked")


def test_no_window_at_all_is_an_error_with_or_without_admission():
    for adm in (None, ADM):
        with pytest.raises(WindowError, match="^window preflight: no serving worker to read "
                                              "a window from$"):
            check_window({}, 1, adm)


# -- admission verdict ------------------------------------------------------------------------

def test_a_429_for_a_request_the_gateway_had_room_for_fails():
    """4 requests against a capacity of 4 (2 running + 2 queued): none may find it full."""
    r = res([ok(0), ok(1), ok(2), refused(3)], delta=1)
    assert fails(r).endswith("b: 1 of 4 refused as queue full, but a capacity of 4 (2 running "
                             "+ 2 queued) leaves at most 0 to find it full")
    assert bursts.check_admission(res([ok(i) for i in range(4)], delta=0), ADM) == {
        "refused": 0, "ok": 4, "p99_refusal_s": None}


def test_429s_up_to_what_the_capacity_leaves_pass_one_more_fails():
    healthy = [ok(i) for i in range(4)] + [refused(i) for i in range(4, 7)]
    assert bursts.check_admission(res(healthy, delta=3), ADM)["refused"] == 3
    over = [ok(i) for i in range(3)] + [refused(i) for i in range(3, 7)]
    assert "4 of 7 refused as queue full" in fails(res(over, delta=4))


@pytest.mark.parametrize("latency, passes", [(7.0, True), (7.05, False), (6.9, True)])
def test_503_lateness_bound_is_the_queue_timeout_plus_2_s(latency, passes):
    """A 503 (queue timeout) may come up to 2 s after the queue timeout (5 s), no later."""
    r = res([ok(0), ok(1), ok(2), ok(3), refused(4, 503, latency=latency)], delta=1)
    if passes:
        assert bursts.check_admission(r, ADM)["p99_refusal_s"] == latency
    else:
        assert fails(r) == "b: 503 after 7.0 s, queue timeout is 5 s"


@pytest.mark.parametrize("latency, passes", [(1.0, True), (1.01, False)])
def test_429_speed_bound(latency, passes):
    r = res([ok(i) for i in range(4)] + [refused(4, latency=latency)], delta=1)
    if passes:
        bursts.check_admission(r, ADM)
    else:
        assert fails(r) == "b: 429 refusals not fast: slowest 1.01 s > 1.0 s"
    assert bursts.check_admission(r, ADM, fast_s=1.01)["refused"] == 1


@pytest.mark.parametrize("latency, passes", [(65.0, True), (65.1, False)])
def test_slack_bound_on_the_slowest_request(latency, passes):
    r = res([ok(0, latency=latency), ok(1)], delta=0)
    if passes:
        bursts.check_admission(r, ADM)
    else:
        assert fails(r) == "b: a request took 65.1 s (queue timeout 5 s + 60.0 s slack)"


def test_every_problem_is_named_once_in_one_line():
    r = res([ok(0, tokens=7), ok(1, tokens=6),
             refused(2, code="x", retry=None), refused(3, code="y", retry=None),
             load.RequestResult(index=4, status=None, error="ConnectError: refused")],
            delta=5)
    assert fails(r) == (
        "b: 1 request(s) failed other than by admission: None ConnectError: refused; "
        "HTTP 429 with code 'x', expected 'admission_queue_full'; admitted request 0 returned "
        "7 tokens, expected 8; 2 of 5 refused as queue full, but a capacity of 4 (2 running + "
        "2 queued) leaves at most 1 to find it full; smg_admission_queue_rejected_total grew "
        "by 5, client counted 2 refusals")
    no_retry = res([ok(0), ok(1), ok(2), ok(3), refused(4, retry=None), refused(5, retry="")],
                   delta=2)
    assert fails(no_retry) == "b: HTTP 429 admission_queue_full without a retry-after header"


def test_a_burst_over_the_capacity_with_none_refused_fails_at_the_capacity_passes():
    assert "5 requests against a capacity of 4 and none was refused" in fails(
        res([ok(i) for i in range(5)]))
    bursts.check_admission(res([ok(i) for i in range(4)]), ADM)


def test_no_admitted_request_fails_and_an_unread_counter_is_not_compared():
    only_refused = res([refused(i, 503, latency=5.0) for i in range(3)], delta=3)
    assert fails(only_refused) == ("b: no request was admitted and completed: the admitted "
                                   "path went untested")
    # rejected_metric_delta None: smg's counter was not read, nothing to compare
    assert bursts.check_admission(res([ok(0), refused(1)] + [ok(i) for i in range(2, 5)]),
                                  ADM)["refused"] == 1


def test_within_capacity_names_the_first_bad_request():
    bursts.check_within_capacity(res([ok(0), ok(1)]))
    bad = res([ok(0), refused(1, 503), ok(2, tokens=9)])
    with pytest.raises(HarnessError) as e:
        bursts.check_within_capacity(bad)
    assert str(e.value) == ("b: 2/3 requests not 200 with 8 tokens; first: status 503, 0 "
                            "tokens, HTTP 503")


def test_a_burst_whose_requested_count_is_unknown_judges_what_ran():
    r = res([ok(0), ok(1)], requested=0)
    bursts.check_within_capacity(r)
    with pytest.raises(HarnessError, match="^b: 2 results for 3 requests sent$"):
        bursts.check_within_capacity(res([ok(0), ok(1)], requested=3))


def test_summary_keeps_every_field_of_the_burst():
    r = res([ok(0), refused(1, latency=0.25)], delta=1.0, name="versus")
    r.effective_window, r.admission = {"max_num_seqs": 2}, {"queue_size": 2}
    s = r.summary()
    assert {k: s[k] for k in ("name", "expected_tokens", "requested", "refusal_latency_s",
                              "rejected_metric_delta", "effective_window", "admission", "n",
                              "ok")} == {
        "name": "versus", "expected_tokens": 8, "requested": 2,
        "refusal_latency_s": load.percentiles([0.25]), "rejected_metric_delta": 1.0,
        "effective_window": {"max_num_seqs": 2}, "admission": {"queue_size": 2}, "n": 2,
        "ok": 1}


# -- burst() against a gateway in this process ------------------------------------------------

def _gateway(capacity):
    """Answers the first `capacity` completions with max_tokens tokens, refuses the rest as
    queue full, and counts them in smg's rejected counter on /metrics."""
    state = {"rejected": 0}

    def complete(body, n):
        if n < capacity:
            return 200, {"choices": [{"text": "x"}],
                         "usage": {"completion_tokens": body["max_tokens"],
                                   "prompt_tokens": 3}}, {}
        state["rejected"] += 1
        return 429, {"error": {"code": "admission_queue_full"}}, {"retry-after": "1"}

    def metrics_page(body, n):
        return 200, f"{bursts.REJECTED} {state['rejected']}\n", {}
    return {("POST", "/v1/completions"): complete, ("GET", "/metrics"): metrics_page}


def test_burst_sends_n_requests_and_counts_the_gateways_refusals():
    with serve(_gateway(3)) as srv:
        r = bursts.burst(srv.url, "m", 5, max_tokens=7, name="versus",
                         metrics_url=srv.url + "/metrics", timeout=10)
    posts = [b for m, p, b in srv.calls if p == "/v1/completions"]
    assert len(posts) == 5 and {b["model"] for b in posts} == {"m"}
    assert {b["max_tokens"] for b in posts} == {7} and all(b["ignore_eos"] for b in posts)
    assert (r.name, r.requested, r.expected_tokens, r.rejected_metric_delta) == (
        "versus", 5, 7, 2.0)
    assert sorted(x.status for x in r.report.results) == [200, 200, 200, 429, 429]
    assert bursts.check_admission(r, Admission(1, 2)) == {"refused": 2, "ok": 3,
                                                         "p99_refusal_s": pytest.approx(
                                                             r.summary()["refusal_latency_s"]
                                                             ["p99"])}
    with serve(_gateway(5)) as srv:
        r = bursts.burst(srv.url, "m", 2, max_tokens=3, timeout=10)
    assert r.rejected_metric_delta is None and r.requested == 2 and r.name == "burst"
    assert not [c for c in srv.calls if c[1] == "/metrics"]
    bursts.check_within_capacity(r)


def test_burst_requests_shape():
    plain = bursts.burst_requests("m", 2, max_tokens=4, prompt_words=60)
    chat = bursts.burst_requests("m", 1, chat=True)
    assert [r.path for r in plain] == ["/v1/completions"] * 2 and [r.tag for r in plain] == [0, 1]
    assert plain[1].body["prompt"].startswith("Request 1. ")
    assert plain[1].body["prompt"].count("The sea was calm.") == 5
    assert chat[0].path == "/v1/chat/completions"
    assert chat[0].body["messages"][0]["content"].startswith("Request 0. ")


# -- the window a worker reports: log, /server_info, retries ----------------------------------

@pytest.mark.parametrize("log, want", [
    ("... max_num_seqs=8, max_model_len", 8),
    ("config: {'max_num_seqs': 16}", 16),
    ('"max_num_seqs": 4', 4),
    ("max_num_seqs:32", 32),
])
def test_window_from_the_startup_log(log, want):
    assert bursts._window_from_log(log) == {"max_num_seqs": want, "source": "log"}
    assert bursts.effective_window("http://127.0.0.1:9", log) == {"max_num_seqs": want,
                                                                   "source": "log"}


def test_a_log_without_the_window_is_unknown_with_why():
    assert bursts._window_from_log("no window here", error="down") == {
        "max_num_seqs": None, "source": "unknown", "error": "down"}
    assert bursts._window_from_log("") == {"max_num_seqs": None, "source": "unknown"}


def _server_info(window, fail_first=0):
    def info(body, n):
        if n < fail_first:
            return 503, "busy", {}
        return 200, {"vllm_config": {"scheduler_config": {
            "max_num_seqs": window, "max_num_batched_tokens": 2048}}}, {}
    return {("GET", "/server_info"): info}


def test_effective_window_prefers_the_worker_then_falls_back_to_the_log():
    with serve(_server_info(6)) as srv:
        assert bursts.effective_window(srv.url, "max_num_seqs=9", engine=VLLM) == {
            "max_num_seqs": 6, "max_num_batched_tokens": 2048, "source": "/server_info"}
    with serve({}) as srv:       # /server_info 404: the log, with why the worker did not say
        assert bursts.effective_window(srv.url, "max_num_seqs=9", engine=VLLM) == {
            "max_num_seqs": 9, "source": "log"}
        assert bursts.effective_window(srv.url, "", engine=VLLM) == {
            "max_num_seqs": None, "source": "unknown", "error": "/server_info HTTP 404"}
    no_way = types.SimpleNamespace(running_window=lambda url, timeout: None)
    assert bursts.effective_window("http://x", "max_num_seqs=3", engine=no_way)["source"] == "log"


def _cluster(srv_url, workers):
    ws = [types.SimpleNamespace(name=name, url=srv_url,
                                command=types.SimpleNamespace(worker_type=kind),
                                process=types.SimpleNamespace(log_text=lambda log=log: log)
                                if log is not None else None)
          for name, kind, log in workers]
    return types.SimpleNamespace(workers=ws, driver=VLLM)


def test_read_windows_retries_a_failed_read_and_skips_workers_without_a_window():
    with serve(_server_info(4, fail_first=2)) as srv:
        c = _cluster(srv.url, [("encode-0", "encode", ""), ("prefill-0", "prefill", ""),
                               ("decode-0", "decode", None)])
        wins = bursts.read_windows(c, tries=3, timeout=5)
    assert wins == {"prefill-0": {"max_num_seqs": 4, "max_num_batched_tokens": 2048,
                                  "source": "/server_info", "stage": "prefill"},
                    "decode-0": {"max_num_seqs": 4, "max_num_batched_tokens": 2048,
                                 "source": "/server_info", "stage": "decode"}}
    assert len(srv.calls) == 4           # prefill: 2 failed reads, then one; decode: one
    with serve(_server_info(4, fail_first=9)) as srv:
        c = _cluster(srv.url, [("worker-0", "regular", "")])
        wins = bursts.read_windows(c, tries=2, timeout=5)
    assert wins["worker-0"]["error"] == "/server_info HTTP 503" and len(srv.calls) == 2


def test_read_windows_stops_at_a_worker_that_answers_without_a_window():
    with serve(_server_info(None)) as srv:
        wins = bursts.read_windows(_cluster(srv.url, [("worker-0", "regular", "")]), tries=3)
    assert wins["worker-0"]["max_num_seqs"] is None and len(srv.calls) == 1


def test_preflight_reads_then_checks():
    with serve(_server_info(2)) as srv:
        c = _cluster(srv.url, [("prefill-0", "prefill", ""), ("decode-0", "decode", "")])
        assert bursts.preflight(c, 2, None) == {"prefill": 2, "decode": 2}
        with pytest.raises(WindowError, match="a burst of 3 with no admission"):
            bursts.preflight(c, 3, None)


def test_histogram_writes_a_png_of_every_status(tmp_path):
    pytest.importorskip("matplotlib")
    r = res([ok(0), ok(1, latency=2.0), refused(2)])
    out = bursts.histogram(r, tmp_path / "sub" / "h.png")
    assert out == tmp_path / "sub" / "h.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_result_with_replace_keeps_admission_codes():
    """ADMISSION_CODES is what the gateway's refusals must carry (smg 1.13)."""
    assert bursts.ADMISSION_CODES == {429: "admission_queue_full",
                                      503: "admission_queue_timeout"}
    r = dataclasses.replace(refused(0), status=503)
    assert "HTTP 503 with code 'admission_queue_full'" in fails(
        res([ok(1), ok(2), r], delta=1))


# -- what burst(), effective_window() and read_windows() pass on ------------------------------

class SpyEngineWindow:
    """A stand-in engine for these unit tests of the window logic only: it answers
    running_window from a script and records the timeout each call was given."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.timeouts = []

    def running_window(self, url, timeout):
        self.timeouts.append(timeout)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_effective_window_passes_its_timeout_and_keeps_the_engines_error():
    spy = SpyEngineWindow([{"error": "RpcError"}])
    assert bursts.effective_window("u", engine=spy) == {
        "max_num_seqs": None, "source": "unknown", "error": "RpcError"}
    assert bursts.effective_window("u", "max_num_seqs=3", timeout=2.5, engine=spy) == {
        "max_num_seqs": 3, "source": "log"}
    assert spy.timeouts == [5.0, 2.5]


def test_read_windows_defaults_three_tries_of_10_s_and_falls_back_to_each_log():
    spy = SpyEngineWindow([{"error": "timeout"}])
    c = types.SimpleNamespace(driver=spy, workers=[types.SimpleNamespace(
        name="worker-0", url="u", command=types.SimpleNamespace(worker_type="regular"),
        process=types.SimpleNamespace(log_text=lambda: "no window"))])
    assert bursts.read_windows(c) == {"worker-0": {"max_num_seqs": None, "source": "unknown",
                                                   "error": "timeout", "stage": "regular"}}
    assert spy.timeouts == [10.0] * 3
    c.workers[0].process = types.SimpleNamespace(log_text=lambda: "max_num_seqs=5")
    assert bursts.read_windows(c, timeout=1.0)["worker-0"] == {
        "max_num_seqs": 5, "source": "log", "stage": "regular"}
    assert spy.timeouts[3:] == [1.0]


def test_preflight_passes_the_admission_on():
    spy = SpyEngineWindow([{"max_num_seqs": 2, "source": "/server_info"}])
    c = types.SimpleNamespace(driver=spy, workers=[types.SimpleNamespace(
        name="worker-0", url="u", command=types.SimpleNamespace(worker_type="regular"),
        process=None)])
    assert bursts.preflight(c, 8, Admission(2)) == {"regular": 2}
    with pytest.raises(WindowError, match="a burst of 8 with no admission"):
        bursts.preflight(c, 8, None)


def test_burst_runs_every_request_at_once_with_its_options(monkeypatch):
    seen = {}
    real = load.run

    def spy_run(base_url, reqs, **kw):
        seen.update(kw, n=len(reqs), max_tokens={r.body["max_tokens"] for r in reqs})
        return real(base_url, reqs, **kw)
    monkeypatch.setattr(bursts.load, "run", spy_run)
    dog = load.Watchdog(window_s=30)
    with serve(_gateway(9)) as srv:
        r = bursts.burst(srv.url, "m", 3, watchdog=dog)
        assert seen == {"concurrency": 3, "stream": False, "timeout": 300.0, "watchdog": dog,
                        "n": 3, "max_tokens": {32}, "streaming": None}
        assert r.expected_tokens == 32
        ev = threading.Event()
        bursts.burst(srv.url, "m", 2, stream=True, timeout=9.0, streaming=ev)
        assert (seen["stream"], seen["timeout"], seen["concurrency"]) == (True, 9.0, 2)
        assert seen["streaming"] is ev


def test_burst_request_bodies_exactly():
    (plain,) = bursts.burst_requests("m", 1)
    text = "Request 0. Write a short story about a lighthouse keeper. "
    assert plain.body == {"model": "m", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                          "prompt": text}
    (chat,) = bursts.burst_requests("m", 1, max_tokens=4, prompt_words=44, chat=True)
    assert chat.body == {"model": "m", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                         "messages": [{"role": "user", "content": text + "The sea was calm. "}]}
    assert chat.tag == 0 and bursts.burst_requests("m", 2, chat=True)[1].tag == 1


def test_long_errors_are_cut_to_160_characters():
    long = "e" * 300
    r = res([ok(0), load.RequestResult(index=1, status=500, error=long)])
    with pytest.raises(HarnessError) as e:
        bursts.check_within_capacity(r)
    assert str(e.value).endswith(", 0 tokens, " + "e" * 160)
    assert fails(r).endswith("failed other than by admission: 500 " + "e" * 160)


def test_effective_window_check_messages():
    with pytest.raises(WindowError) as e:
        bursts.check_effective_window({"max_num_seqs": None}, 2)
    assert str(e.value) == ("window check: the running window of worker is unknown (unknown) "
                            "after a burst meant for a window of 2")
    with pytest.raises(WindowError) as e:
        bursts.check_effective_window({"source": "log"}, 2)
    assert str(e.value) == ("window check: the running window of worker is unknown (log) "
                            "after a burst meant for a window of 2")


def test_histogram_draws_each_status_as_a_stacked_group(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    drawn = {}
    real = plt.subplots

    def spy_subplots(*a, **kw):
        fig, ax = real(*a, **kw)
        drawn.update(fig=fig, ax=ax)
        return fig, ax
    monkeypatch.setattr(plt, "subplots", spy_subplots)
    r = res([ok(0), ok(1, latency=2.0), refused(2, latency=1.0), refused(3, 503, latency=5.0)],
            name="versus")
    out = bursts.histogram(r, tmp_path / "a" / "b" / "h.png")
    bursts.histogram(r, out)                       # again into the same folder
    ax, fig = drawn["ax"], drawn["fig"]
    assert ax.get_xlabel() == "end-to-end latency (s)" and ax.get_ylabel() == "requests"
    assert ax.get_title() == "versus: 4 requests"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "200", "429 admission_queue_full", "503 admission_queue_timeout"]
    assert len(ax.patches) == 3 * 30                # 30 bins per group
    tops = [p.get_y() + p.get_height() for p in ax.patches]
    assert max(tops) == 2                # stacked: a 200 and a 429 at 1.0 s share a bin
    assert tuple(fig.get_size_inches()) == (7, 4)
    head = out.read_bytes()
    assert (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")) == (630, 360)
    assert not plt.fignum_exists(fig.number)        # closed
