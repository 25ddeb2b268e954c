"""SIGKILL of a driver that holds a real topology: the guardian (infra/lifecycle/reaper.py) stops every
process of it, within 10 s, and writes what it did to the results folder; with the guardian
killed too, the next run's preflight names or clears what was left."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from e2e_test.infra.errors import PreflightError
from e2e_test.infra.startup import child_env
from e2e_test.infra.lifecycle import reaper
from e2e_test.infra.lifecycle.process import extend_pythonpath
from e2e_test.infra.specs.topology import parse

pytestmark = [pytest.mark.e2e, pytest.mark.fault, pytest.mark.engines("vllm")]
GONE_WITHIN_S = 10.0

# A user's script through the library, nothing else: boot `1`, answer once, then wait to die.
DRIVER = textwrap.dedent("""
    import json, sys, time
    from e2e_test.infra.lifecycle import reaper
    from e2e_test.infra.cluster.cluster import Cluster
    from e2e_test.infra.engines import EngineOptions
    model, engine, backend = sys.argv[1:4]
    with Cluster(model=model, engine=engine, topology="1", backend=backend,
                 options=EngineOptions(enforce_eager=True)) as c:
        c.chat("Say hi", max_tokens=4)
        print("READY " + json.dumps({"run": reaper.run_id(), "guardian": reaper.guardian_pid(),
                                     "cluster": c.name}), flush=True)
        time.sleep(600)
""")


def _alive(procs):
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _start_driver(tmp_path, model, engine, backend):
    """The driver script holding `1`: (Popen, READY info, its output lines, results dir,
    every process of its topology)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    res = tmp_path / "results"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**child_env(parse("1"), backend), "E2E_RESULTS_DIR": str(res), "CI": "",
           "PYTHONPATH": extend_pythonpath(root)}
    driver = subprocess.Popen([sys.executable, str(script), model, engine, backend], cwd=root,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in driver.stdout:
            lines.append(line)
            if line.startswith("READY "):
                ready.set()
    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while not ready.wait(0.5):
        if driver.poll() is not None or time.monotonic() > deadline:
            how = (f"exited with {driver.returncode}" if driver.poll() is not None
                   else "not ready within 300 s")
            driver.kill()
            driver.wait()
            time.sleep(0.5)          # the reader thread takes the last lines
            pytest.fail(f"driver holding `1` {how}:\n" + "".join(lines[-40:]))
    info = json.loads(next(ln for ln in lines if ln.startswith("READY "))[6:])
    # Every process of its topology: marked with its run id (engines' children included),
    # and whatever else descends from the driver, the guardian aside.
    found = {p.pid: p for p, _ in reaper.marked(info["run"])}
    for p in psutil.Process(driver.pid).children(recursive=True):
        if p.pid != info["guardian"]:
            found.setdefault(p.pid, p)
    return driver, info, lines, res, list(found.values())


def _finish(driver, tree) -> None:
    if driver.poll() is None:
        driver.kill()
        driver.wait()
    for p in _alive(tree):     # never leave anything running, even when failing
        try:
            p.kill()
        except psutil.Error:
            pass


def test_sigkill_of_a_driver_holding_1(own_cluster, record, tmp_path, engine_name, e2e_backend,
                                       request):
    del own_cluster  # requested so the shared topology is stopped first
    driver, info, lines, res, tree = _start_driver(
        tmp_path, request.config.getoption("--model"), engine_name, e2e_backend)
    try:
        names = sorted({p.name() for p in tree})
        assert len(tree) >= 3, f"expected API server, engine core and router: {names}"
        t0 = time.monotonic()
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        while _alive(tree) and time.monotonic() - t0 < GONE_WITHIN_S + 5:
            time.sleep(0.05)
        gone_s = time.monotonic() - t0
        left = _alive(tree)
        guardian = psutil.Process(info["guardian"]) if reaper.pid_alive(info["guardian"]) \
            else None
        report_path = res / f"reaper-{info['run']}.json"
        deadline = time.monotonic() + 5
        while not report_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        rep = json.loads(report_path.read_text()) if report_path.exists() else {}
        if guardian is not None:
            guardian.wait(timeout=5)
        record.update(fault="SIGKILL of a driver holding `1`", processes_before=len(tree),
                      process_names=names, processes_left=len(left),
                      all_gone_s=round(gone_s, 2), reaper=rep)
        exits = {s.split()[1]: s for s in rep.get("terminated", []) + rep.get("killed", [])}
        per = ", ".join(f"{exits.get(pid, 'pid ' + pid)[:60]}: {t} s"
                        for pid, t in sorted(rep.get("gone_s", {}).items(),
                                             key=lambda kv: -(kv[1] or 99)))
        print(f"driver SIGKILL: {len(tree)} processes ({', '.join(names)}), "
              f"{len(left)} left after {gone_s:.2f} s; reaper: {rep.get('why')}, "
              f"terminated {len(rep.get('terminated', []))}, killed {len(rep.get('killed', []))}"
              f", sweep {rep.get('seconds')} s; gone after the first signal: {per}")
        assert not left, f"alive {gone_s:.1f} s after SIGKILL: {[p.pid for p in left]}"
        assert gone_s <= GONE_WITHIN_S, f"all gone only after {gone_s:.1f} s"
        assert rep, f"no reaper report at {report_path}\n" + "".join(lines[-20:])
        assert rep["survivors"] == [] and not rep["goodbye"]
        stopped = {int(s.split()[1]) for s in rep["terminated"] + rep["killed"]}
        assert {p.pid for p in tree} <= stopped, rep
    finally:
        _finish(driver, tree)


def test_preflight_clears_what_a_killed_driver_and_guardian_left(own_cluster, record, tmp_path,
                                                                 engine_name, e2e_backend,
                                                                 request):
    """Guardian and driver both SIGKILLed (what the guardian cannot survive): the topology
    outlives them, as it would without a reaper; the next run's preflight names it (fail)
    or clears it (default), and only it."""
    del own_cluster
    driver, info, _, _, tree = _start_driver(
        tmp_path, request.config.getoption("--model"), engine_name, e2e_backend)
    try:
        reaper.PREFLIGHT_LOCK.acquire()    # no other worker's preflight sweeps the tree first
        os.kill(info["guardian"], signal.SIGKILL)
        while reaper.pid_alive(info["guardian"]):
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        time.sleep(2.0)
        left = _alive(tree)
        assert len(left) == len(tree), "without a guardian the topology should outlive"
        with pytest.raises(PreflightError) as exc:
            reaper.preflight(mode="fail")
        msg = str(exc.value)
        assert "\n" not in msg and all(f"pid {p.pid}" in msg for p in tree[:6]), msg
        assert len(_alive(tree)) == len(tree)       # fail mode touches nothing
        said: list[str] = []
        t0 = time.monotonic()
        done = reaper.preflight(mode="clear", log=said.append)
        cleared_s = time.monotonic() - t0
        left = _alive(tree)
        record.update(fault="SIGKILL of guardian and driver, then preflight",
                      processes_before=len(tree), processes_left=len(left),
                      fail_message=msg, cleared_s=round(cleared_s, 2),
                      preflight=done, log=said)
        print(f"preflight: {said[0] if said else 'said nothing'}; {len(left)} left after "
              f"{cleared_s:.2f} s; fail mode said: {msg[:200]}")
        assert not left, f"preflight left {[p.pid for p in left]}"
        assert cleared_s <= GONE_WITHIN_S
        assert len(said) == 1 and info["run"] in said[0]
        assert {int(x.split()[1]) for x in done["cleared"]["terminated"]
                + done["cleared"]["killed"]} >= {p.pid for p in tree}
    finally:
        reaper.PREFLIGHT_LOCK.release()
        _finish(driver, tree)
