"""The lane time report's arithmetic (infra/reports/time_report.py), on plain data."""

import json

import pytest

from e2e_test.infra.reports import time_report as tr


def test_union_length_subtract():
    assert tr.union([(5, 7), (0, 2), (1, 3), (4, 4), (9, 8)]) == [(0, 3), (5, 7)]
    assert tr.length([(0, 2), (1, 3), (5, 7)]) == 5
    assert tr.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert tr.subtract([(0, 1)], [(1, 2)]) == [(0, 1)]
    assert tr.subtract([(0, 4)], []) == [(0, 4)]
    assert tr.clip([(-5, 2), (8, 20)], 0, 10) == [(0, 2), (8, 10)]


def cl(name, boot, ready, down=None, down_s=None, **kw):
    return {"name": name, "topology": kw.pop("topology", "1"), "boot_started": boot,
            "total_ready_s": ready, "teardown_started": down, "teardown_s": down_s, **kw}


def test_shares_partition_the_wall_time():
    # session 0..100; cluster A boots 0..30, torn down 60..65; cluster B boots inside a test
    # body (a window test) 70..80, torn down 85..90. Test bodies: 30..60 and 65..95.
    clusters = [cl("a", 0, 30, 60, 5, workers={"worker-0": 29.5}, gateway_ready_s=0.5),
                cl("b", 70, 10, 85, 5, topology="1p1d",
                   workers={"prefill-0": 8, "decode-0": 9.5}, gateway_ready_s=0.5)]
    rep = tr.compute(clusters, [(30, 60), (65, 95)], 0, 100)
    assert rep["boot_s"] == 40 and rep["teardown_s"] == 10
    assert rep["traffic_s"] == 30 + 15              # 65..95 less B's boot and teardown
    assert rep["idle_s"] == 5                       # 95..100
    assert sum(rep["share_pct"].values()) == pytest.approx(100)
    assert rep["share_pct"] == {"boot": 40.0, "traffic": 45.0, "teardown": 10.0, "idle": 5.0}
    assert rep["boot_by_role_s"] == {"worker": 29.5, "gateway": 1.0, "prefill": 8, "decode": 9.5}
    assert rep["boots"] == 2
    assert tr.headline(rep) == ("boots 40 %, traffic 45 %, teardown 10 %, idle 5 % of 100 s "
                                "(2 boots, 40 s)")


def test_roles_from_the_cluster_and_restarts_count_as_boot():
    c = cl("a", 0, 10, 50, 2, workers={"w-a": 9, "w-b": 7}, roles={"w-a": "decode", "w-b":
                                                                     "decode"},
           restart_boots=[[20, 5]])
    rep = tr.compute([c], [(10, 50)], 0, 60)
    assert rep["boot_by_role_s"] == {"decode": 9}     # the slowest of the role, not the sum
    assert rep["boot_s"] == 15 and rep["traffic_s"] == 35
    assert rep["clusters"][0]["restarts_s"] == [5]


def test_a_held_restarts_imports_count_as_boot_where_they_fall():
    """Cluster.hold_restarts: a held interpreter's imports are boot seconds of their own,
    besides the restart's boot from its release. Inside the topology's boot (0..30, imports
    1..13) they add nothing; running past it (20..40) they add 10 s (negative control)."""
    inside = cl("a", 0, 30, 90, 2, held_imports=[[1, 12]], restart_boots=[[60, 10]],
                held={"decode-0": "released"})
    rep = tr.compute([inside], [(30, 90)], 0, 100)
    assert rep["boot_s"] == 30 + 10
    assert rep["clusters"][0]["held"] == {"decode-0": "released"}
    past = cl("a", 0, 30, 90, 2, held_imports=[[20, 20]], restart_boots=[[60, 10]])
    assert tr.compute([past], [(30, 90)], 0, 100)["boot_s"] == 30 + 10 + 10


def test_boots_beside_the_tests_are_not_waited_on():
    # booted together (the shape of TokenSpeed's e2e-1gpu-pd): `1` boots 0..55 in a
    # thread while the 1p1d topology, ready at 30, runs its tests 30..60; the main thread
    # waited on 1p1d 0..30 and on `1` only 60..60 (it was up by then); the window's decode
    # restarts in the background 70..95 beside the tests 60..100, and the rejoin test waits
    # the last 5 s of it
    one = cl("1", 0, 55, 100, 2, boot_waits=[[60, 0.0]])
    pd = cl("pd", 0, 30, 100, 2, topology="1p1d", boot_waits=[[0, 30]],
            restart_boots=[[70, 25]], )
    pd["boot_waits"].append([90, 5])
    rep = tr.compute([one, pd], [(30, 60), (60, 100)], 0, 102)
    assert rep["boot_s"] == 55 + 25                 # the partition still counts every boot
    assert rep["boot_waited_s"] == 35 and rep["boot_waited_pct"] == pytest.approx(34.3)
    assert tr.headline(rep).startswith("boots 78 % (waited on 34 %), traffic 20 %")


def test_serial_boots_are_all_waited_on():
    # negative control: boots the main thread ran itself are waited on in full, so the
    # headline says nothing more than the boot share
    a = cl("a", 0, 30, 60, 5, boot_waits=[[0, 30]])
    b = cl("b", 65, 20, 90, 5, boot_waits=[[65, 20]])
    rep = tr.compute([a, b], [(30, 60), (85, 90)], 0, 100)
    assert rep["boot_waited_s"] == rep["boot_s"] == 50
    assert "waited" not in tr.headline(rep)
    # a record from before boot_waits existed says nothing of waits (None), not 0
    old = tr.compute([cl("a", 0, 30)], [], 0, 40)
    assert old["boot_waited_s"] is None and "waited" not in tr.headline(old)


def test_failed_start_boots_until_its_teardown_and_overlaps_count_once():
    failed = cl("f", 0, None, 40, 1)
    overlapping = cl("g", 10, 20)                     # overlaps f's boot: counted once
    rep = tr.compute([failed, overlapping], [], 0, 50)
    assert rep["boot_s"] == 40 and rep["teardown_s"] == 1 and rep["idle_s"] == 9
    never = cl("n", None, None)                       # constructed, never started
    assert tr.compute([never], [], 0, 10)["boots"] == 0


def test_compile_cache_counts_and_file(tmp_path):
    a = cl("a", 0, 5, compile_cache={"worker-0": "miss"})
    b = cl("b", 10, 5, compile_cache={"prefill-0": "hit", "decode-0": "hit"})
    rep = tr.compute([a, b], [], 0, 20)
    assert rep["compile_cache"] == {"hit": 2, "miss": 1}
    assert tr.headline(rep).endswith("(2 boots, 10 s; compile cache: 2 hit, 1 miss)")
    data = json.loads(tr.write(rep, tmp_path).read_text())
    assert data["headline"] == tr.headline(rep) and data["clusters"][1]["name"] == "b"


def test_empty_session():
    rep = tr.compute([], [], 5, 5)
    assert rep["share_pct"] == {"boot": 0.0, "traffic": 0.0, "teardown": 0.0, "idle": 0.0}


def test_cluster_entry_reads_timing_roles_and_the_engines_cache_verdict():
    from types import SimpleNamespace as NS

    from e2e_test.infra.cluster.cluster import Timing
    from e2e_test.infra.engines import EngineOptions, vllm

    class Proc:
        def __init__(self, text):
            self.text = text

        def log_text(self):
            return self.text
    t = Timing(workers={"prefill-0": 40.0, "decode-0": 41.0}, total_ready_s=43.0,
               gateway_ready_s=2.0, teardown_s=1.0, boot_started=100.0, teardown_started=200.0)
    workers = [NS(name="prefill-0", entry=NS(role="prefill"),
                  process=Proc("I fx graph cache hit for key f")),
               NS(name="decode-0", entry=NS(role="decode"), process=None)]
    c = NS(name="vllm-1p1d-1", topology=NS(name="1p1d"), timing=t, workers=workers,
           driver=vllm.ENGINE, options=EngineOptions())
    e = tr.cluster_entry(c)
    assert e["profile"] == "compiled" and e["roles"] == {"prefill-0": "prefill",
                                                          "decode-0": "decode"}
    assert e["compile_cache"] == {"prefill-0": "hit", "decode-0": "unknown"}
    rep = tr.compute([e], [], 100.0, 250.0)
    assert rep["boot_s"] == 43.0 and rep["teardown_s"] == 1.0
    assert rep["boot_by_role_s"] == {"prefill": 40.0, "decode": 41.0, "gateway": 2.0}
    c.options = EngineOptions(enforce_eager=True)
    assert tr.cluster_entry(c)["profile"] == "eager"


def test_phase_durations_run_from_the_launch_to_ready():
    seen = {"server imported, starting engine": 24.3, "loading weights": 44.0,
            "allocating KV cache": 48.0, "ready": 51.4}
    assert tr.phase_durations(seen) == [("starting", 24.3),
                                        ("server imported, starting engine", 19.7),
                                        ("loading weights", 4.0),
                                        ("allocating KV cache", 3.4)]
    # no marker at all: the whole boot is `starting`; not ready yet: the last state is open
    assert tr.phase_durations({"ready": 9.0}) == [("starting", 9.0)]
    assert tr.phase_durations({"loading weights": 3.0}) == [("starting", 3.0)]


def test_boot_phases_are_medians_over_ready_boots_and_printed():
    c1 = {"phases": {"worker-0": {"initializing engine": 30.0, "ready": 60.0}}}
    c2 = {"phases": {"prefill-0": {"initializing engine": 20.0, "ready": 50.0},
                     "decode-0": {"initializing engine": 26.0, "ready": 40.0},
                     "decode-0#1": {"initializing engine": 25.0}}}     # never ready: left out
    bp = tr.boot_phases([c1, c2])
    assert bp == {"boots": 3, "median_s": {"starting": 26.0, "initializing engine": 30.0}}
    rep = tr.compute([c1, c2], [], 0.0, 100.0)
    assert rep["boot_phases"] == bp
    assert tr.phases_line(rep) == ("boot phases (median of 3 worker boots): starting 26.0 s, "
                                   "initializing engine 30.0 s")
    assert tr.phases_line(tr.compute([], [], 0.0, 1.0)) is None       # no boots: no line


def test_cluster_entry_carries_each_boots_phases():
    from types import SimpleNamespace as NS

    from e2e_test.infra.cluster.cluster import Timing
    from e2e_test.infra.engines import EngineOptions, vllm
    t = Timing(workers={"worker-0": 60.0}, total_ready_s=61.0,
               phases={"worker-0": {"initializing engine": 30.0, "ready": 60.0}})
    c = NS(name="vllm-1-1", topology=NS(name="1"), timing=t,
           workers=[NS(name="worker-0", entry=NS(role="worker"), process=None)],
           driver=vllm.ENGINE, options=EngineOptions())
    e = tr.cluster_entry(c)
    assert e["phases"] == {"worker-0": {"initializing engine": 30.0, "ready": 60.0}}
    assert tr.compute([e], [], 0.0, 100.0)["clusters"][0]["phases"] == e["phases"]


# The warm child's lines as the launcher prints them (tests/test_warm_spawn.py parses the real
# ones too).
BEFORE = ("e2e_warm_spawn (pid 8140): imports 10.7 s ahead of smg_grpc_servicer.tokenspeed "
          "(6 import statements, 0 failed, collector off)\n"
          "e2e_warm_spawn (pid 8147): imports 9.9 s, 3 calls 0.7 s (0 failed), request 0.2 s "
          "after the imports (1 preloaded, collector off); the parent's environment differs "
          "in: nothing\n")
BESIDE = ("e2e_warm_spawn (pid 9): imports 10.1 s, 3 calls beside the target (running at the "
          "request), request 0.4 s before the imports ended (1 preloaded, collector off); the "
          "parent's environment differs in: nothing\nLoading safetensors\n"
          "e2e_warm_spawn (pid 9): call torch._inductor.codecache:torch_key failed: X: y\n"
          "e2e_warm_spawn (pid 9): 3 calls beside the target: 0.8 s (1 failed), ended 0.8 s "
          "after the request came\n")


def test_warm_spawn_status_reads_the_childs_lines():
    assert tr.warm_spawn_status(BEFORE) == {
        "imports_s": 9.9, "calls": 3, "calls_mode": "before", "calls_s": 0.7,
        "calls_failed": 0, "request_after_imports_s": 0.2, "waited_for_calls_s": 0.5}
    assert tr.warm_spawn_status(BESIDE) == {
        "imports_s": 10.1, "calls": 3, "calls_mode": "beside", "calls_s": 0.8,
        "calls_failed": 1, "request_after_imports_s": -0.4, "waited_for_calls_s": 0.0,
        "beside_ended_after_request_s": 0.8}
    # a request that came while the imports ran waited for all of the calls made before it
    early = BEFORE.replace("request 0.2 s after the imports", "request 1.5 s before the "
                           "imports ended")
    assert tr.warm_spawn_status(early)["waited_for_calls_s"] == 0.7
    nocalls = ("e2e_warm_spawn (pid 3): imports 9.0 s, request 0.6 s after the imports (1 "
               "preloaded, collector off); the parent's environment differs in: nothing")
    assert tr.warm_spawn_status(nocalls)["calls_mode"] is None
    # the negative controls: the servicer's own line, a held interpreter's, no launcher
    assert tr.warm_spawn_status(BEFORE.splitlines()[0]) is None
    assert tr.warm_spawn_status("e2e_warm_spawn (pid 4): held: imports 11.0 s (6 import "
                                "statements of m, 0 failed, collector off); waiting for go") is None
    assert tr.warm_spawn_status("INFO vllm serving") is None


def test_warm_spawn_summary_and_line():
    c1 = {"warm_spawn": {"worker-0": tr.warm_spawn_status(BEFORE)}}
    c2 = {"warm_spawn": {"prefill-0": tr.warm_spawn_status(BEFORE.replace("0.2 s after",
                                                                          "0.6 s after")),
                         "decode-0": tr.warm_spawn_status(BEFORE.replace("0.2 s after",
                                                                         "0.0 s after"))}}
    rep = tr.compute([c1, c2], [], 0.0, 10.0)
    assert rep["warm_spawn"]["children"] == 3
    assert rep["warm_spawn"]["waited_for_calls_s"] == [0.1, 0.5, 0.7]
    assert tr.warm_line(rep) == ("warm spawn (3 children): imports 9.9 s (9.9-9.9), calls "
                                 "before the request, which waited 0.5 s for them (0.1-0.7), "
                                 "0 failed")
    rep = tr.compute([{"warm_spawn": {"w": tr.warm_spawn_status(BESIDE)}}], [], 0.0, 10.0)
    assert tr.warm_line(rep) == ("warm spawn (1 children): imports 10.1 s (10.1-10.1), calls "
                                 "beside the request, beside ended 0.8 s after it (0.8-0.8), "
                                 "1 failed")
    # the negative control: no warm child, no summary and no line
    rep = tr.compute([{"warm_spawn": {}}, {}], [], 0.0, 10.0)
    assert rep["warm_spawn"] is None and tr.warm_line(rep) is None
