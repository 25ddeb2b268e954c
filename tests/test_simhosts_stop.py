"""SimulatedHosts.stop_ray's order on stand-in processes (no Ray, no namespace): a raylet (or
the autoscaler's monitor) stopped with or after its head's GCS keeps reconnecting until it is
killed (Ray's, seen in the multi-node test's removal: 11.5-11.9 s against a grace of 10), so
the raylets go first and the GCS last. The stand-in "raylet" exits on SIGTERM only while the
stand-in "gcs_server" is up (its file there); the "gcs_server" exits on SIGTERM at once."""

import subprocess
import sys
import time

from e2e_test.infra.lifecycle import simhosts

GCS = """import os, signal, sys, time
alive = sys.argv[1]
open(alive, "w").close()
def term(*_):
    os.unlink(alive)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    time.sleep(0.05)
"""
RAYLET = """import os, signal, sys, time
alive = sys.argv[1]
def term(*_):
    time.sleep(0.3)          # the GCS, stopped with it, is gone by then
    if os.path.exists(alive):
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    time.sleep(0.05)
"""


def _cluster(tmp_path):
    hosts = simhosts.SimulatedHosts(2, tag="stop")
    hosts.temp_dir = str(tmp_path)           # how ray_processes finds them
    alive = tmp_path / "gcs-up"
    raylet, gcs = tmp_path / "raylet", tmp_path / "gcs_server"
    raylet.symlink_to(sys.executable)
    gcs.symlink_to(sys.executable)
    procs = [subprocess.Popen([str(gcs), "-c", GCS, str(alive)]),
             subprocess.Popen([str(raylet), "-c", RAYLET, str(alive)])]
    deadline = time.monotonic() + 10
    while not alive.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)                          # both handlers set
    return hosts, procs


def _stop(hosts, procs, grace):
    t0 = time.monotonic()
    survivors = hosts.stop_ray(grace=grace)
    took = time.monotonic() - t0
    assert all(p.poll() is not None or p.wait(5) is not None for p in procs)
    return survivors, took


def test_the_raylets_stop_first_the_gcs_last_and_nothing_waits_out_the_grace(tmp_path):
    hosts, procs = _cluster(tmp_path)
    survivors, took = _stop(hosts, procs, grace=3.0)
    assert not survivors and took < 2.0, (survivors, took)


def test_negative_control_all_at_once_the_raylet_waits_out_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(simhosts, "_stop_step", lambda p: 1)
    hosts, procs = _cluster(tmp_path)
    survivors, took = _stop(hosts, procs, grace=3.0)
    assert not survivors and took >= 3.0, (survivors, took)     # the raylet: killed
