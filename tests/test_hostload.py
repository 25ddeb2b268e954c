"""hostload: a failed boot's line naming the busy processes outside the session, from two
process samples. Fake samples (a busy loop beside the lane, the session's own workers, another
run of the harness, a reused pid, an escaped marked process), each with its negative control,
and the session's membership on this host's real process table."""

import os
import subprocess
import sys

import pytest

from e2e_test.infra.cluster import hostload
from e2e_test.infra.cluster.hostload import Proc, Sample
from e2e_test.infra.errors import ConfigError, StartupError

ME = 100


def table(*procs: Proc) -> dict[int, Proc]:
    return {p.pid: p for p in procs}


def lane(**cpu) -> dict[int, Proc]:
    """bash test.sh (10) -> python -m e2e_test run (11) -> pytest (ME) -> a worker (200) and
    its engine core (201, a set title); beside the run, under the same bash, a busy loop (12);
    another run of the harness (300, 301) under a shell of its own (30); init (1)."""
    c = {"hog": 0.0, "worker": 0.0, "core": 0.0, "other": 0.0, **cpu}
    return table(Proc(1, 0, 0.0, 5.0, "systemd"),
                 Proc(10, 1, 10.0, 0.1, "bash"),
                 Proc(11, 10, 11.0, 1.0, "python3", python=True),
                 Proc(ME, 11, 12.0, 3.0, "python3", python=True),
                 Proc(12, 10, 11.0, c["hog"], "python3", python=True),
                 Proc(200, ME, 20.0, c["worker"], "python3", python=True),
                 Proc(201, 200, 21.0, c["core"], "VLLM::EngineCore", python=True),
                 Proc(30, 1, 5.0, 0.2, "bash"),
                 Proc(300, 30, 6.0, 2.0, "python3", python=True),
                 Proc(301, 300, 7.0, c["other"], "python3", python=True))


def sample(at: float, procs: dict[int, Proc], busy: float = 0.0, cpus: int = 2) -> Sample:
    return Sample(at, procs, host_busy_s=busy, host_all_s=at * cpus, cpus=cpus)


def names(busy) -> list[int]:
    return [b.proc.pid for b in busy]


def test_a_busy_loop_beside_the_lane_is_named_and_the_sessions_own_work_is_not():
    before = sample(100.0, lane())
    after = sample(200.0, lane(hog=99.0, worker=80.0, core=90.0), busy=190.0)
    busy = hostload.busy_outside(before, after, ME)
    assert names(busy) == [12]
    assert busy[0].of_a_cpu == pytest.approx(0.99)
    line = hostload.host_line(before, after, busy,
                              cmdline=lambda pid: "python3 -c import time; " + "x" * 80)
    assert line.startswith("host load: outside this session, over the boot's 100 s (2 CPUs, "
                           "95 % busy): pid 12 python3 (python3 -c import time; xxx")
    assert line.endswith("...) 99 % of a CPU"), line
    assert "\n" not in line


def test_a_set_title_is_shown_once_without_its_padding():
    before = sample(100.0, lane())
    procs = lane()
    procs[700] = Proc(700, 1, 30.0, 60.0, "Engine::Worker")
    after = sample(200.0, procs)
    busy = hostload.busy_outside(before, after, ME)
    titles = {700: "Engine::Worker" + " " * 40}
    assert hostload.host_line(before, after, busy, titles.get).endswith(
        "pid 700 Engine::Worker 60 % of a CPU")
    titles = {700: "Engine::Worker   --rank  1   "}
    assert hostload.host_line(before, after, busy, titles.get).endswith(
        "pid 700 Engine::Worker (Engine::Worker --rank 1) 60 % of a CPU")


def test_nothing_busy_outside_the_session_gives_no_line():
    """The negative control: the session's workers take both CPUs, nothing else is busy."""
    before = sample(100.0, lane())
    after = sample(200.0, lane(worker=95.0, core=99.0, hog=3.0), busy=197.0)
    busy = hostload.busy_outside(before, after, ME)
    assert busy == []
    assert hostload.host_line(before, after, busy) is None


def test_the_threshold_is_a_tenth_of_the_host():
    """On 2 CPUs 20 % of a CPU over the boot is named, 19 % is not; on 8 CPUs 80 %."""
    before = sample(100.0, lane())
    assert names(hostload.busy_outside(before, sample(200.0, lane(hog=20.0)), ME)) == [12]
    assert names(hostload.busy_outside(before, sample(200.0, lane(hog=19.0)), ME)) == []
    before8 = sample(100.0, lane(), cpus=8)
    assert names(hostload.busy_outside(before8, sample(200.0, lane(hog=79.0), cpus=8), ME)) == []
    assert names(hostload.busy_outside(before8, sample(200.0, lane(hog=80.0), cpus=8), ME)) \
        == [12]


def test_another_run_of_the_harness_is_the_hosts_load():
    before = sample(100.0, lane())
    after = sample(200.0, lane(other=60.0, hog=30.0))
    busy = hostload.busy_outside(before, after, ME)
    assert names(busy) == [301, 12]              # busiest first
    line = hostload.host_line(before, after, busy)
    assert "pid 301 python3 60 % of a CPU; pid 12 python3 30 % of a CPU" in line


def test_the_session_is_the_outermost_python_ancestors_tree():
    """A shell breaks the chain: the busy loop under test.sh's bash is outside; a pytest-xdist
    sibling of this process (under the same python) is inside."""
    procs = lane()
    assert hostload.session_root(procs, ME) == 11
    procs[400] = Proc(400, 11, 30.0, 0.0, "python3", python=True)     # a sibling worker
    assert hostload.in_session(400, procs, 11, lambda pid: None)
    assert not hostload.in_session(12, procs, 11, lambda pid: None)
    assert not hostload.in_session(301, procs, 11, lambda pid: None)
    assert hostload.session_root(procs, 999) == 999                    # not in the table


def test_a_reused_pid_counts_from_zero():
    """The hog's pid taken by a new process during the boot: its CPU seconds count from 0, not
    from the old process's (which would hide it); the same process counts from its reading."""
    before = sample(100.0, lane(hog=500.0))
    after_same = sample(200.0, lane(hog=530.0))
    assert names(hostload.busy_outside(before, after_same, ME)) == [12]
    reused = lane(hog=40.0)
    reused[12] = Proc(12, 10, 150.0, 40.0, "cc1")
    assert names(hostload.busy_outside(before, sample(200.0, reused), ME)) == [12]
    assert names(hostload.busy_outside(before, sample(200.0, lane(hog=510.0)), ME)) == []


def test_a_process_that_left_the_tree_but_carries_this_runs_marker_is_inside():
    procs = lane()
    procs[500] = Proc(500, 1, 30.0, 70.0, "raylet")            # reparented to init
    before = sample(100.0, lane())
    after = sample(200.0, procs)
    assert names(hostload.busy_outside(before, after, ME, {500: ME}.get)) == []
    assert names(hostload.busy_outside(before, after, ME, {500: 300}.get)) == [500]
    assert names(hostload.busy_outside(before, after, ME)) == [500]


def test_at_most_three_are_named():
    procs = lane()
    for i in range(5):
        procs[600 + i] = Proc(600 + i, 1, 30.0, 50.0 + i, f"job{i}")
    line = hostload.host_line(sample(100.0, lane()), sample(200.0, procs),
                              hostload.busy_outside(sample(100.0, lane()), sample(200.0, procs),
                                                    ME))
    assert "pid 604 job4" in line and "pid 602 job2" in line and "job1" not in line
    assert line.endswith("; 2 more")


def _fake_samples(monkeypatch, after_procs):
    me = os.getpid()
    base = {me: Proc(me, 1, 1.0, 0.0, "pytest", python=True)}
    gone = 2 ** 31 - 5          # above any pid: psutil finds no such process (no marker, no argv)
    samples = iter([sample(100.0, base),
                    sample(150.0, {**base, gone: Proc(gone, 1, 2.0, after_procs, "busy")})])
    monkeypatch.setattr(hostload, "snapshot", lambda: next(samples))
    return gone


def test_a_failed_boot_gets_the_line_first_in_its_details(monkeypatch):
    gone = _fake_samples(monkeypatch, 45.0)
    with pytest.raises(StartupError) as ei, hostload.named_on_failure((StartupError,)):
        raise StartupError("topology dp2: worker-0 not ready within 600 s", "--- worker-0 ...")
    msg = str(ei.value).splitlines()
    assert msg[0] == "topology dp2: worker-0 not ready within 600 s"
    assert msg[1] == (f"host load: outside this session, over the boot's 50 s (2 CPUs, 0 % "
                      f"busy): pid {gone} busy 90 % of a CPU")
    assert msg[2] == "--- worker-0 ..."
    assert ei.value.summary == msg[0]


def test_a_failed_boot_on_a_quiet_host_is_left_as_it_is(monkeypatch):
    _fake_samples(monkeypatch, 0.5)
    with pytest.raises(StartupError) as ei, hostload.named_on_failure((StartupError,)):
        raise StartupError("worker-0 exited while starting", "log tail")
    assert str(ei.value) == "worker-0 exited while starting\nlog tail"


def test_other_errors_and_a_disabled_sample_are_left_as_they_are(monkeypatch):
    _fake_samples(monkeypatch, 45.0)
    with pytest.raises(ConfigError) as ei, hostload.named_on_failure((StartupError,)):
        raise ConfigError("bad")
    assert str(ei.value) == "bad"
    monkeypatch.setattr(hostload, "snapshot", lambda: pytest.fail("sampled while disabled"))
    with pytest.raises(StartupError) as ei, hostload.named_on_failure((StartupError,), False):
        raise StartupError("s", "d")
    assert str(ei.value) == "s\nd"


def test_this_hosts_process_table():
    """On the real table: this process and a child of it are inside the session, init is not
    (a share of 0 makes every process a candidate)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = hostload.snapshot()
        after = hostload.snapshot()
        assert before is not None and os.getpid() in after.procs and child.pid in after.procs
        assert after.procs[os.getpid()].python
        outside = names(hostload.busy_outside(before, after, os.getpid(), share=0.0))
        assert os.getpid() not in outside and child.pid not in outside
        assert 1 in outside or 1 not in after.procs
    finally:
        child.kill()
        child.wait()
