"""A third engine defined only here (one class, engines.register(), nothing edited elsewhere):
the registry, the planner (plan.place, the one placement check), its argv, the settings table,
the `settings` and `lanes` commands' output and the lane validation all take it."""

import sys

import pytest
import yaml

from e2e_test import __main__ as cli
from e2e_test import lanes
from e2e_test.infra import engines
from e2e_test.infra.engines import Engine, Ports
from e2e_test.infra.lifecycle.launcher import WorkerCommand
from e2e_test.infra.lifecycle.readiness import HttpGet
from e2e_test.infra.specs import model_specs, plan, settings
from e2e_test.infra.specs.devices import core_list
from e2e_test.infra.specs.model_specs import parse_spec
from e2e_test.infra.specs.topology import parse


class ToyEngine(Engine):
    name = "toy"
    kinds = ("regular", "dp")
    backends = ("cpu",)

    def build(self, spec, topology, entry, ports, model_path, options):
        return WorkerCommand(argv=[sys.executable, "-m", "toy.serve", "--port", str(ports.api),
                                   "--model", model_path, "--cores",
                                   core_list(entry.cores)],
                             env={}, readiness=HttpGet(ports.api, "/health"))


@pytest.fixture
def toy():
    e = engines.register(ToyEngine())
    yield e
    engines.unregister("toy")


def test_toy_engine_plans_and_builds(toy, tmp_path):
    spec = parse_spec("toy-model", {"weights": {"source": "path", "path": str(tmp_path)},
                                    "engines": ["toy"], "topologies": ["regular", "dp"]})
    topo = parse("dp2")
    assert engines.for_topology("toy", topo) is toy
    p = plan.make_plan(topo, spec, "cpu", cores=(0, 1, 2, 3))
    cmds = [toy.build(spec, topo, e, Ports(8000 + i), str(tmp_path), engines.EngineOptions())
            for i, e in enumerate(p.entries)]
    assert [c.argv[3:6] for c in cmds] == [["--port", "8000", "--model"],
                                           ["--port", "8001", "--model"]]
    assert [c.argv[-1] for c in cmds] == ["0-1", "2-3"]


def test_toy_engine_in_settings(toy):
    assert "toy" in engines.engine_names()
    assert settings.get("E2E_ENGINES", {"E2E_ENGINES": "toy"}) == ("toy",)
    assert "toy" in settings.shown(settings.SETTINGS["E2E_ENGINES"].default)
    assert "toy" in settings.table()          # the `settings` output and docs/settings.md


def test_toy_engine_in_lane_validation(toy, monkeypatch, tmp_path):
    """A lane may name it once a venv holds it (lanes.VENVS: path, pyproject extra, engines)
    and the lane's model lists it in its registry entry (model_specs.yaml `engines`)."""
    raw = {"description": "toy", "runner": {"gpus": 0, "runs_on": ["ubuntu-latest"]},
           "engines": ["toy"], "topologies": ["1"], "pytest": {"paths": ["tests"],
                                                                "markers": "not e2e"},
           "timeout_minutes": 5, "min_tests": 1, "trigger": ["push"],
           "venvs": {"toy": ".venv"}, "passed_once": True, "opt_in": False}
    with pytest.raises(lanes.ConfigError, match=r"\.venv holds vllm, not toy"):
        lanes.parse_lane("e2e-toy", raw)
    monkeypatch.setitem(lanes.VENVS, ".venv-toy", lanes.Venv(".venv-toy", "cpu", ("toy",)))
    with pytest.raises(lanes.ConfigError, match="cannot run toy on '1'"):
        lanes.parse_lane("e2e-toy", {**raw, "venvs": {"toy": ".venv-toy"}})
    spec = parse_spec("toy-model", {"weights": {"source": "path", "path": str(tmp_path)},
                                    "engines": ["toy"], "topologies": ["regular"]})
    monkeypatch.setattr(model_specs, "get_spec", lambda name, registry=None: spec)
    lane = lanes.parse_lane("e2e-toy", {**raw, "venvs": {"toy": ".venv-toy"}})
    assert lane.engines == ("toy",) and lane.venvs == {"toy": ".venv-toy"}


def test_toy_engine_is_placed_and_builds_its_command(toy, tmp_path):
    """plan.place (as the Cluster and the plugin call it) and worker_command (what the Cluster
    launches): nothing outside this file names the engine."""
    spec = parse_spec("toy-model", {"weights": {"source": "path", "path": str(tmp_path)},
                                    "engines": ["toy"], "topologies": ["regular", "dp"]})
    topo = parse("dp2")
    driver = engines.for_topology("toy", topo)
    p = plan.place(topo, spec, "cpu", (0, 1, 2, 3), driver)
    assert [(e.name, e.cores) for e in p.entries] == [("worker-0", (0, 1)), ("worker-1", (2, 3))]
    cmds = [driver.worker_command(spec, topo, e, Ports(9000 + i), str(tmp_path),
                                  engines.EngineOptions(), tmp_path)
            for i, e in enumerate(p.entries)]
    assert cmds[1].argv[1:] == ["-m", "toy.serve", "--port", "9001", "--model", str(tmp_path),
                                "--cores", "2-3"]
    assert cmds[0].health_path == "/health"


def test_toy_engine_in_the_settings_command(toy, capsys, monkeypatch):
    # the runner's own selection (the CPU lane sets E2E_TOPOLOGIES=1,dp2,1p1d and a model the
    # toy does not run) is not this test's: the command's defaults are
    for var in ("E2E_ENGINES", "E2E_TOPOLOGIES", "E2E_MODEL"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["settings"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("E2E_ENGINES "))
    assert "toy" in line.split()[1].split(","), line          # the default: every engine
    monkeypatch.setenv("E2E_ENGINES", "toy")
    assert cli.main(["settings"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("E2E_ENGINES "))
    assert line.split()[1] == "toy", line


def test_toy_engine_in_the_lanes_command(toy, capsys, monkeypatch, tmp_path):
    """A lanes table (here a file of this test's own) with a lane of the toy engine: the
    `lanes` command lists it with its engine."""
    spec = parse_spec("toy-model", {"weights": {"source": "path", "path": str(tmp_path)},
                                    "engines": ["toy"], "topologies": ["regular"]})
    monkeypatch.setattr(model_specs, "get_spec", lambda name, registry=None: spec)
    monkeypatch.setitem(lanes.VENVS, ".venv-toy", lanes.Venv(".venv-toy", "cpu", ("toy",)))
    table = tmp_path / "lanes.yaml"
    table.write_text(yaml.safe_dump({"e2e-toy": {
        "description": "the toy engine", "runner": {"gpus": 0, "runs_on": ["ubuntu-latest"]},
        "engines": ["toy"], "topologies": ["1"], "pytest": {"paths": ["tests"],
                                                             "markers": "not e2e"},
        "timeout_minutes": 5, "min_tests": 1, "trigger": ["push"],
        "venvs": {"toy": ".venv-toy"}, "passed_once": True, "opt_in": False}}))
    monkeypatch.setattr(lanes, "LANES_FILE", table)
    assert cli.main(["lanes"]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("e2e-toy "))
    assert row.split()[3] == "toy", row


def test_toy_engine_brings_its_extra_its_boot_markers_and_its_report_lines(toy, monkeypatch,
                                                                           tmp_path):
    """The engine's facts the shared modules used to spell out: its pyproject extra
    (E2E_EXTRAS), its staging env file (E2E_STAGE_ENV's doc), its boot log's phrases
    (progress.py), smg's runtime_type for its workers (the gateway registration) and how its
    suite's record keys read in a report (report.details)."""
    from e2e_test.infra.cluster import progress
    from e2e_test.infra.cluster.gateway import GatewayWorker
    from e2e_test.infra.reports import report

    class Toy(ToyEngine):
        extra = "toy"
        stage_env = "/root/stage/toy-env.sh"
        progress_markers = ((r"toy is listening", "serving, waiting for health"),)

        @property
        def gateway_runtime(self):
            return "toy-runtime"

        def record_lines(self, record):
            return [f"toy says {record['toy_key']}"] if "toy_key" in record else []

    engines.register(Toy())
    assert settings.get("E2E_EXTRAS", {"E2E_EXTRAS": "toy"}) == "toy"
    with pytest.raises(settings.SettingError, match=r"accepts cpu \| gpu \| .*toy"):
        settings.get("E2E_EXTRAS", {"E2E_EXTRAS": "cpu,toy"})     # bootstrap takes one
    assert "/root/stage/toy-env.sh for toy" in settings.SETTINGS["E2E_STAGE_ENV"].text
    assert progress.state_of("loading weights\ntoy is listening\n") == \
        "serving, waiting for health"
    driver = engines.for_topology("toy", parse("1"))
    assert GatewayWorker("http://127.0.0.1:1", runtime_type=driver.gateway_runtime) \
        .registration()["runtime_type"] == "toy-runtime"
    assert report.details({"toy_key": 7}) == "toy says 7"
    assert report.details({}) == ""
