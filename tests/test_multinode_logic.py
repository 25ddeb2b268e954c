"""Pure logic of the multi-node launcher and the simulated hosts: node ordering from
`ray.nodes()`, the merged per-node teardown report, the namespace/veth/Ray command builders,
and the messages that name a node. No Ray, no namespace, no process."""

import json

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.lifecycle import simhosts
from e2e_test.infra.lifecycle.ray_launcher import RayHandle, merge_reports, order_nodes
from e2e_test.infra.lifecycle.teardown import TeardownReport
from e2e_test.infra.specs.plan import Node


def info(addr, alive=True, head=False, tag=None, host="m1"):
    res = {"CPU": 1.0, f"node:{addr}": 1.0}
    if head:
        res["node:__internal_head__"] = 1.0
    if tag is not None:
        res[f"e2e_node_{tag}"] = 1.0
    return {"NodeID": f"id-{addr}", "Alive": alive, "NodeManagerAddress": addr,
            "NodeManagerHostname": host, "Resources": res}


def test_nodes_ordered_by_their_e2e_node_resource():
    got = order_nodes([info("10.0.0.9", tag=1), info("10.0.0.5", tag=0, head=True)])
    assert [(n.index, n.address, rid) for n, rid in got] == [
        (0, "10.0.0.5", "id-10.0.0.5"), (1, "10.0.0.9", "id-10.0.0.9")]


def test_untagged_nodes_head_first_then_by_address_dead_ones_left_out():
    got = order_nodes([info("10.0.0.10"), info("10.0.0.9", alive=False), info("10.0.0.2"),
                       info("10.0.0.7", head=True)])
    assert [n.address for n, _ in got] == ["10.0.0.7", "10.0.0.2", "10.0.0.10"]


def test_hostname_is_the_host_id():
    got = order_nodes([info("10.0.0.5", tag=0, host="a"), info("10.0.0.6", tag=1, host="b")])
    assert [n.host_id for n, _ in got] == ["a", "b"]


@pytest.mark.parametrize("nodes, expected", [
    ([], "no alive node"),
    ([info("10.0.0.5", alive=False)], "no alive node"),
    ([info("10.0.0.5", tag=0), info("10.0.0.6", tag=0)], "must be 0..1, each once; found [0, 0]"),
    ([info("10.0.0.5", tag=1), info("10.0.0.6", tag=2)], "found [1, 2]"),
])
def test_bad_node_sets_are_one_line(nodes, expected):
    with pytest.raises(ConfigError) as e:
        order_nodes(nodes)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_merged_report_clean_names_the_nodes():
    rep = merge_reports(TeardownReport(seconds=1.0),
                        {"node 0 (10.77.0.2)": TeardownReport(), "node 1 (10.77.0.3)":
                         TeardownReport(shm_removed=["psm_1"])})
    assert rep.ok
    assert set(rep.nodes) == {"driver", "node 0 (10.77.0.2)", "node 1 (10.77.0.3)"}
    assert rep.shm_removed == ["node 1 (10.77.0.3): psm_1"]
    assert rep.verdict() == "clean in 1.0 s on 2 node(s) and the driver's host"


def test_negative_control_a_dirty_node_fails_the_merged_report_by_name():
    rep = merge_reports(TeardownReport(), {
        "node 0 (10.77.0.2)": TeardownReport(),
        "node 1 (10.77.0.3)": TeardownReport(survivors=["pid 7 vllm"], busy_ports=[21001])})
    assert not rep.ok
    assert rep.survivors == ["node 1 (10.77.0.3): pid 7 vllm"] and rep.busy_ports == [21001]
    v = rep.verdict()
    assert v.startswith("NOT clean: node 1 (10.77.0.3): ") and "pid 7 vllm" in v
    assert "21001" in v and "node 0" not in v
    assert rep.to_dict()["nodes"]["node 1 (10.77.0.3)"]["ok"] is False


def test_negative_control_gpu_leak_on_a_node_is_keyed_by_node():
    rep = merge_reports(TeardownReport(), {"node 1 (h)": TeardownReport(gpu_leaks={0: 900.0})})
    assert rep.gpu_leaks == {"node 1 (h) gpu 0": 900.0} and not rep.ok


class _Lost(Exception):
    pass


def test_lost_node_message_names_node_and_role():
    h = RayHandle("decode-0", ["vllm"], __import__("pathlib").Path("/nonexistent.log"),
                  Node(1, "10.77.0.3"), actor=None, worker_pid=42)
    h.lost = "node 1 (10.77.0.3) lost: its actor did not answer within 5 s"
    h.up = False
    assert not h.alive()
    assert h.death_reason() == h.lost
    assert h.where == ", node 1 (10.77.0.3)"
    assert h.failure_summary().startswith("decode-0 on node 1 (10.77.0.3): node 1 (10.77.0.3) "
                                          "lost")
    rep = h.stop()
    assert rep.survivors == []       # nothing claimed alive; verify() marks the node unverified


def test_negative_control_unverified_node_is_never_clean():
    rep = merge_reports(TeardownReport(), {
        "node 0 (a)": TeardownReport(),
        "node 1 (b)": TeardownReport(unverified=["worker-0 (pid 4): node 1 (b) lost: gone"])})
    assert not rep.ok
    assert rep.unverified == ["node 1 (b): worker-0 (pid 4): node 1 (b) lost: gone"]
    assert rep.verdict() == ("NOT clean: node 1 (b): not verified: worker-0 (pid 4): "
                             "node 1 (b) lost: gone")


def test_negative_control_exited_worker_is_not_called_lost():
    h = RayHandle("decode-0", ["vllm"], __import__("pathlib").Path("/x.log"),
                  Node(1, "10.77.0.3"), actor=None, worker_pid=42, up=False, code=-9)
    assert h.death_reason() == "signal 9"


def test_simulated_host_layout_and_commands():
    bridge, addr, nodes = simhosts.layout(2, "123456789", subnet=77)
    assert (bridge, addr) == ("e2b123456", "10.77.0.1")
    assert [(n.netns, n.address) for n in nodes] == [("e2e-123456-0", "10.77.0.2"),
                                                     ("e2e-123456-1", "10.77.0.3")]
    assert all(len(x) <= 15 for n in nodes for x in (n.veth_host, n.veth_node))
    setup = simhosts.setup_commands(bridge, addr, nodes)
    assert setup[0] == ["ip", "link", "add", bridge, "type", "bridge"]
    assert ["ip", "netns", "exec", "e2e-123456-1", "ip", "addr", "add", "10.77.0.3/24", "dev",
            nodes[1].veth_node] in setup
    down = simhosts.teardown_commands(bridge, nodes)
    assert down == [["ip", "link", "del", nodes[0].veth_host],
                    ["ip", "link", "del", nodes[1].veth_host],
                    ["ip", "netns", "del", "e2e-123456-0"], ["ip", "netns", "del", "e2e-123456-1"],
                    ["ip", "link", "del", bridge]]
    with pytest.raises(Exception, match="1..200 nodes"):
        simhosts.layout(0, "x")


def test_ray_start_commands_bind_node_addresses_dashboard_off():
    _, _, (a, b) = simhosts.layout(2, "t")
    head = simhosts.ray_start_argv("ray", a, a, 1, "/tmp/r")
    assert head[:4] == ["ray", "start", "--node-ip-address", "10.77.0.2"]
    assert "--head" in head and "--include-dashboard=false" in head
    assert head[head.index("--resources") + 1] == '{"e2e_node_0": 1}'
    assert head[head.index("--temp-dir") + 1] == "/tmp/r/n0"
    assert json.loads(head[head.index("--system-config") + 1])["health_check_period_ms"] == 1000
    worker = simhosts.ray_start_argv("ray", b, a, 1, "/tmp/r")
    assert worker[worker.index("--address") + 1] == "10.77.0.2:6379"
    assert "--head" not in worker and worker[worker.index("--temp-dir") + 1] == "/tmp/r/n1"
    assert simhosts.netns_exec("ns", ["ray", "stop"]) == ["ip", "netns", "exec", "ns", "ray",
                                                          "stop"]
