"""The pin's verdict (reach.pin_problems): a pin that reaches only its worker passes; one that
leaks, one whose worker did nothing, and a measurement that cannot see a second worker fail."""

from e2e_test.infra.cluster.reach import pin_problems

BOTH = {"worker-0": 12.0, "worker-1": 12.0}


def test_a_pin_that_reaches_its_worker_alone_passes():
    assert pin_problems("worker-0", {"worker-0": 24.0, "worker-1": 0.0}, BOTH) == []


def test_a_pin_that_leaks_fails():
    [p] = pin_problems("worker-0", BOTH, BOTH)
    assert p == "pinned to worker-0: other workers worked too ({'worker-1': 12.0})"


def test_a_pin_whose_worker_did_nothing_fails():
    [p] = pin_problems("worker-0", {"worker-0": 0.0, "worker-1": 0.0}, BOTH)
    assert p.startswith("pinned to worker-0: it did no work")


def test_a_measurement_that_sees_one_worker_only_fails():
    """A gateway that sent everything to worker 0 unpinned too: the pin's own numbers would
    look right, but nothing shows they could have looked wrong."""
    [p] = pin_problems("worker-0", {"worker-0": 24.0, "worker-1": 0.0},
                       {"worker-0": 24.0, "worker-1": 0.0})
    assert p.startswith("unpinned: not every worker worked")
    [one] = pin_problems("worker-0", {"worker-0": 24.0}, {"worker-0": 24.0})
    assert one.startswith("unpinned: not every worker worked")
