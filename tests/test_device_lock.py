"""The session's device lock (e2e_test/infra/lifecycle/exclusive.py) across processes: shared
holders overlap; an exclusive taker waits for them and holds the device alone; a shared taker
that comes while an exclusive one waits goes after it (no starvation). Negative control: the
same sequence with the gate taken away lets the late shared taker in first."""

import multiprocessing
import time

from e2e_test.infra.lifecycle import exclusive
from e2e_test.infra.lifecycle.exclusive import DeviceLock

CTX = multiprocessing.get_context("spawn")


def _hold(folder, how, hold_s, log, name, start_after_s, no_gate=False):
    if no_gate:       # the negative control: the gate is a no-op
        import contextlib
        orig = exclusive.DeviceLock._locked

        def locked(self, lock, flag):
            if lock == "gate.lock":
                return contextlib.nullcontext()
            return orig(self, lock, flag)
        exclusive.DeviceLock._locked = locked
    time.sleep(start_after_s)
    lock = DeviceLock(folder)
    with (lock.shared() if how == "shared" else lock.exclusive()):
        with open(log, "a") as f:
            f.write(f"{name} in {time.time()}\n")
        time.sleep(hold_s)
        with open(log, "a") as f:
            f.write(f"{name} out {time.time()}\n")


def _run(tmp_path, plan, no_gate=False):
    log = tmp_path / "log"
    procs = [CTX.Process(target=_hold, args=(str(tmp_path / "locks"), how, hold, str(log), name,
                                             after, no_gate))
             for name, how, hold, after in plan]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = [line.split() for line in log.read_text().splitlines()]
    return [(n, what) for n, what, _ in sorted(events, key=lambda e: float(e[2]))]


def test_shared_holders_overlap_and_an_exclusive_one_is_alone(tmp_path):
    got = _run(tmp_path, [("a", "shared", 1.5, 0), ("b", "shared", 1.5, 0.2),
                          ("x", "exclusive", 0.5, 0.5)])
    # a and b overlap; x waits for both and nothing overlaps it
    assert got.index(("b", "in")) < got.index(("a", "out"))
    i = got.index(("x", "in"))
    assert got[i + 1] == ("x", "out") and i == 4, got


def test_a_waiting_exclusive_taker_is_not_starved(tmp_path):
    """a holds shared; x asks exclusive and waits; c asks shared after x: c goes after x."""
    plan = [("a", "shared", 1.5, 0), ("x", "exclusive", 0.3, 0.4), ("c", "shared", 0.3, 0.8)]
    got = _run(tmp_path, plan)
    assert got.index(("x", "out")) < got.index(("c", "in")), got
    # the negative control: without the gate, c joins a's shared hold at once, before x
    got = _run(tmp_path / "nogate", plan, no_gate=True)
    assert got.index(("c", "in")) < got.index(("x", "in")), got
