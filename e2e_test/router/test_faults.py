"""Fault injection on CPU topologies: each fault must fail fast, say what happened, and
leave nothing behind."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from e2e_test.infra.cluster.diagnostics import nested_failure
from e2e_test.infra.errors import StallError, WorkerDied
from e2e_test.infra.lifecycle import process, reaper
from e2e_test.infra.load import bursts
from e2e_test.infra.specs import settings
from e2e_test.infra.specs.topology import parse
from e2e_test.infra.startup import child_env

pytestmark = [pytest.mark.e2e, pytest.mark.fault, pytest.mark.engines("vllm")]
STALL_WINDOW_S = settings.get("E2E_FAULT_STALL_WINDOW_S")


# How long a fault waits for its burst's first streamed chunk before it gives up (the burst
# then ends unfaulted, and the test fails on the error it did not raise).
STREAM_WAIT_S = 120.0


def _fault_mid_burst(proc_tree_pids, sig, stamp) -> threading.Event:
    """Send `sig` to the processes once the burst streams: returns the event to hand to the
    burst (`streaming`, set at its first chunk). Whatever the hardware's pace: a fixed delay
    after the start can land after the burst's end (an H200 decodes it in under 3 s)."""
    streaming = threading.Event()

    def go():
        if not streaming.wait(STREAM_WAIT_S):
            return
        stamp["t"] = time.monotonic()
        for pid in proc_tree_pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    threading.Thread(target=go, daemon=True).start()
    return streaming


@pytest.mark.topology_kinds("regular")
def test_worker_killed_mid_burst(disposable_cluster, record):
    """It breaks its topology: the shared regular one after its other tests, where this
    process holds it (no boot of its own)."""
    c = disposable_cluster
    w = c.workers[0]
    stamp = {}
    # kill -9 the API server process only: its engine children become orphans that
    # teardown must still find and stop.
    streaming = _fault_mid_burst(lambda: [w.process.pid], signal.SIGKILL, stamp)
    with pytest.raises(WorkerDied) as exc:
        bursts.burst(c.gateway_url, c.model_name, n=16, max_tokens=256, stream=True,
                     name="kill-9", watchdog=c.watchdog("burst"), streaming=streaming)
    detected_s = time.monotonic() - stamp["t"]
    msg = str(exc.value)
    assert "worker-0" in msg and "signal 9" in msg, msg
    assert detected_s <= 5.0, f"worker death noticed after {detected_s:.1f} s"
    rep = c.stop(verify_strict=False)
    record.update(fault="kill -9 worker mid-burst", message=msg.splitlines()[0],
                  detected_s=round(detected_s, 2), teardown=rep.to_dict())
    print(f"kill -9: failed after {detected_s:.2f} s: {msg.splitlines()[0]}; "
          f"teardown {rep.verdict()}; shm removed {len(rep.shm_removed)}")
    assert rep.ok, rep.verdict()


@pytest.mark.topology_kinds("pd")
def test_decode_stalled(disposable_cluster, record):
    """It breaks its topology: the shared PD one after its other tests, where this process
    holds it (no boot of its own)."""
    c = disposable_cluster
    d = c.role("decode")[0]
    stamp = {}
    streaming = _fault_mid_burst(lambda: [p.pid for p in d.process.tree()], signal.SIGSTOP,
                                 stamp)
    with pytest.raises(StallError) as exc:
        bursts.burst(c.gateway_url, c.model_name, n=8, max_tokens=256, stream=True,
                     name="sigstop-decode", streaming=streaming,
                     watchdog=c.watchdog("burst", window_s=STALL_WINDOW_S))
    detected_s = time.monotonic() - stamp["t"]
    msg = str(exc.value)
    assert "decode-0" in msg.splitlines()[0], msg
    assert detected_s <= STALL_WINDOW_S + 15, f"stall noticed after {detected_s:.1f} s"
    rep = c.stop(verify_strict=False)
    record.update(fault="SIGSTOP decode", message=msg.splitlines()[0],
                  detected_s=round(detected_s, 2), window_s=STALL_WINDOW_S,
                  teardown=rep.to_dict())
    print(f"SIGSTOP decode: failed after {detected_s:.2f} s (window {STALL_WINDOW_S:.0f} s): "
          f"{msg.splitlines()[0]}; teardown {rep.verdict()}")
    assert rep.ok, rep.verdict()


CHILD_TEST = textwrap.dedent("""
    def test_boot(cluster):
        pass
""")


def test_sigterm_while_starting(own_cluster, record, tmp_path, engine_name, e2e_backend):
    """SIGTERM to a pytest that is starting a topology: all gone within 30 s."""
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    env = {**child_env(parse("1"), e2e_backend), "E2E_RESULTS_DIR": str(tmp_path / "results"),
           "CI": ""}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "e2e_test.pytest_plugin", "-q", "-s",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_child.py"),
         "--topology", "1", "--engine", engine_name],
        cwd=root, env={**env, "PYTHONPATH": process.extend_pythonpath(root, env.get("PYTHONPATH", ""))},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    # Wait until its worker has spawned its engine process (a tree of at least 2), remember
    # the whole tree, then SIGTERM the pytest while the topology is still starting.
    deadline = time.monotonic() + 90
    tree = []
    while time.monotonic() < deadline:
        try:
            tree = [p for p in psutil.Process(child.pid).children(recursive=True)
                    if p.is_running()]
        except psutil.Error:
            break
        if len(tree) >= 2 and any("api_server" in " ".join(p.cmdline()) for p in tree):
            break
        time.sleep(0.5)
    assert len(tree) >= 2, f"child pytest did not get as far as starting a worker: {tree}"
    t0 = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=60)
    # The guardian outlives its driver by design (it sweeps after the driver's exit), so the
    # tree is watched until the 30 s from the signal are up, not sampled once at the exit.
    alive = list(tree)
    while True:
        alive = [p for p in alive if reaper.running(p)]
        if not alive or time.monotonic() - t0 > 30:
            break
        time.sleep(0.1)
    took = time.monotonic() - t0
    record.update(fault="SIGTERM to pytest while starting", teardown_s=round(took, 2),
                  processes_before=len(tree), processes_left=len(alive))
    print(f"SIGTERM while starting: {len(tree)} processes, all gone in {took:.1f} s "
          f"(exit {child.returncode})")
    assert not alive, f"left behind: {[p.pid for p in alive]}\n{out[-2000:]}"
    assert took <= 30, f"teardown took {took:.1f} s\n{out[-2000:]}"
    assert "tearing down" in out, nested_failure(out, tmp_path / "results", tail=2000)
