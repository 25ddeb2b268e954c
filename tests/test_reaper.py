"""The reaper with real small processes: markers, the guardian of a driver that is SIGKILLed
(children, grandchildren, a grandchild that left the session, one that ignores SIGTERM, one that
is SIGSTOPped), the preflight with planted orphans and processes it must leave alone. NVML is
mocked only in the pure-logic tests at the end (GPU holders, the teardown settle wait)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from e2e_test.infra.errors import ConfigError, PreflightError
from e2e_test.infra.lifecycle import reaper, teardown
from e2e_test.infra.lifecycle.process import ManagedProcess

REPO = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 10.0

# A worker stand-in: forks a grandchild; both sleep. Modes change what the grandchild does.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    mode = sys.argv[1]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # inherited by the grandchild
    if os.fork() == 0:
        if mode == "setsid":
            os.setsid()                                 # leaves the worker's session
        if mode == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
        os._exit(0)
    time.sleep(600)
""")

# A driver: starts one ManagedProcess (from a thread that then ends, in mode "thread"),
# prints its run id, guardian pid and the pids of the worker tree, then obeys stdin:
# "stop" stops the worker cleanly, "exit" (or EOF) exits normally.
DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys, threading, time
    from pathlib import Path
    from e2e_test.infra.lifecycle import reaper
    from e2e_test.infra.lifecycle.process import ManagedProcess
    mode, child, logdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    box = {}
    def start():
        box["p"] = ManagedProcess("child", [sys.executable, child, mode], {},
                                  logdir / "child.log", tmp_env="E2E_T_DIR").start()
    if mode == "thread":
        t = threading.Thread(target=start); t.start(); t.join()
    else:
        start()
    p = box["p"]
    # Mode "plain": also a process the harness did not start (unmarked, not registered).
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={k: v for k, v in os.environ.items() if not k.startswith("E2E_")},
                             start_new_session=True) if mode == "plain" else None
    deadline = time.monotonic() + 20
    while len(p.known) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        p.remember_descendants()
    print(json.dumps({"run": reaper.run_id(), "guardian": reaper.guardian_pid(),
                      "pids": sorted(p.known), "plain": plain and plain.pid,
                      "tmp": p.tmp_dir}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            r = p.stop(grace=5)
            print(json.dumps({"stopped": not r.survivors}), flush=True)
        elif line.strip() == "exit":
            break
""")


def _alive(pids) -> list[int]:
    return [pid for pid in pids if reaper.pid_alive(pid)]


def _wait_gone(pids, timeout=GONE_WITHIN_S) -> tuple[list[int], float]:
    t0 = time.monotonic()
    while _alive(pids) and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    return _alive(pids), time.monotonic() - t0


def _cleanup(pids) -> None:
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def driver(tmp_path):
    """Start a driver script in a mode; yields (Popen, info, results dir); kills leftovers."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "driver.py").write_text(DRIVER)
    started = []

    def start(mode: str):
        res = tmp_path / "results"
        env = {**os.environ, "E2E_RESULTS_DIR": str(res),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        d = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), mode,
                              str(tmp_path / "child.py"), str(tmp_path / "logs")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        info = json.loads(d.stdout.readline())
        started.append((d, info))
        assert len(info["pids"]) == 2, info
        assert info["guardian"] and reaper.pid_alive(info["guardian"]), info
        return d, info, res

    yield start
    for d, info in started:
        d.kill()
        d.wait()
        _cleanup(info["pids"] + [info["guardian"]])


# -- markers ----------------------------------------------------------------------------------

def test_every_started_process_and_its_children_carry_the_run_marker(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    p = ManagedProcess("child", [sys.executable, str(tmp_path / "child.py"), "fork"], {},
                       tmp_path / "child.log").start()
    try:
        deadline = time.monotonic() + 10
        while len(p.tree()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = p.tree()
        assert len(tree) == 2
        mine = reaper.marker_env()
        for proc in tree:
            m = reaper.marker_of(proc)
            assert m is not None and m.run_id == mine[reaper.RUN_ID_ENV]
            assert m.driver_pid == os.getpid() and m.driver_alive()
        assert {q.pid for q, _ in reaper.marked(reaper.run_id())} >= {q.pid for q in tree}
        g = reaper.guardian_pid()
        assert g and reaper.marker_of(psutil.Process(g)) is None   # the guardian is unmarked
        assert reaper.Guardian.current.groups.get(p.pid)
    finally:
        rep = p.stop(grace=5)
    assert not rep.survivors
    assert p.pid not in reaper.Guardian.current.groups       # a clean stop unregisters


def test_half_a_marker_is_not_a_marker():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         env={**os.environ, reaper.RUN_ID_ENV: "x", reaper.DRIVER_PID_ENV: "nan?"})
    try:
        time.sleep(0.2)
        assert reaper.marker_of(psutil.Process(p.pid)) is None
    finally:
        p.kill()
        p.wait()


# -- the guardian -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["fork", "setsid", "stopped", "thread"])
def test_sigkill_of_the_driver_stops_its_whole_tree(driver, mode):
    d, info, res = driver(mode)
    if mode == "thread":
        # PR_SET_PDEATHSIG fires when the starting thread ends: that alone must stop nothing.
        time.sleep(1.5)
        assert not set(info["pids"]) - set(_alive(info["pids"])), "swept while driver alive"
    d.kill()
    d.wait()
    left, took = _wait_gone(info["pids"] + [info["guardian"]])
    assert not left, f"alive {took:.1f} s after SIGKILL of the driver: {left}"
    rep = json.loads((res / f"reaper-{info['run']}.json").read_text())
    assert rep["goodbye"] is False and "without a goodbye" in rep["why"]
    stopped = rep["terminated"] + rep["killed"]
    assert {int(s.split()[1]) for s in stopped} == set(info["pids"]), rep
    assert rep["survivors"] == [] and rep["killed"] == []
    # the worker's own temp folder (tmp_env), which its stop never removed, went with the run
    assert Path(info["tmp"]).parent == reaper.RUNS_DIR / f"{info['run']}.tmp"
    assert not Path(info["tmp"]).parent.exists()


def test_the_guardian_leaves_alone_what_the_harness_did_not_start(driver):
    """Negative control: the driver's own unmarked, unregistered child survives the sweep
    (so the test above sees survivors when there are any)."""
    d, info, res = driver("plain")
    try:
        d.kill()
        d.wait()
        left, _ = _wait_gone(info["pids"] + [info["guardian"]])
        assert not left
        time.sleep(0.5)
        assert reaper.pid_alive(info["plain"]), "an unmarked process was stopped"
        rep = json.loads((res / f"reaper-{info['run']}.json").read_text())
        assert not any(s.split()[1] == str(info["plain"]) for s in rep["terminated"])
    finally:
        _cleanup([info["plain"]])


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(driver):
    d, info, res = driver("ignore-term")
    d.kill()
    d.wait()
    left, took = _wait_gone(info["pids"] + [info["guardian"]])
    assert not left, f"alive {took:.1f} s after SIGKILL of the driver: {left}"
    assert took >= reaper.GRACE_S - 0.5        # it waited the grace before SIGKILL
    rep = json.loads((res / f"reaper-{info['run']}.json").read_text())
    assert len(rep["killed"]) == 2 and rep["survivors"] == []


def test_a_normal_exit_without_stop_leaves_nothing_either(driver):
    d, info, res = driver("fork")
    d.stdin.write("exit\n")
    d.stdin.flush()
    assert d.wait(timeout=10) == 0
    left, _ = _wait_gone(info["pids"] + [info["guardian"]])
    assert not left
    rep = json.loads((res / f"reaper-{info['run']}.json").read_text())
    assert rep["goodbye"] is True and len(rep["terminated"]) == 2


def test_after_a_clean_stop_the_guardian_exits_with_the_driver_and_writes_nothing(driver):
    d, info, res = driver("fork")
    d.stdin.write("stop\n")
    d.stdin.flush()
    assert json.loads(d.stdout.readline()) == {"stopped": True}
    assert reaper.pid_alive(info["guardian"])          # still guarding while the driver lives
    d.stdin.write("exit\n")
    d.stdin.flush()
    assert d.wait(timeout=10) == 0
    left, _ = _wait_gone([info["guardian"]])
    assert not left, "the guardian outlived its driver"
    assert not (res / f"reaper-{info['run']}.json").exists()


def test_a_killed_guardian_is_replaced_and_told_every_group(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    g = reaper.Guardian.get()
    p = ManagedProcess("child", [sys.executable, str(tmp_path / "child.py"), "fork"], {},
                       tmp_path / "child.log").start()
    try:
        old = g.proc
        os.kill(old.pid, signal.SIGKILL)
        old.wait()
        q = ManagedProcess("child2", [sys.executable, str(tmp_path / "child.py"), "fork"], {},
                           tmp_path / "child2.log").start()
        assert reaper.guardian_pid() != old.pid and reaper.pid_alive(reaper.guardian_pid())
        assert set(g.groups) >= {p.pid, q.pid}
        q.stop(grace=5)
    finally:
        p.stop(grace=5)


# -- preflight --------------------------------------------------------------------------------

SLEEPER = "import os, time\nif os.fork() == 0:\n    time.sleep(120)\n    os._exit(0)\ntime.sleep(120)\n"


def _dead_driver() -> tuple[int, float]:
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    create = reaper.started(p.pid)
    p.stdin.close()
    p.wait()
    return p.pid, create


def _spawn(marker: dict | None) -> tuple[subprocess.Popen, list[int]]:
    env = {k: v for k, v in os.environ.items()
           if k not in (reaper.RUN_ID_ENV, reaper.DRIVER_PID_ENV, reaper.DRIVER_CREATE_ENV)}
    env.update(marker or {})
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], env=env, start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = psutil.Process(p.pid).children()
        if kids:
            return p, [p.pid, kids[0].pid]
        time.sleep(0.05)
    raise AssertionError("sleeper did not fork")


def _marker(run: str, pid: int, create: float) -> dict:
    return {reaper.RUN_ID_ENV: run, reaper.DRIVER_PID_ENV: str(pid),
            reaper.DRIVER_CREATE_ENV: repr(create)}


@pytest.fixture
def sweeps_held():
    """This test's preflight is the only one on the machine while it runs: another xdist
    worker's preflight would sweep the orphans this test plants, or find the ones it plants
    where this test asserts that nothing is found."""
    with reaper.PREFLIGHT_LOCK:
        yield


@pytest.fixture
def planted(sweeps_held):
    made = []

    def plant(marker):
        p, pids = _spawn(marker)
        made.append((p, pids))
        return pids

    yield plant
    for p, pids in made:
        _cleanup(pids)
        p.wait()


@pytest.mark.parametrize("how", ["driver exited", "driver pid reused"])
def test_preflight_clears_a_marked_orphan_and_says_so(planted, tmp_path, how):
    pid, create = _dead_driver() if how == "driver exited" else (os.getpid(), 12345.0)
    orphan = planted(_marker("dead-run", pid, create))
    lines = []
    done = reaper.preflight(report_dir=tmp_path, mode="clear", log=lines.append)
    left, _ = _wait_gone(orphan, timeout=2)
    assert not left
    assert len(lines) == 1 and "cleared 2 process(es)" in lines[0] and "dead-run" in lines[0]
    assert all(f"pid {x}" in lines[0] for x in orphan)
    assert done["cleared"]["runs"] == ["dead-run"]
    assert json.loads((tmp_path / "preflight.json").read_text())["cleared"]["runs"] == ["dead-run"]


def test_preflight_fail_names_the_orphan_in_one_line_and_touches_nothing(planted, monkeypatch):
    pid, create = _dead_driver()
    orphan = planted(_marker("dead-run", pid, create))
    monkeypatch.setenv("E2E_PREFLIGHT", "fail")
    with pytest.raises(PreflightError) as exc:
        reaper.preflight()
    msg = str(exc.value)
    assert "\n" not in msg and f"pid {orphan[0]}" in msg and "dead-run" in msg, msg
    assert "E2E_PREFLIGHT=fail" in msg
    assert _alive(orphan) == orphan


def test_preflight_leaves_unmarked_and_live_runs_alone(planted):
    """Negative controls: an unmarked process, one of a run whose driver lives, one with half
    a marker, and one of this very run survive a preflight that does clear an orphan."""
    me = psutil.Process()
    keep = (planted(None) + planted(_marker("live-run", me.pid, reaper.started(me)))
            + planted({reaper.RUN_ID_ENV: "half"}) + planted(reaper.marker_env()))
    orphan = planted(_marker("dead-run", *_dead_driver()))
    lines = []
    reaper.preflight(mode="clear", log=lines.append)
    assert not _wait_gone(orphan, timeout=2)[0]
    assert _alive(keep) == keep
    assert not any(f"pid {x} " in lines[0] for x in keep)


def test_preflight_finds_registered_sessions_whose_environment_it_cannot_read(
        planted, tmp_path, monkeypatch):
    """A process that rewrote its title (VLLM::EngineCore, smg::router) shows no environment:
    the dead run's RUNS_DIR file names its session. A registered pid whose create time does
    not match (reused) is left alone."""
    monkeypatch.setattr(reaper, "RUNS_DIR", tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    unmarked = planted(None)             # stands in for a process whose environ is unreadable
    reused = planted(None)
    pid, create = _dead_driver()
    leader = reaper.started(unmarked[0])
    (tmp_path / "runs" / "dead-run.procs").write_text(
        f"driver {pid} {create!r}\nadd {unmarked[0]} {leader!r}\nadd {reused[0]} 12345.0\n")
    with pytest.raises(PreflightError) as exc:
        reaper.preflight(mode="fail")
    assert all(f"pid {x}" in str(exc.value) for x in unmarked), str(exc.value)
    lines = []
    reaper.preflight(mode="clear", log=lines.append)
    assert not _wait_gone(unmarked, timeout=2)[0]
    assert _alive(reused) == reused
    assert "cleared 2 process(es)" in lines[0]
    assert not (tmp_path / "runs" / "dead-run.procs").exists()     # forgotten once cleared


def test_preflight_takes_the_members_of_a_registered_session_whose_leader_died(
        tmp_path, monkeypatch, sweeps_held):
    monkeypatch.setattr(reaper, "RUNS_DIR", tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in (reaper.RUN_ID_ENV, reaper.DRIVER_PID_ENV, reaper.DRIVER_CREATE_ENV)}
    leader = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nif os.fork() == 0:\n    time.sleep(120)\n"
         "    os._exit(0)\nsys.stdin.read()"],
        env=env, stdin=subprocess.PIPE, start_new_session=True)
    member = None
    try:
        create = reaper.started(leader.pid)
        deadline = time.monotonic() + 10
        while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        member = psutil.Process(leader.pid).children()[0].pid
        leader.stdin.close()
        leader.wait()                         # the leader is gone; its session lives on
        pid, dcreate = _dead_driver()
        (tmp_path / "runs" / "dead-run.procs").write_text(
            f"driver {pid} {dcreate!r}\nadd {leader.pid} {create!r}\n")
        lines = []
        reaper.preflight(mode="clear", log=lines.append)
        assert not _wait_gone([member], timeout=2)[0]
        assert f"pid {member}" in lines[0]
    finally:
        _cleanup([x for x in (leader.pid, member) if x])


def test_a_driver_lists_its_sessions_in_runs_dir_and_removes_the_file_at_a_clean_exit(driver):
    d, info, _ = driver("fork")
    f = reaper.RUNS_DIR / f"{info['run']}.procs"
    text = f.read_text()
    assert text.startswith("driver ") and any(f"add {x} " in text for x in info["pids"])
    assert os.path.isdir(info["tmp"])
    d.stdin.write("stop\n")
    d.stdin.flush()
    assert json.loads(d.stdout.readline()) == {"stopped": True}
    assert not os.path.exists(info["tmp"])       # the process's stop removed its own
    assert (reaper.RUNS_DIR / f"{info['run']}.tmp").is_dir()
    d.stdin.write("exit\n")
    d.stdin.flush()
    assert d.wait(timeout=10) == 0
    assert not f.exists() and not (reaper.RUNS_DIR / f"{info['run']}.tmp").exists()


def test_a_dead_runs_temp_folders_go_with_its_file_and_a_live_runs_stay(tmp_path, monkeypatch):
    """A run whose driver and guardian both died leaves its processes' temp folders
    (tmp_root); the next preflight's forget_dead_runs removes them with the run's file. A
    run whose driver lives keeps both."""
    monkeypatch.setattr(reaper, "RUNS_DIR", tmp_path / "runs")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    create = reaper.started(gone.pid)
    gone.wait()
    runs = {"dead-1": f"driver {gone.pid} {create!r}",
            "live-1": f"driver {os.getpid()} {reaper.started(os.getpid())!r}"}
    for rid, head in runs.items():
        (tmp_path / "runs" / f"{rid}.tmp" / "tmpabc").mkdir(parents=True)
        (tmp_path / "runs" / f"{rid}.procs").write_text(head + "\n")
    reaper.forget_dead_runs()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["live-1.procs",
                                                                     "live-1.tmp"]


def test_preflight_without_orphans_is_silent(sweeps_held):
    lines = []
    assert reaper.preflight(mode="clear", log=lines.append) == {} and lines == []


def test_a_preflight_held_off_too_long_fails_in_one_line(monkeypatch):
    """Another process's preflight holds the lock past its timeout: a one-line error naming
    the lock, not a wait without end; once the lock is free, the preflight runs."""
    import threading
    monkeypatch.setattr(reaper.PREFLIGHT_LOCK, "timeout", 0.3)
    held, done = threading.Event(), threading.Event()

    def other():                     # another thread: its own file descriptor, as a process
        with reaper.PREFLIGHT_LOCK.acquire(timeout=60):   # other xdist workers' tests may hold it
            held.set()
            done.wait(10)
    t = threading.Thread(target=other)
    t.start()
    try:
        assert held.wait(10)
        with pytest.raises(PreflightError) as exc:
            reaper.preflight(mode="off")
        msg = str(exc.value)
        assert "\n" not in msg and str(reaper.PREFLIGHT_LOCK.lock_file) in msg, msg
    finally:
        done.set()
        t.join()
    monkeypatch.undo()
    assert reaper.preflight(mode="off") == {}


@pytest.mark.parametrize("value,mode", [("", "clear"), ("clear", "clear"), ("fail", "fail"),
                                        ("off", "off")])
def test_preflight_mode(monkeypatch, value, mode):
    monkeypatch.setenv("E2E_PREFLIGHT", value)
    assert reaper.preflight_mode() == mode


def test_preflight_mode_bad_value(monkeypatch):
    monkeypatch.setenv("E2E_PREFLIGHT", "sometimes")
    with pytest.raises(ConfigError, match=r"^E2E_PREFLIGHT=.sometimes.: unknown value; accepts clear \| fail \| off"):
        reaper.preflight_mode()


def test_preflight_off_touches_nothing(planted):
    orphan = planted(_marker("dead-run", *_dead_driver()))
    assert reaper.preflight(mode="off") == {}
    assert _alive(orphan) == orphan


# -- GPU holders and the teardown settle wait (pure logic: NVML mocked) -----------------------

class FakeNVML:
    """Stands in for pynvml in the pure-logic tests below: per-device process lists and a
    sequence of used-memory readings (MiB)."""

    def __init__(self, procs=None, used=None):
        self.procs = procs or {}            # device -> [(pid, MiB or None)]
        self.used = used or {}              # device -> list of MiB readings (last one repeats)
        self.calls = 0

    def nvmlInit(self):
        self.calls += 1

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=None if mib is None else mib * 2**20)
                for pid, mib in self.procs.get(h, [])]

    def nvmlDeviceGetMemoryInfo(self, h):
        seq = self.used[h]
        v = seq.pop(0) if len(seq) > 1 else seq[0]
        return SimpleNamespace(used=v * 2**20)


@pytest.fixture
def nvml(monkeypatch):
    def install(**kw):
        fake = FakeNVML(**kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake
    return install


def test_gpu_check_fails_in_one_line_naming_foreign_pids_and_mib(nvml, planted):
    stranger = planted(None)[0]
    nvml(procs={0: [(stranger, 550.0)], 1: [(os.getpid(), 300.0)]})
    with pytest.raises(PreflightError) as exc:
        reaper.preflight(devices=[0, 1], mode="clear")
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"pid {stranger}" in msg and "550 MiB on GPU 0 (not the harness's)" in msg, msg
    assert f"pid {os.getpid()}" not in msg          # the driver's own memory is ours


def test_gpu_check_passes_when_only_this_run_holds_memory(nvml, planted):
    ours = planted(reaper.marker_env())[0]
    nvml(procs={0: [(ours, 500.0)], 1: []})
    assert reaper.preflight(devices=[0, 1], mode="clear") == {}


def test_gpu_check_names_a_pid_it_cannot_see_and_unknown_memory(nvml, monkeypatch):
    monkeypatch.setattr(reaper, "GPU_SETTLE_S", 0.3)
    nvml(procs={0: [(4_000_000, None)]})
    with pytest.raises(PreflightError, match=r"pid 4000000 \? MiB on GPU 0 \(not visible"):
        reaper.preflight(devices=[0], mode="clear")


def test_gpu_check_waits_for_a_dying_holder_to_go(nvml, monkeypatch, sweeps_held):
    """A process that just exited (not visible any more) is still listed by NVML for a moment:
    the check waits for it, up to GPU_SETTLE_S."""
    monkeypatch.setattr(reaper, "GPU_SETTLE_S", 5.0)
    fake = nvml(procs={0: [(4_000_000, 550.0)]})
    listed = fake.nvmlDeviceGetComputeRunningProcesses
    calls = []

    def dying(h):
        calls.append(h)
        return listed(h) if len(calls) < 3 else []
    fake.nvmlDeviceGetComputeRunningProcesses = dying
    assert reaper.preflight(devices=[0], mode="clear") == {}
    assert len(calls) == 3


def test_gpu_check_is_skipped_on_cpu_and_an_error_without_nvml(nvml, monkeypatch):
    """No device asked (CPU): no check. Devices asked but NVML cannot list their processes:
    an error naming the way out, where it passed with nothing checked."""
    fake = nvml(procs={0: [(1, 999.0)]})
    reaper.preflight(devices=(), mode="clear")
    assert fake.calls == 0
    monkeypatch.setitem(sys.modules, "pynvml", None)      # import fails: no NVML here
    with pytest.raises(PreflightError, match=r"NVML could not list the processes on GPU\(s\) "
                                             r"\[0\].*E2E_PREFLIGHT=off"):
        reaper.preflight(devices=[0], mode="clear")


def test_settle_wait_is_measured(nvml):
    nvml(used={0: [1550.0, 1550.0, 1550.0, 1000.0]})
    rep = teardown.TeardownReport()
    teardown.check_gpu(rep, {0: 1000.0}, timeout=5, poll=0.05)
    assert rep.ok and rep.gpu_checked and rep.gpu_leaks == {}
    assert 0.1 <= rep.gpu_settle_s < 2, rep.gpu_settle_s
    assert rep.to_dict()["gpu_settle_s"] == rep.gpu_settle_s


def test_leak_verdict_names_the_process_still_holding_memory(nvml, planted):
    ours = planted(reaper.marker_env())[0]
    nvml(used={0: [1550.1]}, procs={0: [(ours, 550.0)]})
    rep = teardown.TeardownReport()
    teardown.check_gpu(rep, {0: 1000.0}, timeout=0.2, poll=0.05)
    assert not rep.ok and rep.gpu_settle_s is None and rep.gpu_leaks == {0: 550.1}
    v = rep.verdict()
    assert v.startswith("NOT clean: GPU memory above baseline (MiB): {0: 550.1} after 0 s, "
                        f"GPU 0 held by pid {ours} "), v
    assert "550 MiB on GPU 0 (this run)" in v


def test_leak_verdict_when_nvml_lists_no_process(nvml):
    nvml(used={0: [1550.1]}, procs={0: []})
    rep = teardown.TeardownReport()
    teardown.check_gpu(rep, {0: 1000.0}, timeout=0.2, poll=0.05)
    assert not rep.ok
    assert rep.verdict().endswith("no process holds memory on GPU 0 per NVML (released late)")


def test_a_process_start_is_read_in_ticks_since_boot_which_no_clock_step_moves():
    """reaper.started: /proc/PID/stat's start in clock ticks since boot, not psutil's create
    time (btime from the wall clock + start), which a step of the clock moves: a live driver
    must not read as a reused pid. The negative control: a start off by more than a tick is
    another process; a gone pid raises."""
    import os

    import psutil

    from e2e_test.infra.lifecycle import reaper
    me = reaper.started(os.getpid())
    assert me == reaper.started(psutil.Process(os.getpid()))
    assert 0 < me <= time.clock_gettime(time.CLOCK_BOOTTIME)
    # psutil's create time less its boot time is the same start (within a tick of rounding)
    p = psutil.Process(os.getpid())
    assert abs((p.create_time() - psutil.boot_time()) - me) < 0.02
    assert reaper.pid_alive(os.getpid(), me)
    assert not reaper.pid_alive(os.getpid(), me + 1.0)            # the negative control
    assert not reaper.pid_alive(os.getpid(), p.create_time())     # epoch seconds: not a start
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        reaper.started(child.pid)


def test_a_process_named_with_spaces_and_parentheses_reads_its_own_start(tmp_path):
    from e2e_test.infra.lifecycle import reaper
    exe = tmp_path / "a (b) c"
    exe.symlink_to(sys.executable)
    p = subprocess.Popen([str(exe), "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        import psutil
        ps = psutil.Process(p.pid)
        assert abs((ps.create_time() - psutil.boot_time()) - reaper.started(p.pid)) < 0.02
    finally:
        p.kill()
        p.wait()


def test_a_run_whose_guardian_still_runs_is_left_to_it(planted):
    """A driver SIGKILLed while another run's preflight looks: the processes are its guardian's
    to stop (and report), not the preflight's; once the guardian has exited they are orphans.
    (The race behind test_sigkill_of_the_driver_stops_its_whole_tree finding no report when
    another xdist worker's preflight swept the tree first.)"""
    pid, create = _dead_driver()
    run = f"guarded-{os.getpid()}"
    pids = planted(_marker(run, pid, create))
    guardian = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 reaper.GUARDIAN_MODULE, "--run-id", run])
    try:
        deadline = time.monotonic() + 10
        while run not in reaper.guarded_runs() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run in reaper.guarded_runs()
        assert not {p.pid for p, _ in reaper.orphans()} & set(pids)
    finally:
        guardian.kill()
        guardian.wait()
    # the control: the same processes, their guardian gone, are orphans
    assert {p.pid for p, _ in reaper.orphans()} >= set(pids)
