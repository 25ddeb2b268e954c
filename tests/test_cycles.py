"""`python -m e2e_test cycles`'s verdict (load/cycles.run_cycles) on stand-in clusters (pure
logic: no process starts; the real cycles run through the CLI): a cycle whose own teardown
was not clean fails the run, where it counted only processes, ports and /dev/shm."""

import types

from e2e_test.infra.lifecycle import teardown
from e2e_test.infra.load import cycles


class StandInCluster:
    def __init__(self, report):
        self.teardown_report = report
        self.gateway, self.workers, self.allocated_ports = None, [], set()
        self.timing = types.SimpleNamespace(topology_ready_s=1.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def chat(self, text, max_tokens=2):
        return {"choices": [{"message": {"content": "OK"}}]}


def test_a_cycle_that_left_gpu_memory_fails_the_run(monkeypatch):
    monkeypatch.setattr(teardown, "listening_ports", lambda ports: [])
    monkeypatch.setattr(teardown, "shm_snapshot", lambda: set())
    reports = iter([teardown.TeardownReport(seconds=1.0),
                    teardown.TeardownReport(seconds=1.0, gpu_leaks={0: 900.0})])
    out = cycles.run_cycles(lambda: StandInCluster(next(reports)), 2, log=lambda s: None)
    assert out["totals"] == {"processes_left": 0, "ports_listening": 0, "new_shm": 0,
                             "teardowns_not_clean": 1}
    assert not out["ok"] and out["rows"][1]["teardown"].startswith("NOT clean: GPU memory")
    clean = cycles.run_cycles(lambda: StandInCluster(teardown.TeardownReport()), 2,
                              log=lambda s: None)
    assert clean["ok"] and clean["totals"]["teardowns_not_clean"] == 0
