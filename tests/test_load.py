"""The load driver against `fake_openai_server`, a tiny OpenAI-shaped HTTP server in a thread.

The fake exists only to exercise the driver's own logic (status/error recording, SSE parsing,
usage counts, the watchdog); every real test goes through real engines and the gateway.
What the fake does is chosen per request by the request's "model" field.
"""

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e2e_test.infra.errors import StallError, WorkerDied
from e2e_test.infra.load.load import (
    Request,
    RequestResult,
    RunReport,
    Watchdog,
    percentiles,
    run,
    run_async,
)

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):        # keep pytest output clean
        pass

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, events: list) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for e in events:
            line = e if isinstance(e, str) else json.dumps(e)
            self.wfile.write(f"data: {line}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, body))
        model, stream = body.get("model"), body.get("stream", False)
        chat = self.path == "/v1/chat/completions"
        if model == "hang":
            self.server.release.wait(30)     # accept, never answer
            return
        if model == "full":
            return self._json(429, {"error": {"code": "admission_queue_full",
                                              "message": "queue full"}}, {"Retry-After": "2"})
        if model == "timeout":
            return self._json(503, {"error": {"type": "admission_queue_timeout"}},
                              {"Retry-After": "1"})
        if model == "plain500":
            return self._json(500, {"detail": "boom"})
        if model == "nochoices":
            return self._json(200, {"choices": [], "usage": USAGE})
        if not stream:
            choice = ({"index": 0, "message": {"role": "assistant", "content": "Hello there"}}
                      if chat else {"index": 0, "text": "Hello there"})
            return self._json(200, {"id": "x", "choices": [choice], "usage": USAGE})
        pieces = ["Hel", "lo", " there"]
        events = [{"choices": [{"index": 0, "delta": {"content": p}} if chat
                               else {"index": 0, "text": p}]} for p in pieces]
        if model == "midstream_error":
            events = events[:1] + [{"error": {"code": "worker_died", "message": "x"}}]
        elif model != "nousage":
            events.append({"choices": [], "usage": USAGE})
        self._sse(events + ["[DONE]"])


@pytest.fixture
def fake_openai_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.seen, server.release = [], threading.Event()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.release.set()
    server.shutdown()
    server.server_close()


def chat(model: str = "ok", tag=None) -> Request:
    return Request("/v1/chat/completions", {"model": model, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "hi"}]},
                   tag=tag)


def completion(model: str = "ok", tag=None) -> Request:
    return Request("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4}, tag=tag)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one request ------------------------------------------------------------------------------

def test_non_streaming_chat_with_usage(fake_openai_server):
    server, url = fake_openai_server
    report = run(url, [chat(tag="row-7")], concurrency=1)
    (r,) = report.results
    assert r.ok and (r.status, r.error, r.error_code) == (200, "", "")
    assert (r.text, r.output_tokens, r.prompt_tokens, r.tag, r.index) == (
        "Hello there", 3, 7, "row-7", 0)
    assert r.ttft_s is not None and r.latency_s >= r.ttft_s > 0
    path, body = server.seen[0]
    assert path == "/v1/chat/completions" and "stream" not in body


def test_non_streaming_completion(fake_openai_server):
    _, url = fake_openai_server
    (r,) = run(url, [completion()]).results
    assert r.ok and r.text == "Hello there" and r.output_tokens == 3


@pytest.mark.parametrize("make", [chat, completion])
def test_streaming_with_usage_chunk(fake_openai_server, make):
    server, url = fake_openai_server
    (r,) = run(url, [make()], stream=True).results
    assert r.ok, r.error
    assert (r.status, r.text, r.chunks, r.output_tokens, r.prompt_tokens) == (
        200, "Hello there", 3, 3, 7)
    assert 0 < r.ttft_s <= r.latency_s
    body = server.seen[0][1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_streaming_is_signalled_at_the_first_chunk_and_never_without_one(fake_openai_server):
    """`streaming` (what a fault aimed mid-burst waits for, test_faults.py) is set once a
    streamed chunk arrives; a run that streams nothing (not streamed, or refused) leaves it
    unset."""
    import threading
    _, url = fake_openai_server
    ev = threading.Event()
    run(url, [chat()], stream=True, streaming=ev)
    assert ev.is_set()
    for stream in (False, True):
        ev = threading.Event()
        reqs = [chat()] if not stream else [chat("full")]
        run(url, reqs, stream=stream, streaming=ev)
        assert not ev.is_set()


def test_streaming_without_usage_is_an_error(fake_openai_server):
    _, url = fake_openai_server
    (r,) = run(url, [chat("nousage")], stream=True).results
    assert not r.ok and r.status == 200
    assert r.error == "stream ended without usage counts"
    assert r.text == "Hello there"


def test_streaming_error_event(fake_openai_server):
    _, url = fake_openai_server
    (r,) = run(url, [chat("midstream_error")], stream=True).results
    assert not r.ok and r.error_code == "worker_died"
    assert json.loads(r.error) == {"code": "worker_died", "message": "x"}
    # when the error was read: after the first token, before the request's end (the close)
    assert r.ttft_s is not None and r.ttft_s <= r.error_read_s <= r.latency_s


def test_error_read_time_only_for_a_read_error(fake_openai_server):
    _, url = fake_openai_server
    ok, full, refused = (run(u, [chat(m)], stream=True).results[0] for u, m in
                         ((url, "ok"), (url, "full"), (f"http://127.0.0.1:{free_port()}", "ok")))
    assert ok.ok and ok.error_read_s is None
    assert not full.ok and 0 < full.error_read_s <= full.latency_s
    assert not refused.ok and refused.error_read_s is None      # a transport error: no read


def _stalls_of_a_run(url, block_s: float) -> list:
    """The loop stalls of one run of a request held open ~1 s, while another coroutine of the
    same loop blocks it (time.sleep) for `block_s` (0: none)."""
    async def main():
        async def block():
            await asyncio.sleep(0.2)
            time.sleep(block_s)     # noqa: ASYNC251 (the stall under test)
        b = asyncio.ensure_future(block())
        rep = await run_async(url, [chat("hang")], stream=True, timeout=1.0)
        await b
        return rep
    return asyncio.run(main()).loop_stalls


def test_the_drivers_own_loop_stall_is_recorded(fake_openai_server):
    _, url = fake_openai_server
    stalls = _stalls_of_a_run(url, 1.0)
    assert [s for s in stalls if 0.9 <= s[1] < 1.6 and 0.1 < s[0] < 0.6], stalls
    # negative control: the same run, nothing blocking the loop (a busy host may be late a
    # little, never a second)
    assert not [s for s in _stalls_of_a_run(url, 0.0) if s[1] >= 0.9]


@pytest.mark.parametrize("stream", [False, True])
def test_admission_429_is_an_error_with_code_and_retry_after(fake_openai_server, stream):
    _, url = fake_openai_server
    (r,) = run(url, [chat("full")], stream=stream).results
    assert not r.ok
    assert (r.status, r.error_code, r.retry_after) == (429, "admission_queue_full", "2")
    assert json.loads(r.error)["error"]["code"] == "admission_queue_full"
    assert r.text == "" and r.output_tokens == 0


def test_admission_503_code_from_type(fake_openai_server):
    _, url = fake_openai_server
    (r,) = run(url, [chat("timeout")]).results
    assert (r.ok, r.status, r.error_code, r.retry_after) == (
        False, 503, "admission_queue_timeout", "1")


def test_other_http_errors(fake_openai_server):
    _, url = fake_openai_server
    plain, empty = run(url, [chat("plain500"), chat("nochoices")]).results
    assert (plain.ok, plain.status, plain.error_code, plain.retry_after) == (
        False, 500, "", None)
    assert "boom" in plain.error
    assert (empty.ok, empty.status) == (False, 200)
    assert empty.error.startswith("no choices in response")


def test_connection_refused_is_a_transport_error():
    (r,) = run(f"http://127.0.0.1:{free_port()}", [chat()], timeout=5).results
    assert not r.ok
    assert r.status is None
    assert r.error.startswith("ConnectError")
    assert RunReport([r], 1.0).status_counts() == {"transport": 1}


def test_results_keep_request_order_and_concurrency(fake_openai_server):
    server, url = fake_openai_server
    reqs = [chat(tag=i) if i % 3 else chat("full", tag=i) for i in range(12)]
    report = run(url, reqs, concurrency=4, stream=True)
    assert [r.index for r in report.results] == list(range(12))
    assert [r.tag for r in report.results] == list(range(12))
    assert len(report.ok) == 8 and len(report.errors) == 4
    assert all(r.status == 429 for r in report.errors)
    assert len(server.seen) == 12


# -- the watchdog -----------------------------------------------------------------------------

def test_watchdog_fires_on_a_stall(fake_openai_server):
    _, url = fake_openai_server
    calls = []
    diag = "topology 1p1d (vllm): looks stuck at decode-0\nworker queues: decode-0 {...}"

    def diagnose() -> str:
        calls.append(1)
        return diag

    wd = Watchdog(window_s=1.0, what="gsm8k", diagnose=diagnose)
    t0 = time.monotonic()
    with pytest.raises(StallError) as ei:
        run(url, [chat("hang"), chat("hang")], concurrency=2, watchdog=wd)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 2.0
    err = ei.value
    assert err.summary.startswith("gsm8k: no progress for ")
    assert "with 2 request(s) in flight (watchdog window 1 s)" in err.summary
    assert err.summary.endswith("; topology 1p1d (vllm): looks stuck at decode-0")
    assert err.details == diag
    assert calls == [1]
    assert wd.fired_at is not None and 1.0 <= wd.fired_at < 3.0


def test_watchdog_diagnose_failure_does_not_hide_the_stall(fake_openai_server):
    _, url = fake_openai_server

    def broken():
        raise RuntimeError("metrics down")

    with pytest.raises(StallError, match=r"diagnostics failed: RuntimeError\('metrics down'\)"):
        run(url, [completion("hang")], watchdog=Watchdog(window_s=1.0, diagnose=broken))


def test_watchdog_quiet_when_requests_progress(fake_openai_server):
    _, url = fake_openai_server
    wd = Watchdog(window_s=1.0)
    report = run(url, [chat() for _ in range(5)], concurrency=2, stream=True, watchdog=wd)
    assert len(report.ok) == 5 and wd.fired_at is None


# -- statistics -------------------------------------------------------------------------------

def test_percentiles():
    xs = [float(x) for x in range(10, 0, -1)]       # unsorted on purpose
    assert percentiles(xs) == {"p50": 5.0, "p90": 9.0, "p99": 10.0, "mean": 5.5, "max": 10.0}
    assert percentiles([]) == {}
    assert percentiles([0.25]) == {"p50": 0.25, "p90": 0.25, "p99": 0.25, "mean": 0.25,
                                   "max": 0.25}
    assert percentiles([1.0, 2.0], ps=(0, 100)) == {"p0": 1.0, "p100": 2.0, "mean": 1.5,
                                                    "max": 2.0}
    assert percentiles([1 / 3])["p50"] == 0.3333


def result(i, status, error="", code="", latency=1.0, ttft=0.5, tokens=10):
    return RequestResult(index=i, status=status, error=error, error_code=code,
                         latency_s=latency, ttft_s=ttft, output_tokens=tokens)


def test_run_report_status_counts_and_summary():
    report = RunReport([
        result(0, 200, latency=1.0),
        result(1, 200, latency=3.0, ttft=None),
        result(2, 429, "queue full", "admission_queue_full", tokens=0),
        result(3, 503, "timeout", "admission_queue_timeout", tokens=0),
        result(4, None, "ConnectError: refused", tokens=0),
        result(5, 200, "stream ended without usage counts", tokens=0),
    ], wall_s=2.0, client_overhead_s=0.0015)
    assert report.status_counts() == {"200": 3, "429 admission_queue_full": 1,
                                      "503 admission_queue_timeout": 1, "transport": 1}
    assert [r.index for r in report.ok] == [0, 1]
    assert [r.index for r in report.errors] == [2, 3, 4, 5]
    s = report.summary()
    assert (s["n"], s["ok"], s["errors"], s["wall_s"]) == (6, 2, 4, 2.0)
    assert (s["req_per_s"], s["output_tokens"], s["out_tok_per_s"]) == (1.0, 20, 10.0)
    assert s["latency_s"] == {"p50": 1.0, "p90": 3.0, "p99": 3.0, "mean": 2.0, "max": 3.0}
    assert s["ttft_s"]["max"] == 0.5
    assert s["client_overhead_ms"] == 1.5
    assert s["status_counts"] == report.status_counts()
    json.dumps(s)


def test_empty_report():
    s = RunReport([], wall_s=0.0).summary()
    assert (s["n"], s["ok"], s["req_per_s"], s["latency_s"], s["status_counts"]) == (
        0, 0, 0.0, {}, {})


def test_result_to_dict():
    d = RequestResult(index=0, tag=("row", 3), status=200).to_dict()
    assert d["tag"] == "('row', 3)" and d["status"] == 200
    assert RequestResult(index=1).to_dict()["tag"] is None


def test_dead_worker_seen_after_fast_failures():
    """A worker whose death shows up a moment after its requests failed is still reported:
    the driver looks again for a while before returning a report of errors."""
    t0 = time.monotonic()

    def check():
        return "worker-0 died: signal 9" if time.monotonic() - t0 > 0.5 else None

    wd = Watchdog(window_s=30, what="burst", check=check)
    with pytest.raises(WorkerDied) as ei:   # port 1: connection refused at once
        run("http://127.0.0.1:1", [Request("/v1/completions", {"model": "x"})], watchdog=wd)
    assert "signal 9" in str(ei.value)


# -- progress lines ---------------------------------------------------------------------------

def test_progress_lines_count_done_requests(fake_openai_server, monkeypatch):
    from e2e_test.infra.cluster import progress
    server, url = fake_openai_server
    lines = []
    monkeypatch.setattr(progress, "sink", lines.append)
    monkeypatch.setenv("E2E_PROGRESS_S", "0.3")
    threading.Timer(1.2, server.release.set).start()
    run(url, [chat(), chat(), chat("hang"), chat("hang")], concurrency=4, label="probe",
        timeout=1.0)
    assert lines and all(ln.startswith("probe: 2/4 done, ") for ln in lines)
    assert len(lines) <= 5                       # one per interval, not one per request
    lines.clear()
    run(url, [chat()], concurrency=1)            # no label, no watchdog: silent
    assert lines == []


def test_a_slow_engine_poll_does_not_hold_the_stall_error(fake_openai_server):
    """The engine poll waits long for a loaded worker's /metrics; a stall's error must not wait
    for it (asyncio.run joins its default executor at exit: there it held the error 10 s)."""
    _, url = fake_openai_server
    release = threading.Event()

    def slow_metrics():
        release.wait(10.0)       # a worker that does not answer
        return None

    wd = Watchdog(window_s=1.0, what="recall", engine_progress=slow_metrics, engine_poll_s=0.1)
    t0 = time.monotonic()
    try:
        with pytest.raises(StallError):
            run(url, [completion("hang")], watchdog=wd)
        assert time.monotonic() - t0 < 1.0 + 2.5
    finally:
        release.set()
