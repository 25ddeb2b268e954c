"""A FAKE engine for Cluster unit tests: the stdlib HTTP server of fake_engine_server.py behind
the real smg gateway. It shows what adding an engine takes (one Engine subclass + one
registration) and lets the Cluster's paths run with real, small processes. Never a stand-in
for a real engine in an end-to-end test."""

from __future__ import annotations

import sys
from pathlib import Path

from e2e_test.infra import engines
from e2e_test.infra.engines import Engine
from e2e_test.infra.lifecycle.launcher import WorkerCommand
from e2e_test.infra.lifecycle.readiness import HttpGet
from e2e_test.infra.lifecycle.reaper import extend_pythonpath
from e2e_test.infra.specs.model_specs import parse_spec

SERVER = Path(__file__).with_name("fake_engine_server.py")
NAME = "fake"


class FakeEngine(Engine):
    name = NAME
    kinds = ("regular", "dp")
    work_counters = ("fake:tokens_total",)

    def __init__(self, env: dict | None = None, stages: dict | None = None,
                 stop_grace_s: float | None = None, module: bool = False):
        self.env = env or {}            # worker name -> extra env (the server's failure modes)
        self.stages = stages or {}      # worker name -> start stage
        self.stop_grace_s = stop_grace_s    # the worker's own SIGTERM -> SIGKILL grace
        self.module = module            # run as `python -m fake_engine_server` (holdable)

    def build(self, spec, topology, entry, ports, model_path, options):
        env = dict(self.env.get(entry.name, {}))
        if self.module:
            head = [sys.executable, "-m", SERVER.stem]
            env["PYTHONPATH"] = extend_pythonpath(str(SERVER.parent))
        else:
            head = [sys.executable, str(SERVER)]
        return WorkerCommand(
            argv=[*head, "--port", str(ports.api), "--model", spec.id],
            env=env, readiness=HttpGet(ports.api, "/health"),
            start_stage=self.stages.get(entry.name, 0), stop_grace_s=self.stop_grace_s)


def fake_spec(weights_dir: Path, startup_timeout_s: float = 30.0):
    """A registry entry for the fake engine (register the engine first)."""
    return parse_spec("fake-model", {"weights": {"source": "path", "path": str(weights_dir)},
                                     "engines": [NAME], "topologies": ["regular", "dp"],
                                     "startup_timeout_s": startup_timeout_s})


def register(**kw) -> FakeEngine:
    return engines.register(FakeEngine(**kw))
