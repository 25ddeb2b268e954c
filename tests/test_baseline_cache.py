"""The baseline's evidence cache (e2e_test/infra/verdicts/baseline.py): a key is computed once
for every process sharing the folder, a failed compute is raised to every later asker, and a
claim makes the others wait for the claimant instead of computing. Pure: fake computes, no
engine; two processes race through multiprocessing."""

import multiprocessing
import os
import pickle
import time
from pathlib import Path

import pytest

from e2e_test.infra.verdicts import baseline, oracle
from e2e_test.infra.verdicts.baseline import MISSING, EvidenceCache, EvidenceError

CTX = multiprocessing.get_context("spawn")


def test_computed_once_then_read_by_every_asker(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"steps": [1, 2, 3]}

    a = EvidenceCache(tmp_path)
    assert a.get("k", compute) == {"steps": [1, 2, 3]}
    # another instance on the same folder (as another process would hold) reads it
    b = EvidenceCache(tmp_path)
    assert b.get("k", compute) == {"steps": [1, 2, 3]}
    assert len(calls) == 1
    assert b.get("other", compute) and len(calls) == 2      # another key is computed
    # written atomically: no temporary file is left beside the values
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        ["k.pkl", "other.pkl"]


def _race(folder: str, counter: str, out: str, lock: bool) -> None:
    """One process asking for key `k`: counts its computes in `counter` (appended), writes
    what it got to `out`."""
    if not lock:      # the negative control: check-then-compute with no lock
        import contextlib
        baseline.FileLock = lambda *a, **k: contextlib.nullcontext()

    def compute():
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        deadline = time.monotonic() + (30 if not lock else 1.0)
        # long enough that the other process asks meanwhile; without the lock, until it
        # computes too (on a loaded machine it may start late)
        while time.monotonic() < deadline and len(Path(counter).read_text().split()) < 2:
            time.sleep(0.05)
        return os.getpid()

    Path(out).write_text(str(EvidenceCache(folder).get("k", compute)))


def _two_racers(tmp_path, lock: bool) -> tuple[list[str], set[str]]:
    counter = tmp_path / "computes"
    procs = [CTX.Process(target=_race, args=(str(tmp_path / "cache"), str(counter),
                                             str(tmp_path / f"out{i}"), lock))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return counter.read_text().split(), {(tmp_path / f"out{i}").read_text() for i in range(2)}


def test_two_processes_racing_for_a_key_compute_it_once(tmp_path):
    computes, got = _two_racers(tmp_path, lock=True)
    assert len(computes) == 1, computes
    assert got == {computes[0]}          # both hold the one value the first computed


def test_without_the_lock_both_would_compute(tmp_path):
    """The negative control: the same race with the lock taken away computes twice."""
    computes, got = _two_racers(tmp_path, lock=False)
    assert len(computes) == 2 and len(got) == 2, (computes, got)


def test_a_failed_compute_fails_every_later_asker_at_once(tmp_path):
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("worker-0 exited while starting: no KV room")

    cache = EvidenceCache(tmp_path)
    with pytest.raises(RuntimeError, match="no KV room"):
        cache.get("vllm--1--gsm8k", boom)
    for c in (cache, EvidenceCache(tmp_path)):
        with pytest.raises(EvidenceError, match="vllm--1--gsm8k: RuntimeError: worker-0 exited "
                                                "while starting: no KV room"):
            c.get("vllm--1--gsm8k", boom)
    assert len(calls) == 1
    with pytest.raises(EvidenceError, match="no KV room"):
        cache.has("vllm--1--gsm8k")


def test_an_interrupt_is_not_stored(tmp_path):
    """The negative control of the error file: a compute stopped from outside (Ctrl-C,
    pytest.fail/skip, which are BaseExceptions) says nothing about the baseline, so the next
    asker computes again."""
    cache = EvidenceCache(tmp_path)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.get("k", interrupted)
    assert not cache.has("k") and cache.peek("k") is MISSING
    assert cache.get("k", lambda: 7) == 7


def _claim_and_store(folder: str, hold_s: float, value) -> None:
    cache = EvidenceCache(folder)
    assert cache.claim("vllm/1", "gw1")
    time.sleep(hold_s)
    if value is not None:
        cache.get("k", lambda: value)
    cache.release("vllm/1")


def test_a_claimant_is_waited_for(tmp_path):
    p = CTX.Process(target=_claim_and_store, args=(str(tmp_path), 1.5, {"ok": 1}))
    p.start()
    cache = EvidenceCache(tmp_path)
    deadline = time.monotonic() + 30
    while cache.claimed_by("vllm/1") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    owner = cache.claimed_by("vllm/1")
    assert owner and owner["worker"] == "gw1" and owner["pid"] == p.pid
    assert not cache.claim("vllm/1", "gw0")           # held by a live process
    assert cache.wait("k", "vllm/1", timeout_s=30, poll_s=0.05) == {"ok": 1}
    p.join(30)
    assert cache.claimed_by("vllm/1") is None          # released
    assert cache.claim("vllm/1", "gw0")                # free again


def test_a_claim_released_without_the_value_is_missing_not_waited_for(tmp_path):
    p = CTX.Process(target=_claim_and_store, args=(str(tmp_path), 0.5, None))
    p.start()
    cache = EvidenceCache(tmp_path)
    while cache.claimed_by("vllm/1") is None and p.is_alive():
        time.sleep(0.05)
    t0 = time.monotonic()
    assert cache.wait("k", "vllm/1", timeout_s=30, poll_s=0.05) is MISSING
    assert time.monotonic() - t0 < 20
    p.join(30)


def test_a_claim_of_a_dead_process_is_taken_over_and_a_live_one_times_out(tmp_path):
    cache = EvidenceCache(tmp_path)
    p = CTX.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    (tmp_path / "claim--vllm_1.json").write_text(f'{{"pid": {p.pid}, "worker": "gw3"}}')
    assert cache.claimed_by("vllm/1") is None          # its process is gone
    assert cache.wait("k", "vllm/1", timeout_s=5) is MISSING
    assert cache.claim("vllm/1", "gw0")
    # a live claimant that never stores: the wait ends in an error naming it
    (tmp_path / "claim--vllm_1.json").write_text(f'{{"pid": {os.getppid()}, "worker": "gw2"}}')
    with pytest.raises(EvidenceError, match=r"k: not measured after 0 s by gw2 \(pid \d+\), "
                                            r"which claimed vllm/1"):
        cache.wait("k", "vllm/1", timeout_s=0.2, poll_s=0.05)


def test_evidence_survives_the_trip_through_the_file(tmp_path):
    """What crosses between processes: a Pass (a dict with attributes), the control arm and
    the recall codes come back equal."""
    step = oracle.Step(token="a", logprob=-0.1, top={"a": -0.1, "b": -2.0})
    passes = oracle.Pass({0: [step], 1: None})
    passes.shape, passes.lead, passes.errors = "/v1/completions logprobs=5", {0: ""}, {1: "x"}
    cmp = oracle.compare("gsm8k", "vllm/1", "vllm/1 second pass", passes, passes)
    ev = baseline.Evidence("vllm", "1", "recall", passes, oracle.ControlArm([cmp]),
                           recall={"copied": [0, 3]})
    got = EvidenceCache(tmp_path).get("e", lambda: ev)
    back = pickle.loads((tmp_path / "e.pkl").read_bytes())
    for e in (got, back):
        assert e.passes == passes and e.passes.shape == passes.shape
        assert e.passes.errors == {1: "x"} and e.recall["copied"] == [0, 3]
        assert e.control.comparisons[0].counts() == cmp.counts()
        assert e.label == "vllm/1"


def test_the_baseline_topology_of_each_what():
    from e2e_test.infra.specs import topology as topologies
    t = topologies.parse
    assert baseline.baseline_topology("gsm8k", t("1p1d")) == "1"
    assert baseline.baseline_topology("recall", t("dp2")) == "1"
    assert baseline.baseline_topology("afd-prompts", t("native-dp2")) == "native-dp2"
    assert baseline.baseline_topology("afd-prompts", t("2a2f"), [t("native-dp4"), t("4a4f")]) \
        == "native-dp4"
    assert baseline.baseline_topology("afd-prompts", t("1a1f")) == "native-dp2"
    with pytest.raises(ValueError, match="unknown evidence 'gsm9k'"):
        baseline.compute(None, "gsm9k")
