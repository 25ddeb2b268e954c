"""startup.py's device resolution: which GPUs (--devices, E2E_DEVICES, an engine's own list
such as AFD_E2E_DEVICES, CUDA_VISIBLE_DEVICES, NVML) and cores (E2E_CPU_CORES, the affinity
mask) this machine offers the planner, and the xdist share. Moved here from test_plan.py with
the functions (plan.place takes the devices as data)."""

import pytest

from e2e_test.infra.errors import ConfigError
from e2e_test.infra.specs.topology import parse
from e2e_test.infra.startup import child_env, cpu_cores, resolve_devices


def no_inventory():
    raise AssertionError("the inventory must not be consulted")


# -- device list resolution -------------------------------------------------------------------

ALL = {"E2E_DEVICES": "1,2", "AFD_E2E_DEVICES": "3,4", "CUDA_VISIBLE_DEVICES": "5,6"}


def nvml_eight():
    return tuple(range(9))   # a machine whose NVML lists GPUs 0-8: given lists are checked


def nvml_unavailable():
    return ()     # no NVML: a given list cannot be checked, so it is an error (issue 28)


def test_resolve_refuses_a_given_list_without_nvml():
    with pytest.raises(ConfigError, match=r"^--devices='7, 8': GPU id.s. cannot be checked, "
                       "NVML sees no GPU here"):
        resolve_devices(parse("1"), "7, 8", environ={}, inventory=nvml_unavailable)
    with pytest.raises(ConfigError, match=r"^AFD_E2E_DEVICES='3,4': .*NVML sees no GPU"):
        resolve_devices(parse("2a2f"), None, environ={"AFD_E2E_DEVICES": "3,4"},
                        inventory=nvml_unavailable)


def test_resolve_explicit_wins():
    assert resolve_devices(parse("1"), "7, 8", environ=ALL, inventory=nvml_eight) == (7, 8)


def test_resolve_e2e_devices_before_afd():
    assert resolve_devices(parse("2a2f"), None, environ=ALL,
                           inventory=nvml_eight) == (1, 2)


def test_resolve_afd_devices_only_for_afd():
    env = {k: v for k, v in ALL.items() if k != "E2E_DEVICES"}
    assert resolve_devices(parse("2a2f"), None, environ=env, inventory=nvml_eight) == (3, 4)
    assert resolve_devices(parse("native-dp4"), None, environ=env,
                           inventory=nvml_eight) == (3, 4)
    assert resolve_devices(parse("1p1d"), None, environ=env, inventory=no_inventory) == (5, 6)


@pytest.mark.parametrize("explicit,env,source", [
    ("0,99", {}, "--devices"), (None, {"E2E_DEVICES": "99"}, "E2E_DEVICES"),
    (None, {"AFD_E2E_DEVICES": "0,1,2,9"}, "AFD_E2E_DEVICES")])
def test_resolve_refuses_ids_nvml_does_not_list(explicit, env, source):
    """Negative control of the device check: ids beyond what NVML lists are one line."""
    with pytest.raises(ConfigError) as ei:
        resolve_devices(parse("2a2f"), explicit, environ=env, inventory=lambda: (0, 1, 2, 3))
    msg = str(ei.value)
    assert msg.startswith(f"{source}=") and "not present" in msg and "0-3" in msg, msg


def test_resolve_cuda_visible_devices_then_inventory():
    assert resolve_devices(parse("1"), None, environ={"CUDA_VISIBLE_DEVICES": "2"},
                           inventory=no_inventory) == (2,)
    assert resolve_devices(parse("1"), None, environ={}, inventory=lambda: (0, 1, 2)) == (0, 1, 2)
    assert resolve_devices(parse("1"), "", environ={"E2E_DEVICES": ""},
                           inventory=list) == ()


def test_resolve_reports_the_source():
    with pytest.raises(ConfigError, match=r"^E2E_DEVICES='0,0': duplicate"):
        resolve_devices(parse("1"), None, environ={"E2E_DEVICES": "0,0"})
    with pytest.raises(ConfigError, match=r"^AFD_E2E_DEVICES='a': device ids must be integers"):
        resolve_devices(parse("1a1f"), None, environ={"AFD_E2E_DEVICES": "a"})
    with pytest.raises(ConfigError, match=r"^--devices='x': device ids must be integers"):
        resolve_devices(parse("1"), "x", environ={})


def test_a_process_started_by_an_xdist_worker_takes_the_worker_s_devices(fake_gpus, monkeypatch):
    """A driver script or a pytest started inside a test is not a pytest-xdist worker: it gets
    what the worker holds as its whole list, and keeps the worker id (its port slice)."""
    from e2e_test.infra.specs import devices
    sliced = {"E2E_DEVICES": "0,1,2,3", "PYTEST_XDIST_WORKER_COUNT": "2",
              "PYTEST_XDIST_WORKER": "gw1"}
    child = child_env(parse("1"), "cuda", sliced)
    assert child["E2E_DEVICES"] == "1,3" and child["PYTEST_XDIST_WORKER"] == "gw1"
    assert "PYTEST_XDIST_WORKER_COUNT" not in child
    assert resolve_devices(parse("1"), environ=child) == (1, 3)
    # negative control: the worker's environment inherited as it is slices its slice again
    assert resolve_devices(parse("1"), environ={**sliced, "E2E_DEVICES": "1,3"}) == (3,)
    # a worker of `-n auto --dist loadgroup` shares the one GPU by memory with seven others
    one = {"E2E_DEVICES": "0", "PYTEST_XDIST_WORKER_COUNT": "8", "PYTEST_XDIST_WORKER": "gw3"}
    monkeypatch.setattr(devices, "_SHARED", True)
    child = child_env(parse("1"), "cuda", one)
    monkeypatch.setattr(devices, "_SHARED", False)      # the child process's own view
    assert resolve_devices(parse("1"), environ=child) == (0,)
    with pytest.raises(ConfigError, match="worker gw3 of 8 gets none of the 1 device"):
        resolve_devices(parse("1"), environ=one)        # what the inherited environment gave
    cores = child_env(parse("1"), "cpu", {"E2E_CPU_CORES": "0,1", **sliced})
    assert cores["E2E_CPU_CORES"] == "1" and cpu_cores(cores) == (1,)
    assert child_env(parse("1"), "cuda", {"E2E_DEVICES": "0"}) == {"E2E_DEVICES": "0"}


def test_resolve_devices_under_xdist(fake_gpus):
    env = {"E2E_DEVICES": "0,1,2,3", "PYTEST_XDIST_WORKER_COUNT": "2",
           "PYTEST_XDIST_WORKER": "gw1"}
    assert resolve_devices(parse("1p1d"), environ=env) == (1, 3)
    assert cpu_cores({"E2E_CPU_CORES": "0,1", **env}) == (1,)
