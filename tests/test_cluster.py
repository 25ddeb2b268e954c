"""Cluster with real small processes: a FAKE engine (tests/fake_engine.py, a stdlib HTTP
server) registered at run time, behind the real smg gateway. Covers what the CPU lane
otherwise covers only in 15 minutes: the whole life of a Cluster of an engine it does not
know by name, staged starts, a worker that exits while starting, a port collision and its
restart, the stop report (SIGKILL escalation), and the second Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from e2e_test.infra import engines
from e2e_test.infra.cluster import cluster as cluster_mod
from e2e_test.infra.cluster import reach
from e2e_test.infra.cluster.cluster import Cluster
from e2e_test.infra.errors import ConfigError, HarnessError, StartupError

sys.path.insert(0, str(Path(__file__).parent))
import fake_engine

CLUSTER_SRC = Path(cluster_mod.__file__).read_text()


@pytest.fixture
def weights(tmp_path, monkeypatch):
    monkeypatch.delenv("E2E_MODEL_PATH", raising=False)
    d = tmp_path / "weights"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def fake():
    """The fake engine, registered for one test (set .env / .stages before making a Cluster)."""
    yield fake_engine.register()
    engines.unregister(fake_engine.NAME)


def make(weights, tmp_path, topology="1", **kw) -> Cluster:
    devices = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
    return Cluster(model=fake_engine.fake_spec(weights), engine=fake_engine.NAME,
                   topology=topology, backend="cpu", devices=devices,
                   results_dir=tmp_path / "cluster", **kw)


def _gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


def _engine_words(text: str) -> list[str]:
    names = {e.name for e in engines.all_engines()} | set(engines.engine_names())
    counters = {c for e in engines.all_engines() for c in e.work_counters}
    return [n for n in sorted(names | counters | {"sglang"})
            if re.search(rf"\b{re.escape(n)}\b", text, re.IGNORECASE)]


def test_cluster_names_no_engine_and_no_metric():
    assert _engine_words(CLUSTER_SRC) == []
    # Negative control: the check does see a name and a counter.
    assert _engine_words('if engine == "tokenspeed": total("vllm:prompt_tokens_total")') == [
        "tokenspeed", "vllm", "vllm:prompt_tokens_total"]


def test_a_registered_fake_engine_runs_a_whole_cluster(fake, weights, tmp_path):
    assert fake_engine.NAME in engines.engine_names()
    c = make(weights, tmp_path)
    with c:
        assert c.driver is fake
        reply = c.chat("Say hi")
        assert reply["choices"][0]["message"]["content"] == "OK fake"
        assert c.engine_work() >= 3          # the engine's own work counter, via /metrics
        assert c.dead_processes() is None
        pids = [c.gateway.pid, c.workers[0].process.pid]
    rep = c.teardown_report
    assert rep.ok and rep.escalated == [], rep.verdict()
    assert sorted(r.name for r in c.stop_reports) == ["gateway", "worker-0"]
    assert _gone(pids)
    facts = json.loads((tmp_path / "cluster" / "cluster.json").read_text())
    assert facts["engine"] == "fake" and facts["teardown"]["ok"]
    # the real gateway served its first probe: no failed probe recorded (readiness.ModelServed)
    assert facts["timing"]["gateway_probe_failures"] == []
    assert (tmp_path / "cluster" / "logs" / "worker-0.log").is_file()


def test_a_model_path_replaces_the_registrys_folder_checked_before_anything_starts(
        fake, weights, tmp_path):
    """Cluster(model_path=...): the engine is built over that folder (a perturbed copy of the
    weights, test_perturbed.py) under the model's own name; one without a config.json is a
    one-line error before any process starts."""
    other = tmp_path / "perturbed"
    other.mkdir()
    (other / "config.json").write_text("{}")
    built = []
    real = fake.build
    fake.build = lambda spec, topo, entry, ports, model_path, options: (
        built.append(model_path) or real(spec, topo, entry, ports, model_path, options))
    c = make(weights, tmp_path, model_path=other)
    assert c.model_path == other and built == [str(other)] and c.model_name == c.spec.id
    assert make(weights, tmp_path / "b").model_path == weights
    with pytest.raises(HarnessError, match=r"no config.json in model_path=.*missing$"):
        make(weights, tmp_path / "c", model_path=tmp_path / "missing")


def test_unregistered_engine_is_a_one_line_error(weights, tmp_path):
    with pytest.raises(ConfigError, match="cannot run on engine 'nope'"):
        Cluster(model="SmolLM2-135M-Instruct", engine="nope", topology="1", backend="cpu")


def test_staged_start_waits_for_the_earlier_stage(fake, weights, tmp_path):
    fake.env = {"worker-0": {"FAKE_ENGINE_DELAY_S": "1.5"}}
    fake.stages = {"worker-1": 1}
    c = make(weights, tmp_path, topology="dp2")
    with c:
        w0, w1 = c.workers
        assert (w0.command.start_stage, w1.command.start_stage) == (0, 1)
        assert w0.ready_s >= 1.5
        # worker-1 was launched only once worker-0 was ready.
        assert w1.process.started_at >= w0.process.started_at + w0.ready_s - 0.05
        assert c.chat("x")["choices"]
    assert c.teardown_report.ok


def test_a_gateway_pinned_to_one_worker_reaches_it_alone(fake, weights, tmp_path):
    """Cluster.pinned: a second smg in front of worker-0 alone. Through it only worker-0's
    work counter moves; the same requests through the topology's gateway move both (the
    measurement sees a leak); the pinned gateway is stopped at the end of its block, its
    stop report and ports in the topology's teardown. A worker the topology lacks is a
    ConfigError before anything starts."""
    c = make(weights, tmp_path, topology="dp2")
    with c:
        w0, w1 = c.workers
        with c.pinned(w0.name) as g:
            assert g.name == "gateway-worker-0" and g.process.alive()
            assert g.argv[g.argv.index("--worker-urls") + 1:][:2] == [w0.url, "--policy"]
            pinned = reach.work_moved(c, g.url, 4, expect=[w0.name])
        assert not g.process.alive()
        [(name, ready_s)] = c.timing.extra_gateways
        assert name == "gateway-worker-0" and 0 < ready_s < 30
        print(f"pinned gateway ready in {ready_s} s")
        unpinned = reach.work_moved(c, c.gateway_url, 4, expect=[w0.name, w1.name])
        assert pinned == {"worker-0": 12.0, "worker-1": 0.0}, pinned      # 3 per request
        assert unpinned == {"worker-0": 6.0, "worker-1": 6.0}, unpinned   # round robin
        assert reach.pin_problems(w0.name, pinned, unpinned) == []
        with pytest.raises(ConfigError, match="no worker 'worker-7'"), c.pinned("worker-7"):
            pass
        port = int(g.url.rsplit(":", 1)[1])
        assert port in c.allocated_ports
    rep = c.teardown_report
    assert rep.ok, rep.verdict()
    assert sorted(r.name for r in c.stop_reports) == [
        "gateway", "gateway-worker-0", "worker-0", "worker-1"]


def test_a_worker_exiting_while_starting_fails_at_once(fake, weights, tmp_path):
    fake.env = {"worker-0": {"FAKE_ENGINE_EXIT": "3"}}
    c = make(weights, tmp_path)
    t0 = time.monotonic()
    with pytest.raises(StartupError) as ei, c:
        pass
    assert time.monotonic() - t0 < 10        # not the 30 s startup timeout
    head = ei.value.summary
    assert "worker-0 exited while starting (exit code 3)" in head
    assert "[error] RuntimeError: fake engine told to fail at start" in head
    assert "argv:" in str(ei.value) and "log tail:" in str(ei.value)
    assert c.gateway is None                 # the gateway never started
    assert c.teardown_report.ok


def test_a_failed_boot_names_a_busy_process_outside_the_session(fake, weights, tmp_path,
                                                                 monkeypatch):
    """The boot's two process samples (hostload.snapshot, faked: a busy process outside the
    session took 90 % of a CPU) give the error's first detail line; the negative control,
    the same process idle, gives none."""
    from e2e_test.infra.cluster import hostload
    me, other = os.getpid(), 2 ** 31 - 5

    def samples(cpu_s):
        procs = {me: hostload.Proc(me, 1, 1.0, 0.0, "pytest", python=True)}
        yield hostload.Sample(100.0, procs, 0.0, 200.0, 2)
        while True:
            yield hostload.Sample(150.0, {**procs, other: hostload.Proc(other, 1, 2.0, cpu_s,
                                                                          "busy")},
                                  90.0, 300.0, 2)

    fake.env = {"worker-0": {"FAKE_ENGINE_EXIT": "3"}}
    for cpu_s, line in ((45.0, f"host load: outside this session, over the boot's 50 s "
                                f"(2 CPUs, 90 % busy): pid {other} busy 90 % of a CPU"),
                        (1.0, None)):
        monkeypatch.setattr(hostload, "snapshot", samples(cpu_s).__next__)
        c = make(weights, tmp_path / str(cpu_s))
        with pytest.raises(StartupError) as ei, c:
            pass
        assert "worker-0 exited while starting (exit code 3)" in ei.value.summary
        assert (ei.value.details.splitlines()[0] == line) if line else \
            "host load" not in str(ei.value)


def test_a_worker_not_ready_in_time_leaves_its_stacks(fake, weights, tmp_path):
    """Past the boot limit the error names where each pending worker's stack dumps are (a
    TokenSpeed worker stuck in its first graph capture says nothing of where in its log).
    One file per process of the pending worker, none for the others."""
    fake.env = {"worker-0": {"FAKE_ENGINE_DELAY_S": "60"}}
    c = Cluster(model=fake_engine.fake_spec(weights, startup_timeout_s=2.0),
                engine=fake_engine.NAME, topology="1", backend="cpu",
                devices=str(sorted(os.sched_getaffinity(0))[0]),
                results_dir=tmp_path / "cluster")
    with pytest.raises(StartupError) as ei, c:
        pass
    text = str(ei.value)
    assert "worker-0 not ready within 2 s" in text
    where = tmp_path / "cluster" / "boot-stall"
    assert f"stack dumps (1) in {where}" in text, text
    dumps = list(where.glob("stack-worker-0-*.txt"))
    assert len(dumps) == 1 and dumps[0].read_text()
    assert c.teardown_report.ok


def test_a_port_collision_restarts_on_new_ports(fake, weights, tmp_path):
    fake.env = {"worker-0": {"FAKE_ENGINE_BUSY_ONCE": str(tmp_path / "collided")}}
    c = make(weights, tmp_path)
    first_port = c.workers[0].ports.api
    with c:
        w = c.workers[0]
        assert w.restarts == 1 and w.ports.api != first_port
        assert c.chat("x")["choices"]
    logs = tmp_path / "cluster" / "logs"
    assert "Address already in use" in (logs / "worker-0.log").read_text()
    assert (logs / "worker-0.1.log").is_file()
    assert c.teardown_report.ok, c.teardown_report.verdict()


@pytest.fixture
def fake_module():
    """The fake engine run as `python -m fake_engine_server`, which a Cluster can hold."""
    yield fake_engine.register(module=True)
    engines.unregister(fake_engine.NAME)


def _wait_held(w, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cluster_mod.HELD_LINE.search(w.held.log_text()):
        assert time.monotonic() < deadline, w.held.log_tail()
        time.sleep(0.05)


def test_a_held_restart_has_its_imports_done_ahead(fake_module, weights, tmp_path):
    """Cluster.hold_restarts: each worker's restart starts with the boot, runs its module's
    imports (1.5 s here, FAKE_ENGINE_IMPORT_S) and waits; restart() releases it, so the
    restart's boot no longer holds the imports, and they count as boot seconds of their own
    (Timing.held_imports). Negative control: without it the same restart pays them."""
    fake_module.env = {"worker-0": {"FAKE_ENGINE_IMPORT_S": "1.5"}}
    took = {}
    for hold in (True, False):
        c = make(weights, tmp_path / str(hold), hold_restarts=hold)
        with c:
            w = c.workers[0]
            if hold:
                held = w.held
                assert held is not None and held.alive() and held.pid != w.process.pid
                assert "--hold" in held.argv and held.log_path.name == "worker-0.1.log"
                _wait_held(w)
            else:
                assert w.held is None
            old = w.process.pid
            os.kill(old, signal.SIGKILL)                   # the leg lost
            assert _gone([old])
            c.restart("worker-0")
            took[hold] = c.timing.restart_boots[-1][1]
            assert c.chat("x")["choices"]
            if hold:
                assert w.process is held and w.held is None and w.restarts == 1
                assert c.timing.held == {"worker-0": "released"}
                [(start, s)] = c.timing.held_imports
                assert start == pytest.approx(c.timing.boot_started, abs=1.0)
                assert 1.5 <= s < 10
                assert "e2e_warm_spawn (pid" in held.log_text() and ": go," in held.log_text()
            else:
                assert c.timing.held == {} and c.timing.held_imports == []
        assert c.teardown_report.ok, c.teardown_report.verdict()
    assert took[True] < 1.0 and took[False] >= 1.5, took


def test_a_held_process_unused_is_stopped_and_a_dead_one_replaced(fake_module, weights,
                                                                   tmp_path):
    """A held process no restart took is stopped with its topology (its imports still
    counted); one that died before its restart is replaced by a fresh launch, said so."""
    c = make(weights, tmp_path / "unused", hold_restarts=True)
    with c:
        pid = c.workers[0].held.pid
        _wait_held(c.workers[0])
    assert c.timing.held == {"worker-0": "stopped unused"} and len(c.timing.held_imports) == 1
    assert c.teardown_report.ok, c.teardown_report.verdict()
    assert _gone([pid])
    c = make(weights, tmp_path / "dead", hold_restarts=True)
    with c:
        w = c.workers[0]
        dead = w.held
        os.kill(dead.pid, signal.SIGKILL)
        assert _gone([dead.pid])
        c.restart("worker-0")
        assert w.process is not dead and w.process.alive() and w.held is None
        assert c.timing.held["worker-0"].startswith("gone (signal 9) at the restart")
        assert c.chat("x")["choices"]
    assert c.teardown_report.ok, c.teardown_report.verdict()


def test_the_main_thread_records_what_it_waited_on_a_boot(fake, weights, tmp_path):
    """Timing.boot_waits (the time report's boot_waited_s): a boot the main thread runs is
    waited on in full, and so is a restart it runs. Negative control: a start run in a
    thread records nothing."""
    fake.env = {"worker-0": {"FAKE_ENGINE_DELAY_S": "1.0"}}
    threaded = make(weights, tmp_path / "t")
    with ThreadPoolExecutor(1) as ex:
        ex.submit(threaded.start).result()
    try:
        assert threaded.timing.boot_waits == []
    finally:
        threaded.stop()
    c = make(weights, tmp_path / "m")
    with c:
        assert len(c.timing.boot_waits) == 1
        epoch, s = c.timing.boot_waits[0]
        assert epoch == pytest.approx(c.timing.boot_started, abs=0.5)
        assert 1.0 <= s <= c.timing.total_ready_s + 0.1
        assert c.restart("worker-0").restarts == 1
        assert len(c.timing.boot_waits) == 2
        assert c.timing.boot_waits[1][1] >= 1.0


def test_stop_report_names_a_worker_that_needed_sigkill(fake, weights, tmp_path, monkeypatch):
    fake.env = {"worker-0": {"FAKE_ENGINE_IGNORE_TERM": "1"}}
    monkeypatch.setattr(cluster_mod, "STOP_GRACE_S", 1.0)
    c = make(weights, tmp_path)
    with c:
        pid = c.workers[0].process.pid
    rep = c.teardown_report
    assert "worker-0" in rep.escalated      # (smg itself lingers 5 s: past a 1 s grace too)
    by_name = {r.name: r for r in c.stop_reports}
    assert by_name["worker-0"].escalated and by_name["worker-0"].exit_code == -signal.SIGKILL
    assert rep.ok and "needed SIGKILL" in rep.verdict()
    assert _gone([pid])


def test_an_engine_stop_grace_escalates_sooner(fake, weights, tmp_path):
    """A worker whose engine sets its own stop grace gets SIGKILL after it, not after the
    cluster's 15 s (TokenSpeed: 1.5 s)."""
    fake.env = {"worker-0": {"FAKE_ENGINE_IGNORE_TERM": "1"}}
    fake.stop_grace_s = 0.5
    c = make(weights, tmp_path)
    with c:
        pass
    w = {r.name: r for r in c.stop_reports}["worker-0"]
    assert w.escalated and w.seconds < 3.0, w      # 0.5 s grace, then SIGKILL
    assert c.teardown_report.ok


def test_a_known_upstream_crash_is_named_and_raised_as_such(fake, weights, tmp_path):
    """A worker that dies of a crash its engine knows (Engine.known_crashes) is named with
    the bug and its reference, and the topology raises UpstreamBug; any other death stays a
    plain WorkerDied (the negative control)."""
    from e2e_test.infra.engines import KnownCrash
    from e2e_test.infra.errors import UpstreamBug, WorkerDied
    fake.known_crashes = (KnownCrash(r"object has no attribute 'request_id'",
                                     "the fake's loop takes a load query for a request",
                                     ("fake_engine_server.py:1",), role="worker"),)
    for crash, want in ((True, UpstreamBug), (False, WorkerDied)):
        c = make(weights, tmp_path / str(crash))
        with c:
            w = c.workers[0]
            if crash:
                with open(w.process.log_path, "a") as f:
                    f.write("AttributeError: 'GetLoadReqInput' object has no attribute "
                            "'request_id'\n")
            w.process.kill()
            assert _gone([w.process.pid])
            with pytest.raises(WorkerDied) as ei:
                c.check_alive()
            assert type(ei.value) is want
            msg = str(ei.value)
            assert "worker-0" in msg and "died" in msg
            assert ("known upstream bug: the fake's loop" in msg) is crash, msg


SECOND_CTRL_C = """
import sys, time
sys.path.insert(0, {tests!r})
import fake_engine
from pathlib import Path
from e2e_test.infra.cluster import signals as lifecycle
from e2e_test.infra.cluster.cluster import Cluster
lifecycle.install()
fake_engine.register(env={{"worker-0": {{"FAKE_ENGINE_IGNORE_TERM": "1"}}}})
c = Cluster(model=fake_engine.fake_spec(Path({weights!r})), engine="fake", topology="1",
            backend="cpu", devices={devices!r}, results_dir={out!r})
c.start()
print("READY", c.gateway.pid, c.workers[0].process.pid, flush=True)
time.sleep(120)
"""


def test_second_ctrl_c_kills_every_tree_at_once(weights, tmp_path):
    devices = str(min(os.sched_getaffinity(0)))
    script = SECOND_CTRL_C.format(tests=str(Path(__file__).parent), weights=str(weights),
                                  devices=devices, out=str(tmp_path / "cluster"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the script exited before READY"
        pids = [int(x) for x in line.split()[1:]]
        proc.send_signal(signal.SIGINT)      # first: a graceful teardown (15 s grace) starts
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)      # second: SIGKILL everything now
        rc = proc.wait(timeout=10)
        assert time.monotonic() - t0 < 10    # well inside the 15 s grace
        out = proc.stdout.read()
        assert rc == 130, out
        assert "second SIGINT: killing every worker now" in out
        assert _gone(pids), f"left alive: {[p for p in pids if psutil.pid_exists(p)]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_work_keeps_a_late_workers_last_answer():
    """The watchdog's progress signal: a worker whose /metrics did not answer in time counts
    with its last answer, so the sum neither drops (its work hidden) nor rises spuriously
    when it answers again; a restarted worker's fresh counter is taken as it is."""
    from types import SimpleNamespace
    c = Cluster.__new__(Cluster)
    c.workers = [SimpleNamespace(name="prefill-0"), SimpleNamespace(name="decode-0")]
    c._work_seen = {}
    answers = {}
    c.worker_work = lambda w, timeout=None: answers[w.name]
    answers.update({"prefill-0": None, "decode-0": None})
    assert c.engine_work() is None                 # nobody answered yet: no value, not 0
    answers.update({"prefill-0": 1600.0, "decode-0": 50.0})
    assert c.engine_work() == 1650.0
    answers.update({"prefill-0": None, "decode-0": 60.0})   # the prefill is late
    assert c.engine_work() == 1660.0               # the old sum of answers said 60: a drop
    answers.update({"prefill-0": 3200.0, "decode-0": 60.0})
    assert c.engine_work() == 3260.0               # its prompt finished meanwhile: a rise
    answers.update({"prefill-0": 0.0, "decode-0": 60.0})    # restarted: counters from 0
    assert c.engine_work() == 60.0


def test_liveness_asks_every_handle_at_once():
    """Cluster._dead asks its handles in parallel: a remote handle's status call may take its
    whole timeout on a busy host, and asked in turn the waits add up. Each stand-in handle's
    alive() waits at a barrier that only opens when all of them are asking at once."""
    import threading
    from types import SimpleNamespace
    barrier = threading.Barrier(3, timeout=5.0)

    def handle(pid, up):
        def alive():
            barrier.wait()          # BrokenBarrierError when asked one after the other
            return up
        return SimpleNamespace(pid=pid, where="", started_at=1.0, alive=alive,
                               death_reason=lambda: "signal 9", log_text=lambda n: "")

    c = Cluster.__new__(Cluster)
    c.gateway = handle(1, True)
    c._extra_gateways = []
    c.workers = [SimpleNamespace(name="prefill-0", entry=SimpleNamespace(role="prefill"),
                                 process=handle(2, True)),
                 SimpleNamespace(name="decode-0", entry=SimpleNamespace(role="decode"),
                                 process=handle(3, False))]
    c.restarts_in_flight = lambda: []
    c.driver = SimpleNamespace(known_crash=lambda role, text: None)
    assert c._dead() == [("decode-0 (pid 3) died: signal 9", None)]
