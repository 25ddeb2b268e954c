"""Verified teardown: the report's verdict, /dev/shm cleanup, listening ports, enforce()."""

import os
import socket
import uuid

import psutil
import pytest

from e2e_test.infra.errors import TeardownError
from e2e_test.infra.lifecycle import teardown
from e2e_test.infra.lifecycle.teardown import (
    SHM,
    TeardownReport,
    clean_shm,
    enforce,
    listening_ports,
    shm_snapshot,
)

# -- report -----------------------------------------------------------------------------------


def test_clean_report():
    r = TeardownReport(seconds=1.25)
    assert r.ok and r.verdict() == "clean in 1.2 s"
    r = TeardownReport(seconds=3.0, escalated=["prefill-0"], shm_removed=["psm_1"])
    assert r.ok and r.verdict() == "clean in 3.0 s, 1 needed SIGKILL"
    d = r.to_dict()
    assert d["ok"] is True and d["verdict"] == r.verdict() and d["escalated"] == ["prefill-0"]


@pytest.mark.parametrize("kw,part", [
    ({"survivors": ["pid 12 python -m vllm"]}, "1 process(es) alive: ['pid 12 python -m vllm']"),
    ({"busy_ports": [20001]}, "ports still listening: [20001]"),
    ({"gpu_leaks": {0: 512.0}}, "GPU memory above baseline (MiB): {0: 512.0}"),
    ({"shm_left": ["psm_abc"]}, "/dev/shm segments left: ['psm_abc']"),
])
def test_each_leak_makes_it_not_clean(kw, part):
    r = TeardownReport(**kw)
    assert not r.ok
    assert r.verdict() == "NOT clean: " + part
    assert r.to_dict()["ok"] is False


def test_verdict_lists_every_problem():
    r = TeardownReport(survivors=[f"pid {i}" for i in range(7)], busy_ports=[1, 2],
                       shm_left=["a"])
    v = r.verdict()
    assert v.startswith("NOT clean: 7 process(es) alive: ['pid 0', 'pid 1', 'pid 2', 'pid 3', "
                        "'pid 4']; ports still listening: [1, 2]; /dev/shm segments left")
    assert "pid 5" not in v


# -- /dev/shm ---------------------------------------------------------------------------------

@pytest.fixture
def shm_files():
    """Make uniquely named files in /dev/shm; remove whatever is left afterwards."""
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    made = []

    def make(tag: str):
        p = SHM / f"e2e-test-{tag}-{uuid.uuid4().hex[:12]}"
        p.write_bytes(b"x" * 64)
        made.append(p)
        return p

    yield make
    for p in made:
        p.unlink(missing_ok=True)


def test_clean_shm_removes_new_unheld_files_only(shm_files):
    old = shm_files("old")
    before = shm_snapshot()
    assert old.name in before
    new = shm_files("new")
    held = shm_files("held")
    with open(held, "rb"):                  # this process holds it open
        # Only our own files count as new, whatever other processes do in /dev/shm meanwhile.
        before = shm_snapshot() - {new.name, held.name}
        removed, left = clean_shm(before)
        assert new.name in removed and not new.exists()
        assert held.name not in removed and held.exists()
    assert old.exists() and old.name not in removed
    assert left == []


def test_clean_shm_in_a_private_folder(tmp_path, monkeypatch):
    # A private stand-in for /dev/shm: nothing else can appear in it.
    monkeypatch.setattr(teardown, "SHM", tmp_path)
    (tmp_path / "psm_old").write_bytes(b"x")
    (tmp_path / "subdir").mkdir()
    before = shm_snapshot()
    assert before == {"psm_old", "subdir"}
    assert clean_shm(before) == ([], [])
    (tmp_path / "psm_new").write_bytes(b"x")
    (tmp_path / "newdir").mkdir()           # folders are never removed
    assert clean_shm(before) == (["psm_new"], [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newdir", "psm_old", "subdir"]


def test_shm_snapshot_without_dev_shm(tmp_path, monkeypatch):
    monkeypatch.setattr(teardown, "SHM", tmp_path / "missing")
    assert shm_snapshot() == set()


# -- ports ------------------------------------------------------------------------------------

def test_listening_ports():
    with socket.socket() as listener, socket.socket() as bound_only:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        bound_only.bind(("127.0.0.1", 0))      # bound but not listening: not busy
        port, other = listener.getsockname()[1], bound_only.getsockname()[1]
        assert listening_ports({port, other}) == [port]
        assert listening_ports({other}) == []
    assert listening_ports({port}) == []
    assert listening_ports(set()) == []


# -- enforce ----------------------------------------------------------------------------------

LEAKY = TeardownReport(busy_ports=[20001])


def test_enforce_clean_is_silent(recwarn):
    enforce(TeardownReport(), "1p1d", strict=True)
    enforce(TeardownReport(escalated=["w"]), "1p1d", strict=False)
    assert len(recwarn) == 0


def test_enforce_strict_raises():
    with pytest.raises(TeardownError) as ei:
        enforce(LEAKY, "vllm 1p1d", strict=True)
    assert str(ei.value) == "teardown of vllm 1p1d: NOT clean: ports still listening: [20001]"


def test_enforce_warns_otherwise():
    with pytest.warns(RuntimeWarning, match=r"^!!! teardown of 1p1d: NOT clean: ports"):
        enforce(LEAKY, "1p1d", strict=False)


@pytest.mark.parametrize("ci", ["true", "1", "YES"])
def test_enforce_strict_in_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(TeardownError):
        enforce(LEAKY, "1p1d")


def test_enforce_warns_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.warns(RuntimeWarning):
        enforce(LEAKY, "1p1d")
    monkeypatch.setenv("CI", "false")
    with pytest.warns(RuntimeWarning):
        enforce(LEAKY, "1p1d")


def test_a_topology_stopped_beside_others_checks_only_its_own_processes(monkeypatch):
    """Booted together with others (coboot.py): its teardown waits until none of ITS pids
    holds GPU memory (NVML's per-process list); the others' memory is not a leak. A pid of its
    own that keeps holding memory past the wait is named."""
    from e2e_test.infra.lifecycle import teardown as td
    seen = iter([{0: [(100, 500.0), (7, 900.0)]}, {0: [(7, 900.0)]}])
    monkeypatch.setattr(td, "nvml_processes", lambda devices: next(seen))
    rep = td.TeardownReport()
    td.check_gpu_own(rep, (0,), {100, 101}, timeout=5, poll=0)
    assert rep.gpu_checked and rep.gpu_leaks == {} and rep.ok
    monkeypatch.setattr(td, "nvml_processes", lambda devices: {0: [(100, 512.0), (7, 900.0)]})
    rep = td.TeardownReport()
    td.check_gpu_own(rep, (0,), {100}, timeout=0, poll=0)
    assert rep.gpu_leaks == {0: 512.0} and not rep.ok
    assert rep.gpu_holders == {0: ["pid 100 512 MiB on GPU 0 (this topology)"]}
    monkeypatch.setattr(td, "nvml_processes", lambda devices: None)    # no NVML: unchecked
    rep = td.TeardownReport()
    td.check_gpu_own(rep, (0,), {100})
    assert not rep.gpu_checked and not rep.ok and rep.unverified      # and never clean


def test_a_gpu_check_over_nothing_is_not_verified_never_clean(monkeypatch):
    """NVML reading nothing, at the start (no baseline), at the stop (a device of the baseline
    unread) or for the per-process list: each made the GPU check skip itself, and the report
    said clean."""
    from e2e_test.infra.lifecycle import launcher
    from e2e_test.infra.lifecycle import teardown as td
    monkeypatch.setattr(td, "gpu_memory_mib", lambda devices: {})
    monkeypatch.setattr(td, "listening_ports", lambda ports: [])
    monkeypatch.setattr(td, "clean_shm", lambda shm: ([], []))
    base = launcher.LocalLauncher().baseline((0,))
    assert base.gpus == (0,) and base.gpu_mib == {}
    rep = launcher.LocalLauncher().verify([], set(), base)
    assert not rep.ok and "NVML read nothing at the start" in rep.verdict()
    rep = td.TeardownReport()                     # a baseline, then nothing read at the stop
    td.check_gpu(rep, {0: 500.0, 1: 500.0}, timeout=0, poll=0)
    assert not rep.ok and "GPU(s) [0, 1]: NVML read nothing at the stop" in rep.verdict()
    assert not rep.gpu_checked         # the reports must not say "back to baseline (NVML)"
    monkeypatch.setattr(td, "nvml_processes", lambda devices: None)
    rep = td.TeardownReport()
    td.check_gpu_own(rep, (0,), {100})
    assert not rep.ok and "NVML's process list could not be read" in rep.verdict()
    # a CPU topology asks no GPU: nothing to verify, clean
    assert launcher.LocalLauncher().verify([], set(), launcher.LocalLauncher().baseline(())).ok


def test_ports_that_could_not_be_listed_are_not_verified(monkeypatch):
    """psutil refusing the socket list made the port check read "none listening": clean."""
    from e2e_test.infra.lifecycle import launcher
    from e2e_test.infra.lifecycle import teardown as td

    def refused(kind):
        raise psutil.AccessDenied()
    monkeypatch.setattr(td.psutil, "net_connections", refused)
    assert td.listening_ports({20001}) is None and td.listening_ports(set()) == []
    monkeypatch.setattr(td, "clean_shm", lambda shm: ([], []))
    rep = launcher.LocalLauncher().verify([], {20001}, launcher.LocalLauncher().baseline(()))
    assert not rep.ok and "ports [20001]: the listening sockets could not be listed" in rep.verdict()


def test_clean_shm_keeps_a_live_semaphore_that_maps_show_under_another_name():
    """multiprocessing's SemLock (spawn) is a POSIX semaphore that glibc maps under a
    temporary name (/proc/PID/maps: `/dev/shm/sem.XXXXXX (deleted)`) before linking it to
    `sem.mp-...`. Held by inode it stays, and a spawned child still opens it; by path it was
    removed, and the child failed in `SemLock._rebuild` with FileNotFoundError (vLLM's engine
    core, started while another topology's teardown ran)."""
    import multiprocessing

    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    before = shm_snapshot()
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    name = "sem." + lock._semlock.name.lstrip("/")
    assert name in shm_snapshot() - before
    mapped = open("/proc/self/maps").read()
    assert f"/dev/shm/{name}" not in mapped          # the premise: maps name another path
    removed, left = clean_shm(shm_snapshot() - {name})
    assert name not in removed and (SHM / name).exists(), removed
    child = ctx.Process(target=_take_and_release, args=(lock,))
    child.start()
    child.join(60)
    assert child.exitcode == 0


def _take_and_release(lock):
    with lock:
        pass
