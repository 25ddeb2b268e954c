"""The Ray launcher on a real two-node Ray cluster of simulated hosts (network namespaces),
with a plain HTTP server as the worker (no engine): the actor starts it on its node bound to
the node's address, reports it alive, serves its log and stops it; the node's own teardown
check sees its port (the driver's namespace cannot), and a server left running is named by
node (the negative control). Skipped without root or Ray (E2E_REQUIRE_MULTINODE=1: fails)."""

import os
import sys
from pathlib import Path

import httpx
import pytest

from e2e_test.infra.lifecycle import simhosts
from e2e_test.infra.lifecycle.launcher import WorkerCommand
from e2e_test.infra.lifecycle.process import extend_pythonpath
from e2e_test.infra.specs.plan import PlanEntry
from e2e_test.pytest_lanes import require_multinode

pytestmark = [pytest.mark.multinode]
ROOT = str(Path(__file__).resolve().parents[1])


def test_role_actor_on_node_b_and_per_node_teardown(tmp_path):
    require_multinode()
    import ray

    from e2e_test.infra.lifecycle.ray_launcher import RayLauncher
    hosts = simhosts.SimulatedHosts(2, tag=f"u{os.getpid() % 10000}")
    with hosts:
        hosts.start_ray(env={"PYTHONPATH": extend_pythonpath(ROOT)})
        try:
            launcher = RayLauncher(hosts.ray_client_address)
            nodes = launcher.nodes()
            assert [n.address for n in nodes] == [x.address for x in hosts.nodes]
            b = nodes[1]
            entry = PlanEntry("decode-0", "decode", 0, 1, 1, node=1, host=b.address)
            base = launcher.baseline(())

            def serve(name):
                port = launcher.allocate_ports(entry, 1)[0]
                cmd = WorkerCommand([sys.executable, "-m", "http.server", "--bind", b.address,
                                     str(port)], {})
                return port, launcher.start(name, cmd, tmp_path / f"{name}.log", node=1)

            port, h = serve("decode-0")
            for _ in range(50):
                try:
                    if httpx.get(f"http://{b.address}:{port}/", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            assert h.alive() and h.where == f", node 1 ({b.address})"
            assert f"Serving HTTP on {b.address} port {port}" in h.log_text()
            rep = h.stop(5)
            assert not rep.survivors and not h.alive()
            clean = launcher.verify([rep], {port}, base)
            assert clean.ok, clean.verdict()
            assert set(clean.nodes) == {"driver", nodes[0].label, b.label}

            # Negative control: a server still listening on node B fails the report, by node.
            launcher2 = RayLauncher(hosts.ray_client_address)
            launcher2.nodes()
            launcher, base = launcher2, launcher2.baseline(())
            port2, h2 = serve("left-running")
            for _ in range(50):
                try:
                    httpx.get(f"http://{b.address}:{port2}/", timeout=1)
                    break
                except httpx.HTTPError:
                    pass
            dirty = launcher2.verify([], {port2}, base)
            assert not dirty.ok
            assert dirty.verdict() == (f"NOT clean: {b.label}: ports still listening: "
                                       f"[{port2}]"), dirty.verdict()
        finally:
            ray.shutdown()
    assert not hosts.leftovers() and not hosts.survivors
