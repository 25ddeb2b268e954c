"""Booting a lane's topologies together, on real engines (infra/specs/coboot.py, the pytest plugin's
ClusterPool): a nested pytest session told to boot `1` and `dp2` together
(--e2e-boot-schedule together) serves a chat on each, records the decision and its reason in its
time report, boots them overlapping, and tears each down clean: each topology's own
processes first, the devices and /dev/shm once the wave's last has stopped. `1`'s passes
(scored evals, control arms, negative control; n=2) run ahead in a thread while dp2's tests
run, `1`'s tests then judge what the thread measured, and dp2's workers are judged against
that control arm after them (docs/lanes.md, "Passes ahead").

On the CPU lane the plugin decides serial by itself (the cores are shared); this test forces
the machinery that a GPU runner uses by choice, at the cost of two overlapping boots on the
runner's cores (the nested session boots with --enforce-eager)."""

import json
import os
import subprocess
import sys

import pytest

from e2e_test.infra.cluster.diagnostics import nested_failure
from e2e_test.infra.lifecycle.process import extend_pythonpath

pytestmark = [pytest.mark.e2e, pytest.mark.engines("vllm"), pytest.mark.backends("cpu")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _overlap(a: dict, b: dict) -> float:
    """Seconds two clusters' boots overlapped (their Cluster.timing in summary.json)."""
    def span(t):
        return t["boot_started"], t["boot_started"] + t["total_ready_s"]
    (s1, e1), (s2, e2) = span(a), span(b)
    return max(0.0, min(e1, e2) - max(s1, s2))


def test_topologies_booted_together_serve_and_tear_down_apart(engine_name, e2e_backend,
                                                              tmp_path, record):
    res = tmp_path / "results"
    env = {**os.environ, "E2E_TOPOLOGIES": "1,dp2",
           "E2E_ENGINES": engine_name, "E2E_BACKEND": e2e_backend, "E2E_ENFORCE_EAGER": "1",
           "E2E_RESULTS_DIR": str(res), "PYTHONPATH": extend_pythonpath(ROOT),
           "E2E_GSM8K_N": "2", "E2E_MMLU_N": "2"}
    r = subprocess.run([sys.executable, "-m", "pytest", "e2e_test/router/test_chat.py",
                        "e2e_test/router/test_evals.py", "e2e_test/router/test_oracle.py", "-v",
                        "--e2e-boot-schedule", "together",
                        "-p", "no:cacheprovider", "-k", "(non_streaming or test_eval or "
                        "control_arm or negative_control or dp_workers_agree) and not recall"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
                       check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, nested_failure(out, res, r.returncode)
    timing = json.loads((res / "timing.json").read_text())
    sched = timing.get("boot_schedule")
    record["coboot"] = {"schedule": sched, "wall_s": timing["wall_s"],
                        "boot_s": timing["boot_s"], "clusters": timing["clusters"]}
    assert sched and sched["mode"] == "together", sched
    assert sched["waves"] == [[f"{engine_name}/1", f"{engine_name}/dp2"]], sched
    assert "; booted together" in out and "boot schedule: --e2e-boot-schedule=together" in out, \
        out[-2000:]
    summary = json.loads((res / "summary.json").read_text())
    names = {c["name"]: c["topology"] for c in timing["clusters"]}
    clusters = {names[n]: c for n, c in summary["clusters"].items()}
    assert set(clusters) == {"1", "dp2"}, clusters
    overlap = _overlap(clusters["1"]["timing"], clusters["dp2"]["timing"])
    record["coboot"]["boot_overlap_s"] = round(overlap, 1)
    print(f"booted together: overlap {overlap:.1f} s; {sched['reason']}")
    assert overlap > 0, clusters
    outcomes = {f.stem: json.loads(f.read_text())["outcome"] for f in (res / "tests").glob("*.json")}
    assert len(outcomes) == 11 and set(outcomes.values()) == {"passed"}, outcomes
    # The passes of `1` ran ahead, in the thread, and were what `1`'s tests judged. (How much
    # of them overlapped dp2's tests is recorded, not asserted: on 2 cores dp2 may be done
    # with its own tests before `1` is even ready.)
    ahead = timing.get("ahead") or {}
    record["coboot"]["ahead"] = ahead
    assert sched.get("ahead") == {f"{engine_name}/1": 5}, sched
    assert ahead.get(f"{engine_name}/1", {}).get("s", 0) > 0, ahead
    recs = [json.loads(f.read_text()) for f in (res / "tests").glob("*.json")]
    from_ahead = {r["test"].split("::")[-1]: r.get("traffic_ahead") for r in recs
                  if "traffic_ahead" in r}
    assert from_ahead == {
        f"test_eval[{engine_name}-1-gsm8k]": True, f"test_eval[{engine_name}-1-mmlu]": True,
        f"test_control_arm[{engine_name}-1-gsm8k]": True,
        f"test_control_arm[{engine_name}-1-mmlu]": True,
        f"test_oracle_negative_control[{engine_name}-1]": True,
        f"test_eval[{engine_name}-dp2-gsm8k]": False,       # dp2's own: run in its test
        f"test_eval[{engine_name}-dp2-mmlu]": False}, from_ahead
    ran = [ln.split(" ")[0].split("::")[-1] for ln in out.splitlines()
           if ("PASSED" in ln or "FAILED" in ln or "ERROR" in ln) and "::" in ln]
    first_one = min(i for i, t in enumerate(ran) if f"[{engine_name}-1-" in t or
                    t.endswith(f"[{engine_name}-1]"))
    assert all(f"{engine_name}-dp2" in t for t in ran[:first_one]) and first_one >= 2, ran
    # dp2's tests judged against `1` (needs_baseline) come last of dp2's, still before `1`'s
    # own: their traffic on dp2 overlaps `1`'s passes ahead, then they wait for the baseline
    assert ran[first_one - 2:first_one] == [f"test_dp_workers_agree[{engine_name}-dp2-gsm8k]",
                                            f"test_dp_workers_agree[{engine_name}-dp2-mmlu]"], ran
    for topo, c in clusters.items():
        assert c["teardown"] and c["teardown"]["ok"], (topo, c["teardown"])
