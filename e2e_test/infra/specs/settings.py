"""Every environment variable the harness reads (`E2E_*`, `AFD_E2E_*`, `AFD_GPU_E2E_*`), declared
once: name, type, default, accepted values and a one-line doc.

    from e2e_test.infra.specs import settings
    n = settings.get("E2E_BURST_N")            # parsed and validated (16 when unset)
    startup.check()                            # every variable at once; raises SettingError

This module is only the table and its parsing; `startup.check()` / `startup.startup()`
(infra/startup.py: the checks across variables, against the machine's devices, the model
registry, the engines and the weights) run at start-up (the CLI's `main`, the pytest plugin's configure, `run LANE`), so a
wrong value is one line, exit 2, naming the variable, what it got and what it accepts, before
any process starts. Adding a variable is one `_add(...)` line below; docs/settings.md is
generated from this list (`python -m e2e_test settings --markdown > docs/settings.md`;
tests/test_settings.py checks it is up to date).

An empty value counts as unset (the workflow passes `${{ vars.X }}` even when X is not set).
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..engines import EngineOptions, all_engines, engine_names
from ..errors import ConfigError, SettingError
from . import devices
from .model_specs import get_spec
from .topology import parse as parse_topology
from .topology import split_list

# -- kinds: how a raw string becomes a value, and what is accepted -------------------------------

@dataclass(frozen=True)
class Kind:
    label: str                          # the table's "type" column
    # what the error message says is accepted; a callable: worked out when asked (a list that
    # a registry holds, which grows at run time)
    accepts_text: str | Callable[[], str]
    parse: Callable[[str], Any]         # raw -> value; raises ValueError(why) on a bad value

    @property
    def accepts(self) -> str:
        return self.accepts_text() if callable(self.accepts_text) else self.accepts_text


def Int(minimum: int | None = None) -> Kind:
    def parse(raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            raise ValueError("not an integer") from None
        if minimum is not None and v < minimum:
            raise ValueError(f"below {minimum}")
        return v
    return Kind("int", "an integer" + (f" >= {minimum}" if minimum is not None else ""), parse)


def Float(minimum: float | None = None, exclusive: bool = True) -> Kind:
    def parse(raw: str) -> float:
        try:
            v = float(raw.strip())
        except ValueError:
            raise ValueError("not a number") from None
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("not a finite number")
        if minimum is not None and (v <= minimum if exclusive else v < minimum):
            raise ValueError(f"not {'>' if exclusive else '>='} {minimum:g}")
        return v
    op = ">" if exclusive else ">="
    return Kind("float", "a number" + (f" {op} {minimum:g}" if minimum is not None else ""),
                parse)


TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")


def Bool() -> Kind:
    def parse(raw: str) -> bool:
        v = raw.strip().lower()
        if v in TRUE:
            return True
        if v in FALSE:
            return False
        raise ValueError("not a boolean")
    return Kind("bool", "true/false, 1/0 or yes/no", parse)


def Choice(*choices: str) -> Kind:
    def parse(raw: str) -> str:
        if raw.strip() not in choices:
            raise ValueError("unknown value")
        return raw.strip()
    return Kind("choice", " | ".join(choices), parse)


def OneOf(among: Callable[[], tuple[str, ...]]) -> Kind:
    """One of what `among()` returns when asked (a registry's names)."""
    def parse(raw: str) -> str:
        if raw.strip() not in among():
            raise ValueError("unknown value")
        return raw.strip()
    return Kind("choice", lambda: " | ".join(among()), parse)


def CsvOf(*choices: str, among: Callable[[], tuple[str, ...]] | None = None) -> Kind:
    """A comma list of `choices`, or of what `among()` returns when asked (a registry's names)."""
    def allowed() -> tuple[str, ...]:
        return tuple(among()) if among is not None else choices

    def parse(raw: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in raw.split(",") if x.strip())
        bad = [x for x in items if x not in allowed()]
        if bad:
            raise ValueError(f"unknown {', '.join(map(repr, bad))}")
        if not items:
            raise ValueError("empty list")
        return items
    return Kind("list", lambda: "a comma list of " + ", ".join(allowed()), parse)


def Text() -> Kind:
    return Kind("str", "any text", lambda raw: raw)


def PathKind(must_be_dir: bool = False) -> Kind:
    def parse(raw: str) -> Path:
        p = Path(raw).expanduser()
        if must_be_dir and not p.is_dir():
            raise ValueError("no such directory")
        return p
    return Kind("dir" if must_be_dir else "path",
                "an existing directory" if must_be_dir else "a path", parse)


def ShellWords() -> Kind:
    def parse(raw: str) -> tuple[str, ...]:
        try:
            return tuple(shlex.split(raw))
        except ValueError as e:           # "No closing quotation"
            raise ValueError(str(e).lower()) from None
    return Kind("shell words", "shell-quoted words (balanced quotes)", parse)


def DeviceList() -> Kind:
    return Kind("ids", "comma-separated distinct ids >= 0 (e.g. 0,1)", devices.parse_ids)


def Topologies() -> Kind:
    def parse(raw: str) -> tuple[str, ...]:
        try:
            items = tuple(split_list(raw))
        except ConfigError as e:
            raise ValueError(e.summary) from None
        if not items:
            raise ValueError("empty list")
        for t in items:
            try:
                parse_topology(t)
            except ConfigError as e:
                raise ValueError(e.summary) from None
        return items
    return Kind("list", "a comma list of topologies (1, dpN, XpYd, XeYpZd, XaYf, ...); an option (p.tp=2, d.node=1) belongs to the topology before it; `;` also separates", parse)


def Model() -> Kind:
    def parse(raw: str) -> str:
        try:
            return get_spec(raw.strip()).id
        except ConfigError as e:
            raise ValueError(e.summary) from None
    return Kind("model", "a model id of the registry (`python -m e2e_test models list`)", parse)


def Executable() -> Kind:
    def parse(raw: str) -> str:
        if not shutil.which(raw):
            raise ValueError("not an executable")
        return raw
    return Kind("executable", "an executable (path or name on PATH)", parse)


# -- the variables -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    name: str
    kind: Kind
    initial: Any                        # the value when unset (None: see the doc); a callable:
    doc: str | Callable[[], str]        # asked each time (a registry's current names)
    # the table's default column where the value when unset is not what happens (a folder
    # made per run)
    default_text: str | None = None

    @property
    def default(self) -> Any:
        return self.initial() if callable(self.initial) else self.initial

    @property
    def text(self) -> str:
        """The doc line (a callable doc is asked each time: it names the registry's engines)."""
        return self.doc() if callable(self.doc) else self.doc

    def parse(self, raw: str | None, source: str | None = None) -> Any:
        if raw is None or raw.strip() == "":
            return self.default
        try:
            return self.kind.parse(raw)
        except ValueError as e:
            raise SettingError(f"{source or self.name}={raw!r}: {e}; accepts "
                               f"{self.kind.accepts}") from None


class _Table(dict):
    """name -> Setting: the harness's rows (`_add` below), then each registered engine's own
    (`Engine.settings_rows`), joined whenever the table is read, so an engine added at run
    time (engines.register) brings its variables with it."""

    def _join(self) -> None:
        for e in all_engines():
            for s in e.settings_rows:
                if not dict.__contains__(self, s.name):
                    dict.__setitem__(self, s.name, s)

    def __getitem__(self, name):
        self._join()
        return dict.__getitem__(self, name)

    def __contains__(self, name):
        self._join()
        return dict.__contains__(self, name)

    def __iter__(self):
        self._join()
        return dict.__iter__(self)

    def __len__(self):
        self._join()
        return dict.__len__(self)

    def get(self, name, default=None):
        self._join()
        return dict.get(self, name, default)

    def keys(self):
        self._join()
        return dict.keys(self)

    def values(self):
        self._join()
        return dict.values(self)

    def items(self):
        self._join()
        return dict.items(self)


SETTINGS: dict[str, Setting] = _Table()


def _add(name: str, kind: Kind, default: Any, doc: str, default_text: str | None = None) -> None:
    assert not dict.__contains__(SETTINGS, name), name
    dict.__setitem__(SETTINGS, name, Setting(name, kind, default, doc, default_text))


def __getattr__(name: str):
    if name == "ENGINES":       # the --engine names, from the engine registry (engines/)
        return engine_names()
    raise AttributeError(name)


DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def extras() -> tuple[str, ...]:
    """The pyproject extras E2E_EXTRAS accepts, one of them (scripts/bootstrap.sh --extras):
    the CPU and GPU stacks, each registered engine's own (Engine.extra)."""
    return ("cpu", "gpu", *(e.extra for e in all_engines() if e.extra))

# Selection (the pytest plugin; `run LANE` sets the first three from the lane table)
_add("E2E_ENGINES", CsvOf(among=engine_names), engine_names, "engines to parametrize over (`--engine`)")
_add("E2E_TOPOLOGIES", Topologies(), ("1", "dp2", "1p1d"), "topologies to parametrize over (`--topology`)")
_add("E2E_LANE", Text(), None, "the lane being run; set by `python -m e2e_test run LANE`")
_add("E2E_GIT_SHA", Text(), None, "the commit a lane's run.json and summary.json name, where the checkout is a copied tree (its .git, if any, is not the commit it holds)")
_add("E2E_LANE_PYTHON", Executable(), None, "interpreter for every part of `run LANE` instead of the lane's venvs (a runner whose engines come from PYTHONPATH)")
_add("E2E_MODEL", Model(), DEFAULT_MODEL, "model under test, a registry id (`--model`)")
_add("E2E_BACKEND", Choice("cpu", "cuda"), None, "cpu or cuda (`--backend`); unset: cuda when NVML sees a GPU")
_add("E2E_DEVICES", DeviceList(), None, "ordered GPU ids (cuda) or CPU cores (cpu), checked against NVML / the affinity mask (`--devices`)")
_add("E2E_CPU_CORES", DeviceList(), None, "CPU cores for CPU workers (subset of the affinity mask); unset: the affinity mask")
# Weights and data
_add("E2E_MODEL_PATH", PathKind(must_be_dir=True), None, "weights folder of the model under test (overrides the registry); its config.json is parsed before launch")
_add("E2E_MODEL_ROOT", PathKind(must_be_dir=True), None, "folder holding hub-id sub-folders for `source: hf` registry entries")
_add("E2E_CACHE_DIR", PathKind(), Path("~/.cache/e2e_test").expanduser(), "cache of prepared models and downloaded datasets")
_add("E2E_DATASET_DIR", PathKind(must_be_dir=True), None, "folder with gsm8k/{train,test}.jsonl and mmlu/{dev,test}.jsonl; unset: ../shared/datasets beside the checkout where it holds them, else the cache")
_add("E2E_RESULTS_DIR", PathKind(), Path("results"), "where result files, logs and cluster.json go; unset: a folder of its own per run, results/<lane or run>-<date>-<time>-<pid>, with results/latest pointing at it", default_text="a folder per run")
# An offline GPU runner's recipe (scripts/gpu_lane.sh; docs/gpu.md)
_add("E2E_STAGE_ENV", PathKind(), None, lambda: "scripts/gpu_lane.sh: the env file the engine's staging wrote (default " + ", ".join(f"{e.stage_env} for {e.name}" for e in all_engines() if e.stage_env) + ")")
_add("E2E_SMG_WHEEL", PathKind(), None, "scripts/gpu_lane.sh: the smg wheel to install when the engine's site has no smg (default .whl/smg-*.whl)")
_add("E2E_BYTECODE", Bool(), True, "scripts/gpu_lane.sh: compile the bytecode of every folder on PYTHONPATH and of the interpreter's site once per machine (the staging installs with --no-compile and the device's Python runs with dont_write_bytecode, so without it every worker compiles its imports from source: docs/staging.md); 0: not")
_add("E2E_PYSPY_WHEEL", PathKind(), None, "scripts/gpu_lane.sh: the py-spy wheel to install when none is on PATH, for the stall reports' stacks (default .whl/py_spy-*.whl)")
_add("E2E_GGUF", PathKind(), None, "scripts/gpu_lane.sh: the GGUF (a file, or a folder of its split parts) the default model is converted from on a runner without it (default .carry/model)")
_add("E2E_LANE_LIMIT_S", Int(1), 570, "scripts/gpu_lane.sh: the lane's wall limit in seconds, after which pytest gets SIGINT and tears down")
_add("E2E_LANE_LOG", PathKind(), None, "scripts/gpu_lane.sh: where the lane's log goes (default $OUT/lane-LANE-ENGINE.log, or ./ without $OUT); scripts/gpu_runs.sh sets it per run")
_add("E2E_CALL_LIMIT_S", Int(1), 560, "scripts/gpu_runs.sh: the seconds its runs may take together (a device call stops at 600); each run gets the smaller of E2E_LANE_LIMIT_S and what is left less E2E_RUN_MARGIN_S")
_add("E2E_RUN_MARGIN_S", Int(0), 30, "scripts/gpu_runs.sh: seconds kept back from each run's limit for its teardown and packing")
_add("E2E_RUN_MIN_S", Int(1), 60, "scripts/gpu_runs.sh: a run with fewer seconds left than this is not started (named as skipped)")
# Where workers run (launcher.py)
_add("E2E_LAUNCHER", Choice("local", "ray"), "local", "how workers start: processes on this host (local) or Ray actors on the nodes of a Ray cluster (ray; `--launcher`, docs/multinode.md)")
_add("E2E_RAY_ADDRESS", Text(), "auto", "the Ray cluster of `--launcher ray`: auto (this node's), HOST:PORT, or ray://HOST:PORT (Ray Client, from a machine that is no node)")
_add("E2E_REQUIRE_MULTINODE", Bool(), False, "the simulated multi-node test (test_pd_multinode.py) fails instead of skipping where namespaces or Ray are missing (.ci/run sets it)")
# Workers
_add("E2E_ENFORCE_EAGER", Bool(), False, "start the workers eager: no compile, no graph capture (their `--enforce-eager`)")
_add("E2E_ENGINE_ARGS", ShellWords(), (), "extra flags for every worker, shell-quoted")
_add("E2E_COMPILE_CACHE", Choice("shared", "engine"), "shared", "compile cache of the workers: one shared under E2E_CACHE_DIR/compile, reused across topologies and runs (shared), or each engine's own default (engine)")
# Suites
_add("E2E_WATCHDOG_S", Float(0), 60.0, "no-progress window after which a suite fails as stuck")
_add("E2E_BURST_N", Int(1), 16, "requests per burst (test_burst.py)")
_add("E2E_PROGRESS_S", Float(0, exclusive=False), 10.0, "seconds between progress lines while a topology boots or a run goes (0: off)")
_add("E2E_CHROMIUM", Executable(), None, "the Chromium the HTML report test and `report` browser checks use (default: chromium or google-chrome on PATH)")
_add("E2E_REQUIRE_CHROMIUM", Bool(), False, "the browser test fails instead of skipping when no Chromium is found (.ci/run sets it after installing one)")
_add("E2E_IDLE_KV_MAX", Float(0, exclusive=False), 0.0005, "KV-cache usage (0-1) at or below which a worker counts as idle (idle.py)")
_add("E2E_IDLE_TIMEOUT_S", Float(0), 30.0, "how long a cluster may take to be idle again after a test's traffic")
_add("E2E_CANCEL_IDLE_S", Float(0), 30.0, "bound for every role to be idle after a client abandoned its request (test_serving_faults.py)")
_add("E2E_LEG_LOSS_S", Float(0), 20.0, "bound for every in-flight request to end with an error after a whole leg is lost")
_add("E2E_IDLE_AFTER_TEST", Bool(), True, "after each test on a shared topology, wait for every role to be idle again (a leak fails the test that caused it)")
_add("E2E_PREFLIGHT", Choice("clear", "fail", "off"), "clear", "before a topology starts: clear what a dead earlier run left (clear), name it and fail (fail), or skip the checks (off)")
_add("E2E_RUN_ID", Text(), None, "set by the harness on every process it starts: the ownership marker sweeps look for (never set it yourself)")
_add("E2E_DRIVER_PID", Text(), None, "set by the harness beside E2E_RUN_ID: the pid of the driver that owns the process")
_add("E2E_DRIVER_START", Text(), None, "set by the harness beside E2E_RUN_ID: the driver's start, in seconds since boot (a reused pid is not the driver)")
_add("E2E_PROC_TAG", Text(), None, "set by the harness on every process it starts, one tag each: a descendant that left its worker's session (a daemon) is found by it at the stop (never set it yourself)")
_add("E2E_GUARDIAN_OF", Text(), None, "set by the harness on the reaper's guardian process: the run it guards")
_add("E2E_BURST_WINDOW", Int(1), 2, "running window (--max-num-seqs) of the small-window burst topology")
_add("E2E_QUEUE_TIMEOUT_S", Int(1), 5, "smg admission queue timeout in the burst tests (whole seconds)")
_add("E2E_EVAL_CONCURRENCY", Int(1), 16, "concurrent requests of the GSM8K/MMLU suites")
_add("E2E_GSM8K_N", Int(1), None, "GSM8K questions; unset: the model's registry n")
_add("E2E_MMLU_N", Int(1), None, "MMLU questions; unset: the model's registry n")
_add("E2E_FAULT_STALL_WINDOW_S", Float(0), 20.0, "watchdog window of the SIGSTOP fault test")
# Shell scripts (scripts/bootstrap.sh, scripts/main.sh)
_add("E2E_VENV", PathKind(), Path(".venv"), "virtualenv scripts/bootstrap.sh creates and scripts/main.sh and scripts/test.sh run in")
_add("E2E_EXTRAS", OneOf(extras), "cpu", "the pyproject extra scripts/main.sh installs (scripts/bootstrap.sh --extras); one")


# -- reading ---------------------------------------------------------------------------------------

def raw(name: str, environ=None) -> str | None:
    """The variable's text, None when unset or empty."""
    env = os.environ if environ is None else environ
    v = env.get(SETTINGS[name].name)
    return v if v is not None and v.strip() != "" else None


def get(name: str, environ=None) -> Any:
    """The parsed value (the default when unset). Raises SettingError on a bad value."""
    return SETTINGS[name].parse(raw(name, environ))


def value(name: str, text: str | None, source: str) -> Any:
    """Parse an option that stands for a variable (`--backend` for E2E_BACKEND): the error
    names the option."""
    return SETTINGS[name].parse(text, source=source)


def options_from_env(environ=None, engine_opts: dict | None = None,
                     **overrides) -> EngineOptions:
    """EngineOptions from the harness's env (E2E_ENFORCE_EAGER, E2E_ENGINE_ARGS: extra worker
    flags, shell-quoted; and each engine's own options it reads from a variable, its
    `Engine.env_options`), with explicit overrides on top (`engine_opts`: engine options)."""
    base = {"enforce_eager": get("E2E_ENFORCE_EAGER", environ),
            "extra_args": get("E2E_ENGINE_ARGS", environ)}
    own = {name: get(var, environ) for e in all_engines() for name, var in e.env_options.items()}
    return EngineOptions(**{**base, **overrides}, engine_opts={**own, **(engine_opts or {})})


def ci(environ=None) -> bool:
    """Whether this runs under CI: `CI` set to a true value (1, true, yes: the TRUE set of
    Bool(), any case). A teardown violation then fails the session instead of warning."""
    env = os.environ if environ is None else environ
    return (env.get("CI") or "").strip().lower() in TRUE


def results_dir(environ=None) -> Path:
    """This run's results folder. E2E_RESULTS_DIR when set; unset, a folder of its own under
    `results/` (`<E2E_LANE or run>-<date>-<time>-<pid>`), written back into the environment so
    every part of the run (pytest-xdist workers, guardians, a lane's parts) uses the same one,
    and two runs in one checkout never overwrite each other's summary."""
    import time
    env = os.environ if environ is None else environ
    if raw("E2E_RESULTS_DIR", env) is None:
        name = f"{raw('E2E_LANE', env) or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        env["E2E_RESULTS_DIR"] = str(RESULTS_BASE / name)
    return get("E2E_RESULTS_DIR", env)


RESULTS_BASE = Path("results")
LATEST = "latest"


def mark_latest(d: Path) -> None:
    """`results/latest` -> `d` when `d` is a run folder directly under results/ (replaced
    atomically; a failure to link is not an error of the run)."""
    d = Path(d)
    base = RESULTS_BASE.resolve()
    if d.resolve().parent != base or d.name == LATEST:
        return
    tmp = base / f".{LATEST}-{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(d.name, target_is_directory=True)
        os.replace(tmp, base / LATEST)
    except OSError:
        pass


def collect(environ=None) -> tuple[dict[str, Any], list[str]]:
    """Every variable parsed: (values, one error line per bad value). The checks across
    variables and against the machine, the registry and the weights are startup.py's."""
    out, errors = {}, []
    for name, s in SETTINGS.items():
        try:
            out[name] = s.parse(raw(name, environ))
        except SettingError as e:
            errors.append(e.summary)
    return out, errors





# -- the table in docs/settings.md ----------------------------------------------------------------

def shown(v: Any, name: str | None = None) -> str:
    """A value as a user would type it (`vllm,tokenspeed`, `~/.cache/e2e_test`, `true`,
    shell words shell-quoted), never a Python repr; `unset` / `empty` where there is none.
    `name`: the variable (its kind decides how a list is joined)."""
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        if not v:
            return "empty"
        if name and SETTINGS[name].kind.label == "shell words":
            return shlex.join(v)
        return ",".join(map(str, v))
    if isinstance(v, Path):
        home = str(Path.home())
        t = str(v)
        return "~" + t[len(home):] if t.startswith(home + "/") or t == home else t
    return str(v)


def _default_text(s: Setting) -> str:
    return s.default_text or shown(s.default, s.name)


def table() -> str:
    rows = ["| variable | type | default | accepts | what it does |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(f"| `{s.name}` | {s.kind.label} | {_default_text(s)} | "
                    f"{s.kind.accepts.replace('|', '/')} | {s.text.replace('|', '/')} |")
    return "\n".join(rows)


INTRO = """\
# Settings

Every environment variable the harness reads is declared once, in
`e2e_test/infra/specs/settings.py`, and all of them are parsed and checked at start-up (the CLI,
the pytest plugin, `run LANE`): a wrong value is one line and exit 2, naming the variable, what
it got and what it accepts, before any process starts, for example
`E2E_BURST_N='abc': not an integer; accepts an integer >= 1`. Device ids are checked against
NVML (cuda) or this process's CPU affinity (cpu); the weights folder's `config.json` is parsed
before a worker is launched. An empty value counts as unset. `python -m e2e_test settings`
checks the current environment and prints every value.

This page is generated: `python -m e2e_test settings --markdown > docs/settings.md`
(tests/test_settings.py checks it is up to date).
"""


def markdown() -> str:
    """docs/settings.md: the intro and the table of every variable."""
    return f"{INTRO}\n{table()}\n"


def docs_path() -> Path:
    return Path(__file__).resolve().parents[3] / "docs" / "settings.md"
