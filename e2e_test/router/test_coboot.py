"""Booting a lane's topologies together, on real engines (infra/specs/coboot.py, the pytest plugin's
ClusterPool): a nested pytest session told to boot `1` and `dp2` together
(E2E_BOOT_SCHEDULE=together) serves a chat on each, records the decision and its reason in its
time report, boots them overlapping, and tears each down clean: each topology's own
processes first, the devices and /dev/shm once the wave's last has stopped. dp2's workers are
judged against `1`'s control arm (n=2), measured once right after `1` booted.

On the CPU lane the plugin decides serial by itself (the cores are shared); this test forces
the machinery that a GPU runner uses by choice, at the cost of two overlapping boots on the
runner's cores (the nested session boots with --enforce-eager)."""

import json
import os
import subprocess
import sys

import pytest

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
    env = {**os.environ, "E2E_BOOT_SCHEDULE": "together", "E2E_TOPOLOGIES": "1,dp2",
           "E2E_ENGINES": engine_name, "E2E_BACKEND": e2e_backend, "E2E_ENFORCE_EAGER": "1",
           "E2E_RESULTS_DIR": str(res), "PYTHONPATH": extend_pythonpath(ROOT),
           "E2E_GSM8K_N": "2", "E2E_MMLU_N": "2"}
    r = subprocess.run([sys.executable, "-m", "pytest", "e2e_test/router/test_chat.py",
                        "e2e_test/router/test_evals.py", "e2e_test/router/test_oracle.py", "-v",
                        "-p", "no:cacheprovider", "-k", "(non_streaming or test_eval or "
                        "control_arm or negative_control or dp_workers_agree) and not recall"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
                       check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    timing = json.loads((res / "timing.json").read_text())
    sched = timing.get("boot_schedule")
    record["coboot"] = {"schedule": sched, "wall_s": timing["wall_s"],
                        "boot_s": timing["boot_s"], "clusters": timing["clusters"]}
    assert sched and sched["mode"] == "together", sched
    assert sched["waves"] == [[f"{engine_name}/1", f"{engine_name}/dp2"]], sched
    assert "; booted together" in out and "boot schedule: E2E_BOOT_SCHEDULE=together" in out, \
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
    for topo, c in clusters.items():
        assert c["teardown"] and c["teardown"]["ok"], (topo, c["teardown"])
