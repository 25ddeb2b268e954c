"""Negative controls for every pass/fail branch of e2e_test/infra/lifecycle/teardown.py that a
mutant showed no other unit test caught (docs/mutation.md): the GPU tolerance at its edge, the
wait for GPU memory to settle, the verdict's lines (nodes, holders, escaped), and a /dev/shm
segment that a live process maps (its file descriptor closed) is never removed."""

from __future__ import annotations

import contextlib
import ctypes
import os
import types
import uuid

import pytest

from e2e_test.infra.lifecycle import teardown as td
from e2e_test.infra.lifecycle.teardown import TeardownReport


def _memory(values):
    """gpu_memory_mib answering each call with the next of `values` (the last one repeats)."""
    seq = list(values)

    def read(devices):
        now = seq.pop(0) if len(seq) > 1 else seq[0]
        return {d: v for d, v in now.items() if d in set(devices)}
    return read


@pytest.mark.parametrize("above, leaks", [(64.0, {}), (64.5, {0: 64.5}), (65.0, {0: 65.0}),
                                          (100.0, {0: 100.0})])
def test_gpu_tolerance_is_64_mib(monkeypatch, above, leaks):
    """A leak of exactly the tolerance (64 MiB) passes, one above it fails: a 100 MiB leak
    fails (it would pass under a tolerance of 128)."""
    assert td.GPU_TOLERANCE_MIB == 64
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 1000.0 + above, 1: 1000.0}]))
    monkeypatch.setattr(td, "gpu_holders", lambda devices: [])
    assert td.wait_gpu_baseline({0: 1000.0, 1: 1000.0}, timeout=0) == leaks
    rep = TeardownReport()
    td.check_gpu(rep, {0: 1000.0, 1: 1000.0}, timeout=0, poll=0)
    assert rep.ok == (not leaks) and rep.gpu_checked and rep.gpu_wait_s == 0
    if leaks:
        assert rep.verdict() == (f"NOT clean: GPU memory above baseline (MiB): {leaks} after 0 "
                                 "s, no process holds memory on GPU 0 per NVML (released late)")
        assert rep.gpu_holders == {0: []} and rep.gpu_settle_s is None


def test_wait_gpu_baseline_waits_until_memory_comes_back(monkeypatch):
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 900.0}, {0: 700.0}, {0: 500.0}]))
    assert td.wait_gpu_baseline({0: 500.0}, timeout=5) == {}
    rep = TeardownReport()
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 900.0}, {0: 520.0}]))
    td.check_gpu(rep, {0: 500.0}, timeout=5, poll=0.01)
    assert rep.ok and rep.gpu_leaks == {} and rep.gpu_wait_s == 5
    assert rep.gpu_settle_s is not None and 0 <= rep.gpu_settle_s < 5
    # the default wait is 20 s: a leak that stays is reported only after it
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 900.0}]))
    monkeypatch.setattr(td.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    clock = [0.0]
    monkeypatch.setattr(td.time, "monotonic", lambda: clock[0])
    assert td.wait_gpu_baseline({0: 500.0}) == {0: 400.0}
    assert clock[0] == pytest.approx(20.25)         # polled every 0.25 s past 20 s


class _Holder:
    def __init__(self, device, text):
        self.device, self.text = device, text

    def __str__(self):
        return self.text


def test_a_leak_names_the_processes_nvml_lists(monkeypatch):
    holders = [_Holder(0, "pid 7 vllm (alice) 900 MiB"), _Holder(1, "pid 8 other")]
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 1500.0, 1: 500.0}]))
    monkeypatch.setattr(td, "gpu_holders", lambda devices: holders)
    rep = TeardownReport()
    td.check_gpu(rep, {0: 500.0, 1: 500.0}, timeout=0, poll=0)
    assert rep.gpu_holders == {0: ["pid 7 vllm (alice) 900 MiB"]}
    assert rep.verdict() == ("NOT clean: GPU memory above baseline (MiB): {0: 1000.0} after 0 s, "
                             "GPU 0 held by pid 7 vllm (alice) 900 MiB")


def test_a_device_nvml_stopped_reading_is_not_verified_the_others_are(monkeypatch):
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 500.0}]))
    rep = TeardownReport()
    td.check_gpu(rep, {0: 500.0, 1: 500.0}, timeout=0, poll=0)
    assert rep.gpu_checked and rep.gpu_leaks == {} and not rep.ok
    assert rep.unverified == [("GPU memory of GPU(s) [1]: NVML read nothing at the stop, so "
                               "it was not compared with the baseline")]
    rep = TeardownReport()
    td.check_gpu(rep, {}, timeout=0)                # no baseline: nothing asked, nothing said
    assert rep.ok and not rep.gpu_checked and rep.gpu_wait_s is None


def test_gpu_memory_mib_reads_nvml_in_mib(monkeypatch):
    class FakeNvml:
        """NVML's two calls, for this unit test of the MiB arithmetic only."""
        @staticmethod
        def nvmlDeviceGetHandleByIndex(d):
            return d

        @staticmethod
        def nvmlDeviceGetMemoryInfo(h):
            if h == 9:
                raise RuntimeError("gone")
            return types.SimpleNamespace(used=(h + 1) * 2**30)

    @contextlib.contextmanager
    def session(n):
        yield n
    monkeypatch.setattr(td, "nvml", lambda: session(FakeNvml))
    assert td.gpu_memory_mib((0, 1)) == {0: 1024.0, 1: 2048.0}
    assert td.gpu_memory_mib((0, 9)) == {}          # one device failing: nothing read
    assert td.gpu_memory_mib(()) == {}
    monkeypatch.setattr(td, "nvml", lambda: session(None))
    assert td.gpu_memory_mib((0,)) == {}


def test_check_gpu_own_names_only_this_topologys_pids(monkeypatch):
    monkeypatch.setattr(td, "nvml_processes", lambda devices: {
        0: [(100, None), (101, 300.0), (7, 900.0)], 1: [(7, 10.0)]})
    rep = TeardownReport()
    td.check_gpu_own(rep, (0, 1), {100, 101}, timeout=0, poll=0)
    assert rep.gpu_leaks == {0: 300.0} and rep.gpu_wait_s == 0
    assert rep.gpu_holders == {0: ["pid 100 0 MiB on GPU 0 (this topology)",
                                   "pid 101 300 MiB on GPU 0 (this topology)"]}
    rep = TeardownReport()
    td.check_gpu_own(rep, (), {100})
    assert rep.ok and not rep.gpu_checked


# -- the verdict ------------------------------------------------------------------------------

def test_clean_verdict_counts_sigkills_escapes_and_nodes():
    r = TeardownReport(seconds=2.0, escalated=["a", "b"], escaped=["pid 9"],
                       nodes={"driver": {"ok": True}, "node-1": {"ok": True}})
    assert r.verdict() == ("clean in 2.0 s on 1 node(s) and the driver's host, 2 needed SIGKILL, "
                           "1 had left a worker's session (stopped too)")
    assert TeardownReport(seconds=0.04, escaped=["x"]).verdict() == (
        "clean in 0.0 s, 1 had left a worker's session (stopped too)")


def test_a_node_that_is_not_clean_is_named_with_its_own_verdict():
    r = TeardownReport(survivors=["pid 1"], nodes={
        "driver": {"ok": True, "verdict": "clean in 1.0 s"},
        "node-1": {"ok": False, "verdict": "NOT clean: ports still listening: [1]"},
        "node-2": {"ok": False, "verdict": "NOT clean: 1 process(es) alive: ['pid 1']"}})
    assert r.verdict() == ("NOT clean: node-1: ports still listening: [1]; node-2: 1 "
                           "process(es) alive: ['pid 1']")
    # every node clean but the merged report not: the report's own parts
    r.nodes = {"driver": {"ok": True, "verdict": "clean"}}
    assert r.verdict() == "NOT clean: 1 process(es) alive: ['pid 1']"


def test_unverified_hosts_are_never_clean_and_only_five_are_named():
    r = TeardownReport(unverified=[f"node-{i}: lost" for i in range(7)])
    assert not r.ok
    assert r.verdict() == ("NOT clean: not verified: node-0: lost; node-1: lost; node-2: lost; "
                           "node-3: lost; node-4: lost")
    r = TeardownReport(shm_left=[f"s{i}" for i in range(6)], gpu_leaks={1: 70.0})
    assert r.verdict() == ("NOT clean: GPU memory above baseline (MiB): {1: 70.0}; /dev/shm "
                           "segments left: ['s0', 's1', 's2', 's3', 's4']")


# -- /dev/shm ---------------------------------------------------------------------------------

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


@pytest.mark.parametrize("name", ["e2e-mapped-{}", "e2e mapped {}", "e2e mapped {}X",
                                  "e2e mapped {} "])
def test_a_segment_a_live_process_maps_is_never_removed(name):
    """As a POSIX shm user does (shm_open, mmap, close): no descriptor is left, only the
    mapping (/proc/<pid>/maps). A name with a space was read up to the space, and the
    segment, still mapped, was removed; a name is read to its end, whatever it ends with."""
    if not td.SHM.is_dir() or not os.access(td.SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    libc = _libc()
    path = td.SHM / name.format(uuid.uuid4().hex[:12])
    gone = td.SHM / f"e2e-unmapped-{uuid.uuid4().hex[:12]}"
    before = td.shm_snapshot()
    path.write_bytes(b"x" * 4096)
    gone.write_bytes(b"x")
    fd = os.open(path, os.O_RDWR)
    addr = libc.mmap(None, 4096, 1, 1, fd, 0)       # PROT_READ, MAP_SHARED
    os.close(fd)
    try:
        assert addr not in (None, ctypes.c_void_p(-1).value)
        removed, left = td.clean_shm(before | (td.shm_snapshot() - {path.name, gone.name}))
        assert path.exists() and path.name not in removed
        assert removed == [gone.name] and left == [] and not gone.exists()
    finally:
        libc.munmap(addr, 4096)
        path.unlink(missing_ok=True)
        gone.unlink(missing_ok=True)


def test_a_segment_that_cannot_be_removed_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(td, "SHM", tmp_path)
    before = td.shm_snapshot()
    for n in ("psm_a", "psm_b", "psm_c"):
        (tmp_path / n).write_bytes(b"x")
    real_unlink = type(tmp_path).unlink

    def unlink(self, *a, **kw):
        if self.name == "psm_a":
            raise PermissionError("read-only")
        if self.name == "psm_b":
            real_unlink(self)                      # gone meanwhile: neither removed nor left
            raise FileNotFoundError(self)
        return real_unlink(self, *a, **kw)
    monkeypatch.setattr(type(tmp_path), "unlink", unlink)
    assert td.clean_shm(before) == (["psm_c"], ["psm_a"])


def test_a_descriptor_that_cannot_be_read_skips_only_itself(monkeypatch, tmp_path):
    if not td.SHM.is_dir() or not os.access(td.SHM, os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = td.SHM / f"e2e-held-{uuid.uuid4().hex[:12]}"
    path.write_bytes(b"x")
    real = os.stat
    failed = []

    def stat(p, *a, **kw):
        if not failed and str(p).startswith(f"/proc/{os.getpid()}/fd/"):
            failed.append(p)
            raise OSError("gone")
        return real(p, *a, **kw)
    monkeypatch.setattr(td.os, "stat", stat)
    try:
        with open(os.devnull, "rb"), open(path, "rb"):
            st = real(path)
            assert (st.st_dev, st.st_ino) in td._held_shm_inodes()
        assert failed
    finally:
        path.unlink(missing_ok=True)


def test_gpu_waits_20_s_by_default_and_rounds_what_it_reports(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(td.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(td.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    asked = []
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 600.04}]))
    monkeypatch.setattr(td, "gpu_holders", lambda devices: asked.append(devices) or [])
    rep = TeardownReport()
    td.check_gpu(rep, {0: 500.0})
    assert clock[0] == pytest.approx(20.25) and rep.gpu_wait_s == 20.0
    assert rep.gpu_leaks == {0: 100.0} and asked == [[0]]
    clock[0] = 0.0
    monkeypatch.setattr(td, "nvml_processes", lambda devices: asked.append(devices) or {
        0: [(100, 10.54), (101, None)]})
    rep = TeardownReport()
    td.check_gpu_own(rep, (0,), {100})
    assert clock[0] == pytest.approx(20.25) and rep.gpu_leaks == {0: 10.5}
    assert asked[-1] == (0,)


def test_settle_time_is_kept_to_the_hundredth(monkeypatch):
    ticks = iter([0.0, 1.23456, 1.23456])
    monkeypatch.setattr(td.time, "monotonic", lambda: next(ticks))
    monkeypatch.setattr(td, "gpu_memory_mib", _memory([{0: 500.0}]))
    rep = TeardownReport()
    td.check_gpu(rep, {0: 500.0}, timeout=5)
    assert rep.gpu_settle_s == 1.23


def test_nothing_read_at_the_stop_is_not_checked(monkeypatch):
    monkeypatch.setattr(td, "gpu_memory_mib", lambda devices: {})
    rep = TeardownReport()
    td.check_gpu(rep, {0: 500.0}, timeout=0, poll=0)
    assert rep.gpu_checked is False and not rep.ok


def test_every_holder_of_a_device_is_named():
    r = TeardownReport(gpu_leaks={0: 80.0}, gpu_wait_s=3.0,
                       gpu_holders={0: ["pid 1 a", "pid 2 b"]})
    assert r.verdict() == ("NOT clean: GPU memory above baseline (MiB): {0: 80.0} after 3 s, "
                           "GPU 0 held by pid 1 a, pid 2 b")
