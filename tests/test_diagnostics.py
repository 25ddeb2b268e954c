"""diagnostics.worker_queues / stuck_role: pure logic over a stand-in cluster (no engine)."""

from types import SimpleNamespace

import pytest

from e2e_test.infra.cluster import diagnostics
from e2e_test.infra.engines import tokenspeed, vllm


def _cluster(driver):
    return SimpleNamespace(driver=driver, engine=driver.name, workers=[])


def test_queue_gauges_come_from_the_engine_module():
    assert diagnostics.queue_gauges(_cluster(vllm.ENGINE)) == {
        "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
    assert diagnostics.queue_gauges(_cluster(tokenspeed.ENGINE)) == {
        "running": "tokenspeed:num_requests_running",
        "waiting": "tokenspeed:num_requests_waiting"}


def test_stuck_role_names_the_worker_holding_requests():
    q = {"prefill-0": {"running": 0.0, "waiting": 0.0},
         "decode-0": {"running": 3.0, "waiting": 1.0}}
    assert diagnostics.stuck_role(q) == "decode-0 (running 3, waiting 1)"


def test_stuck_role_negative_control_nobody_holds_requests():
    q = {"worker-0": {"running": 0.0, "waiting": 0.0}}
    assert diagnostics.stuck_role(q) == "gateway (no worker holds the requests)"


def test_stuck_role_dead_metrics_and_missing_gauges():
    assert diagnostics.stuck_role({"decode-0": {"error": "ConnectTimeout"}}) == \
        "decode-0 (metrics endpoint not answering)"
    c = _cluster(SimpleNamespace(name="x", idle_gauges=None))
    c.workers = [SimpleNamespace(name="w-0", http_url="http://127.0.0.1:1")]
    q = diagnostics.worker_queues(c)
    assert "names no queue gauges" in diagnostics.stuck_role(q)


def test_stuck_role_says_how_busy_the_worker_is():
    q = {"prefill-0": {"running": 1.0, "waiting": 0.0, "cores": 1.27},
         "decode-0": {"running": 0.0, "waiting": 0.0, "cores": 0.6}}
    assert diagnostics.stuck_role(q) == "prefill-0 (running 1, waiting 0, 1.3 cores busy)"


WAITS = "import time; print(1, flush=True); time.sleep(60)"


@pytest.mark.parametrize("competitors", [0, 3])
def test_cpu_cores_tells_a_computing_worker_from_a_waiting_one(competitors):
    """Also on a loaded machine: with 3 more spinners per core the busy worker gets about a
    quarter of a core, yet it asks for a whole one (schedstat: on-CPU plus run-queue wait)."""
    import os
    import subprocess
    import sys

    import psutil
    if competitors and not diagnostics.SCHEDSTAT:
        pytest.skip("no /proc/PID/schedstat on this kernel: cores are the CPU time received")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(competitors * (os.cpu_count() or 1))]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", WAITS], stdout=subprocess.PIPE)
    try:
        idle.stdout.readline()                         # its start-up done: it waits from now
        def w(name, proc):
            p = psutil.Process(proc.pid)
            return SimpleNamespace(name=name, process=SimpleNamespace(tree=lambda: [p]))
        gone = SimpleNamespace(name="remote-0", process=SimpleNamespace(tree=list))
        cores = diagnostics.cpu_cores([w("busy-0", busy), w("idle-0", idle), gone], 1.0)
        assert cores["busy-0"] > 0.3, cores
        assert cores["idle-0"] < 0.1, cores           # negative control: a waiting process
        assert cores["remote-0"] is None, cores       # nothing to read is not "idle"
    finally:
        for p in (busy, idle, *load):
            p.kill()
            p.wait()


def test_a_stopped_worker_is_named_without_waiting_for_its_metrics():
    import signal
    import subprocess
    import sys
    import time

    import psutil
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        p = psutil.Process(proc.pid)
        w = SimpleNamespace(name="decode-0", http_url="http://127.0.0.1:9",
                            process=SimpleNamespace(tree=lambda: [p]))
        assert diagnostics.stopped_pid(w) is None          # negative control: running
        proc.send_signal(signal.SIGSTOP)
        for _ in range(50):
            if p.status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.02)
        assert diagnostics.stopped_pid(w) == proc.pid
        c = _cluster(vllm.ENGINE)
        c.workers = [w]
        q = diagnostics.worker_queues(c)
        assert diagnostics.stuck_role(q) == \
            f"decode-0 (process {proc.pid} is stopped (state T, e.g. SIGSTOP))"
        # named before a worker that merely did not answer
        q["prefill-0"] = {"error": "ReadTimeout"}
        assert diagnostics.stuck_role(dict(reversed(q.items()))).startswith("decode-0")
    finally:
        proc.kill()
        proc.wait()
