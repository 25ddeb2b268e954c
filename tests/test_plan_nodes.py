"""Multi-node placement (plan.node_of_workers / make_plan with nodes): pinning with
`ROLE.node=K`, spreading, per-node addresses, per-host device and core planning. Pure."""

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs.model_specs import get_spec
from e2e_test.infra.specs.plan import LOCAL_NODES, Node, make_plan, node_of_workers
from e2e_test.infra.specs.topology import parse

SMALL = get_spec("SmolLM2-135M-Instruct")
SIM = (Node(0, "10.77.0.2", host_id="m1"), Node(1, "10.77.0.3", host_id="m1"))   # one machine
REAL = (Node(0, "10.0.0.5", host_id="a"), Node(1, "10.0.0.6", host_id="b"))      # two machines


def by_name(plan):
    return {e.name: e for e in plan.entries}


def test_pinning_puts_each_role_on_its_node():
    p = by_name(make_plan(parse("1p1d,p.node=0,d.node=1"), SMALL, "cpu", cores=(0, 1),
                          nodes=SIM))
    assert (p["prefill-0"].node, p["prefill-0"].host) == (0, "10.77.0.2")
    assert (p["decode-0"].node, p["decode-0"].host) == (1, "10.77.0.3")


def test_pinning_reversed_and_both_on_one_node():
    p = by_name(make_plan(parse("1p1d,p.node=1,d.node=0"), SMALL, "cpu", cores=(0, 1),
                          nodes=SIM))
    assert (p["prefill-0"].host, p["decode-0"].host) == ("10.77.0.3", "10.77.0.2")
    p = by_name(make_plan(parse("1p1d,node=1"), SMALL, "cpu", cores=(0, 1), nodes=SIM))
    assert {e.node for e in p.values()} == {1}


def test_unpinned_workers_spread_round_robin():
    where = node_of_workers(parse("2p2d"), SIM)
    assert where == {("prefill", 0): 0, ("prefill", 1): 1, ("decode", 0): 0, ("decode", 1): 1}
    # pinned roles do not take a turn of the spread
    where = node_of_workers(parse("2p1d,d.node=1"), SIM)
    assert where == {("prefill", 0): 0, ("prefill", 1): 1, ("decode", 0): 1}


def test_pin_past_the_last_node_is_one_line():
    with pytest.raises(ConfigError) as e:
        make_plan(parse("1p1d,d.node=2"), SMALL, "cpu", cores=(0, 1), nodes=SIM)
    assert str(e.value) == ("topology '1p1d,d.node=2': decode pinned to node 2, but the "
                            "launcher has 2 node(s) (node 0 (10.77.0.2), node 1 (10.77.0.3))")
    with pytest.raises(ConfigError, match="launcher has 1 node"):   # the local launcher
        make_plan(parse("1p1d,d.node=1"), SMALL, "cpu", cores=(0, 1), nodes=LOCAL_NODES)


def test_local_plan_is_unchanged_by_nodes():
    a = make_plan(parse("1p1d"), SMALL, "cpu", cores=(0, 1))
    assert all((e.node, e.host) == (0, "127.0.0.1") for e in a.entries)
    assert not a.multinode
    assert [e.cores for e in a.entries] == [(0,), (1,)]


def test_nodes_on_one_machine_split_its_cores():
    p = by_name(make_plan(parse("1p1d,p.node=0,d.node=1"), SMALL, "cpu", cores=(0, 1),
                          nodes=SIM))
    assert (p["prefill-0"].cores, p["decode-0"].cores) == ((0,), (1,))


def test_nodes_on_two_machines_plan_their_own_devices():
    p = by_name(make_plan(parse("1p1d,p.node=0,d.node=1"), SMALL, "cuda", devices=(0,),
                          nodes=REAL))
    # one GPU per machine: each worker gets GPU 0 of its own machine, not GPU 1
    assert (p["prefill-0"].gpus, p["decode-0"].gpus) == ((0,), (0,))
    assert p["decode-0"].host == "10.0.0.6"
    cpu = by_name(make_plan(parse("1p1d,p.node=0,d.node=1"), SMALL, "cpu", cores=(0, 1),
                            nodes=REAL))
    assert (cpu["prefill-0"].cores, cpu["decode-0"].cores) == ((0, 1), (0, 1))


def test_negative_control_one_machine_cannot_hold_what_two_could():
    # The same pinned topology on ONE machine with one GPU does not fit unpacked: the per-host
    # planning above is what made it fit.
    plan = make_plan(parse("1p1d,p.node=0,d.node=1"), SMALL, "cuda", devices=(0,), nodes=SIM)
    assert plan.packed and [e.gpus for e in plan.entries] == [(0,), (0,)]


def test_describe_names_nodes_only_when_multinode():
    multi = make_plan(parse("1p1d,p.node=0,d.node=1"), SMALL, "cpu", cores=(0, 1), nodes=SIM)
    assert "node 1 10.77.0.3" in multi.describe()
    assert "node" not in make_plan(parse("1p1d"), SMALL, "cpu", cores=(0, 1)).describe()
