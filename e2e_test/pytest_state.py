"""What the pytest plugin keeps for a session, in `config.stash` (one key), and the per-test
flags it keeps in `item.stash`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest


@dataclass
class SessionState:
    t0: float = field(default_factory=time.monotonic)
    t0_epoch: float = field(default_factory=time.time)
    calls: list = field(default_factory=list)              # (start, stop) of each test body
    time_report: dict | None = None                        # time_report.compute's answer
    records: list = field(default_factory=list)            # one dict per test (results.py)
    clusters: dict = field(default_factory=dict)           # name -> Cluster started here
    teardown_violations: list = field(default_factory=list)
    summary: dict | None = None                            # results.write_session's answer
    topologies: list | None = None                         # --topology, parsed once
    plans: dict = field(default_factory=dict)              # placement key -> Plan | skip line | None
    deselected: dict = field(default_factory=dict)         # reason -> [items]
    collect_skips: list = field(default_factory=list)      # "nodeid: reason"
    min_tests_line: str | None = None                      # --e2e-min-tests: too few ran
    pool: object | None = None                             # pytest_plugin.ClusterPool
    baselines: object | None = None                        # pytest_baseline.Baselines
    assignment: object | None = None                       # coboot.Assignment (-n auto)
    worker_parts: list = field(default_factory=list)       # pytest-xdist workers' results
    devices_before: object | None = None                   # launcher.Baseline (controller)
    devices_report: object | None = None                   # teardown.TeardownReport (ditto)


STATE = pytest.StashKey[SessionState]()
OUTCOME = pytest.StashKey[str]()      # an item's outcome (setup failure or call)
RECORDED = pytest.StashKey[bool]()    # the item's `record` fixture ran
RECORD = pytest.StashKey[dict]()      # the item's record (a teardown failure marks it)
DESELECT_WHY = pytest.StashKey[str]()  # why the harness deselected an item at collection


def state(config) -> SessionState:
    """The session's state, created on first use."""
    if STATE not in config.stash:
        config.stash[STATE] = SessionState()
    return config.stash[STATE]
