"""Engines behind one interface, and their registry.

Each engine module (vllm.py, tokenspeed.py, afd.py) holds everything the harness knows about
that engine: its pure command builder (spec, topology, plan entry, ports, options) ->
lifecycle.launcher.WorkerCommand (argv, env, readiness, metrics folder, start stage, ...), the
extra ports it needs, the counters that show it working, whether its workers may share a GPU
and how they must start when they do, and its proof hooks. It exposes them as `ENGINE`, an `Engine`.
The Cluster asks the registry for the engine of a topology and never names one.

Adding an engine = one module defining `ENGINE` + one line in `REGISTRY` (or `register()`
at run time, as tests/test_cluster.py does with a fake engine).

No process is started here; every builder is unit-tested for its exact argv and env.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Programs that run inside a worker's own processes (launchers/), put on its PYTHONPATH.
LAUNCHERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launchers")


@dataclass(frozen=True)
class Ports:
    """Ports for one worker: `api` serves HTTP (or gRPC); `aux` by purpose."""
    api: int
    aux: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOptions:
    """What every engine is started with (generic fields), plus each engine's own options in
    one mapping, `engine_opts` (name -> value; the engine module declares the names it reads
    and their defaults: its `Engine.option_defaults`). Read an engine's option with
    `opt(name, default)`, set one with `with_opts(name=value)`."""
    backend: str = "cpu"               # cpu | cuda
    enforce_eager: bool = False
    max_num_seqs: int | None = None    # a deliberately small running window
    protocol: str = "http"             # http | grpc
    extra_args: tuple[str, ...] = ()
    # Folder for per-worker state the engine writes (e.g. Prometheus multiprocess files); the
    # cluster fills it with <cluster dir>/state. Empty: the engine keeps none.
    state_dir: str = ""
    # Folder for the engine's compile cache, shared by every worker and topology (the engine
    # keys its entries by what the compile depends on); the cluster fills it with
    # <E2E_CACHE_DIR>/compile when E2E_COMPILE_CACHE=shared. Empty: the engine's own default.
    compile_cache_dir: str = ""
    # Each engine's own options (its module documents them: Engine.option_defaults).
    engine_opts: Mapping[str, Any] = field(default_factory=dict)

    def opt(self, name: str, default: Any = None) -> Any:
        """An engine's own option: its value here, else `default` (the engine's)."""
        return self.engine_opts.get(name, default)

    def with_opts(self, **values: Any) -> EngineOptions:
        """A copy with these engine options set (the others kept)."""
        return replace(self, engine_opts={**self.engine_opts, **values})


@dataclass(frozen=True)
class KnownCrash:
    """A crash of an upstream component, recognised in a dead worker's log: `pattern` (a
    regular expression) on a worker of `role` (None: any role). `summary` is one sentence,
    `refs` the upstream places (file:line, issue) that show it."""
    pattern: str
    summary: str
    refs: tuple[str, ...]
    role: str | None = None

    def line(self) -> str:
        return f"known upstream bug: {self.summary} ({'; '.join(self.refs)})"


# -- the engine interface ------------------------------------------------------------------

class Engine:
    """One engine's knowledge. A module subclasses this, overrides what differs and exposes
    an instance as ENGINE. Everything here is pure except where a method says otherwise.

    Arguments by name: `spec` a model_specs.ModelSpec, `topology` a topology.Topology,
    `entry` a plan.PlanEntry; a builder returns a lifecycle.launcher.WorkerCommand. None is
    imported here: this module imports no part of the harness but errors.py, so that specs/
    (settings, model_specs) can ask the registry (pyproject.toml [tool.importlinter])."""

    name: str = ""                      # registry key ("vllm", "tokenspeed", "afd")
    runtime: str = ""                   # the --engine name it serves; "" = its own name
    kinds: tuple[str, ...] = ()         # topology kinds it builds
    backends: tuple[str, ...] = ("cpu", "cuda")   # where it runs
    packable: bool = True               # its workers may share a GPU
    multinode: bool = False             # its builder binds plan entries' node addresses
    # Prometheus counters whose sum grows while it processes tokens (the watchdog's progress
    # signal, Cluster.engine_work); empty: the watchdog sees no engine progress.
    work_counters: tuple[str, ...] = ()
    # The counter of generated tokens (a cancel during decode must leave it short of the
    # request's max_tokens: serving_faults.cancel_problems); None: not known for this engine.
    generation_counter: str | None = None
    # A histogram of each request's time from its arrival to its end on a worker: on a PD
    # prefill, the prefill's own span (a cancel during prefill is timed from it, where a
    # client's time to first token also holds the transfer and the decode's first step).
    request_latency_histogram: str | None = None
    # Gauges that say a worker is idle: {"running", "waiting", "kv"} -> metric name (idle.py);
    # None: idleness cannot be verified for this engine. Roles that hold no requests (an FFN
    # server, an encoder) are skipped.
    idle_gauges: dict | None = None
    # Top-k logprobs per generated token the engine can return (the comparison oracle's
    # evidence, oracle.py); 0: only the sampled token's logprob.
    top_logprobs: int = 5
    # Where per-token logprobs come back through the gateway: "completions" (`logprobs: k`)
    # or "chat" (`logprobs: true, top_logprobs: k`); the oracle's passes ask that way
    # (comparisons.requests). The scored evals keep their own shape; an engine on "chat" has
    # its oracle passes run apart from them.
    logprobs_api: str = "completions"
    idle_skip_roles: tuple[str, ...] = ()
    # Upstream crashes this engine is known to have (KnownCrash); a worker that dies of one is
    # named with it, and the run raises UpstreamBug instead of a bare WorkerDied.
    known_crashes: tuple[KnownCrash, ...] = ()

    def known_crash(self, role: str, log_text: str) -> KnownCrash | None:
        """The known upstream crash a dead worker's log shows, or None. Pure."""
        for k in self.known_crashes:
            if (k.role is None or k.role == role) and re.search(k.pattern, log_text):
                return k
        return None

    @property
    def engine(self) -> str:
        return self.runtime or self.name

    def aux_ports(self, topology, entry, options: EngineOptions) -> list[str]:
        """Names of the extra ports a worker needs, allocated by the cluster."""
        return []

    def aux_port_span(self, name: str, entry) -> int:
        """How many consecutive ports aux port `name` stands for (the worker binds the ones
        right above it too): the cluster allocates it as a block, so no other server of the
        session (a gateway, another worker) is handed one of them. 1: the port alone."""
        return 1

    def fixed_ports(self, options: EngineOptions) -> dict[str, int]:
        """Aux ports already chosen in `prepare` (shared by several workers): not allocated
        again per worker."""
        return {}

    def prepare(self, topology, spec, options: EngineOptions,
                run_dir: Path, allocate_block) -> EngineOptions:
        """Options for this topology, before any worker is built: may allocate shared ports
        (`allocate_block(k)` -> base of k consecutive free ports) and name folders under
        `run_dir` (the cluster's results folder)."""
        return options

    def build(self, spec, topology, entry, ports: Ports, model_path: str,
              options: EngineOptions):
        """The WorkerCommand that starts one worker (lifecycle.launcher)."""
        raise NotImplementedError

    def worker_command(self, spec, topology, entry,
                       ports: Ports, model_path: str, options: EngineOptions,
                       run_dir: Path):
        """The command the cluster launches: `build` plus what depends on the run folder."""
        return self.build(spec, topology, entry, ports, model_path, options)

    def packed_schedule(self, entries, spec=None) -> dict[str, tuple[int, float]] | None:
        """For workers that share a GPU: {name: (start stage, memory share)}; None: they all
        start at once with the planned fractions. `spec`: the model (its KV budget)."""
        return None

    def gateway_args(self, topology) -> tuple[str, ...]:
        """Extra gateway flags this engine's workers need in `topology` (e.g. a gateway poll
        an engine cannot answer). Pure."""
        return ()

    # What each proof's failure must say when nothing moved: {"pd" | "epd" | "ffn": regex}.
    # The proofs' negative controls (test_pd, test_epd) read a regular worker as every role
    # of the proof, where nothing is transferred, and the proof must fail with this reason.
    proof_misses: dict[str, str] = {}
    # None: its workers may boot beside another topology's on the same device (their memory
    # is the planned fraction, whatever the others hold). Else why not, in one line: the
    # assignment (coboot.assign) then runs one topology at a time.
    boots_beside_others: str | None = None

    def alone_reason(self, spec) -> str | None:
        """Why this engine's workers must boot with no other topology beside them, serving
        `spec` (None: they may); the default is the engine-wide boots_beside_others."""
        return self.boots_beside_others

    def held_share(self, plan) -> dict | None:
        """The memory share its workers of `plan` hold on each device, where that is not the
        sum of their planned fractions (coboot.device_share); None: that sum. Pure."""
        return None

    def beside(self, plan, device_shares: dict):
        """The plan of one of its topologies booting beside others (coboot.assign), where
        `device_shares` (device -> share) is what the topologies running at once may hold
        together on each device. The default: unchanged (a worker's memory is its own planned
        share). Pure."""
        return plan

    def pd_proof(self, cluster, roles=None):
        """The proof that a PD topology's KV moved; returns a proof object (its to_dict() is
        the record's `pd_proof`). Raises HarnessError when the numbers do not show it.
        `roles` ({"prefill": [...], "decode": [...]}): the workers to read as each role
        (default: the topology's own)."""
        raise ConfigError(f"engine {self.name!r} has no PD transfer proof")

    def pd_legs(self, cluster, roles=None):
        """Every prefill and every decode worker of a PD topology took traffic in its own
        role, and none in the other's (proof.legs_traffic with this engine's counters);
        returns a proof object (`pd_legs`), raises HarnessError naming the legs that did not."""
        raise ConfigError(f"engine {self.name!r} has no per-leg PD proof")

    def epd_proof(self, cluster, roles=None):
        """The proof that an EPD topology's encoder ran for the requests (`epd_proof`);
        `roles` as for pd_proof, with "encode"."""
        raise ConfigError(f"engine {self.name!r} has no EPD encoder proof")

    def ffn_proof(self, cluster):
        """The proof that an AFD topology's FFN servers served the requests
        (`afd_ffn_proof`)."""
        raise ConfigError(f"engine {self.name!r} has no FFN proof")

    def disagg_proof(self, cluster) -> dict:
        """The proof that fits the topology kind (PD: the KV moved, pd_proof; EPD: the encoder
        ran, epd_proof; AFD: the FFN served, ffn_proof; none on AFD's native baseline or a
        regular topology), as {record key (PROOF_KEYS): proof dict}."""
        kind, topo = cluster.topology.kind, cluster.topology
        if kind == "pd":
            p = self.pd_proof(cluster)
        elif kind == "epd":
            p = self.epd_proof(cluster)
        elif kind == "afd" and not topo.name.startswith("native"):
            p = self.ffn_proof(cluster)
        else:
            return {}
        return {PROOF_KEYS[kind]: p.to_dict()}

    def proof_line(self, key: str, proof: dict) -> str | None:
        """One line for a report of a recorded proof (`key`: pd_proof, epd_proof,
        afd_ffn_proof; `proof`: its to_dict()), or None when the proof is not this engine's.
        Pure."""
        return None

    def first_step_path_arm(self, cluster, name: str, reqs: list, label: str,
                            concurrency: int = 16, watchdog=None):
        """The path arm (oracle.PathArm) of eval `name`'s `reqs` on the regular topology `cluster`: each
        prompt's first step computed as this engine's PD decode computes its first one, held
        against the same prompt's first step at the end of a prefill. None where this engine
        has no way to take that path on `1` (the rank test then stays recorded only).
        Raises HarnessError where the path was not taken as claimed."""
        return None

    def forget_received_kv(self, cluster) -> None:
        """Make sure no KV a decode received is reused by a later request (the KV corruption
        cases, between kinds: a corrupted block stays cached); raises HarnessError where it
        cannot."""
        raise ConfigError(f"engine {self.name!r} cannot drop its workers' cached KV")

    def running_window(self, worker_url: str, timeout: float = 5.0) -> dict | None:
        """The running window a live worker reports itself ({"max_num_seqs": int, ...,
        "source": where from}), or {"error": why} when asking failed, or None when the engine
        has no way to say (the caller falls back to the worker's log)."""
        return None

    # Environment a lane's virtualenv of this engine sets on every run (lanes.py Venv.env):
    # (name, value) pairs.
    lane_env: tuple[tuple[str, str], ...] = ()
    # Its own options (EngineOptions.engine_opts) and their defaults: {name: default}.
    option_defaults: dict = {}          # noqa: RUF012 (read only)
    # Its options read from the harness's variables (settings.options_from_env):
    # {option name: variable name}.
    env_options: dict = {}              # noqa: RUF012 (read only)
    # A variable holding its own ordered GPU list, read for the topologies it builds after
    # --devices and E2E_DEVICES (startup.resolve_devices); "": none.
    devices_env: str = ""
    # A boolean variable that admits the registry's opt-in models (its opt-in profile,
    # startup.py); "": it has none.
    opt_in_flag: str = ""
    # The variable that holds an opt-in model's weights folder (its profile's model;
    # models.weights_path); "": none.
    opt_in_weights_env: str = ""
    # Python distributions whose installed versions a run records (results.versions).
    packages: tuple[str, ...] = ()
    # Its own variables, settings.Setting rows: settings.SETTINGS lists them after the
    # harness's (docs/settings.md, `python -m e2e_test settings`, the start-up check).
    settings_rows: tuple = ()
    # The pyproject extra that installs it (E2E_EXTRAS accepts it; scripts/main.sh); "": none
    # of its own.
    extra: str = ""
    # The env file its offline staging writes, scripts/gpu_lane.sh's default for
    # E2E_STAGE_ENV on a lane of this engine; "": it has no staging.
    stage_env: str = ""
    # Phrases its workers' logs write while they boot, (regex, state) pairs; progress.py reads
    # them after the generic markers, the state of the one found last wins.
    progress_markers: tuple[tuple[str, str], ...] = ()

    @property
    def gateway_runtime(self) -> str:
        """The runtime_type smg is told for a worker of it (POST /workers; the cluster passes
        it to gateway.GatewayWorker): its --engine name unless it overrides this."""
        return self.engine

    def record_lines(self, record: dict) -> list[str]:
        """Lines for a report of the keys its own suite writes into a test record (the
        record as results.py wrote it; result files of earlier runs included), [] when the
        record holds none. report.details asks every registered engine. Pure."""
        return []

    def settings_problems(self, values: dict, environ) -> list[str]:
        """Its own variables checked at start-up against this machine (`values`: every
        variable parsed, settings.collect): one line per problem. Runs on every start-up."""
        return []

    def profile_problems(self, values: dict, environ, skip=()) -> list[str]:
        """The missing prerequisites of its opt-in profile when that is switched on (its
        `opt_in_flag`), one line each; a variable already named in `skip` is not named
        again."""
        return []

    def compile_cache_status(self, log_text: str, options: EngineOptions) -> str:
        """Whether a worker's boot reused a compile cache, read from its log (the lane's time
        report): hit | miss | partial | off (eager) | unknown (the engine does not say).
        Pure."""
        return "unknown"


DEFAULT_ENGINE = "vllm"
# The record key of each topology kind's proof (Engine.disagg_proof): the pytest records, the
# CLI's summary and the reports use the same keys.
PROOF_KEYS = {"pd": "pd_proof", "epd": "epd_proof", "afd": "afd_ffn_proof"}
# name -> module defining ENGINE. Adding an engine = one module + one line here.
REGISTRY: dict[str, str] = {
    "vllm": "e2e_test.infra.engines.vllm",
    "tokenspeed": "e2e_test.infra.engines.tokenspeed",
    "afd": "e2e_test.infra.engines.afd",
}
_engines: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    """Add (or replace) an engine at run time; returns it."""
    if not engine.name or not engine.kinds:
        raise ConfigError(f"engine {engine!r}: needs a name and the topology kinds it builds")
    _engines[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    _engines.pop(name, None)


def all_engines() -> list[Engine]:
    for name, module in REGISTRY.items():
        if name not in _engines:
            _engines[name] = importlib.import_module(module).ENGINE
    return list(_engines.values())


def engine_names() -> tuple[str, ...]:
    """The names --engine accepts, in registry order."""
    out: list[str] = []
    for e in all_engines():
        if e.engine not in out:
            out.append(e.engine)
    return tuple(out)


def kind_engines() -> dict[str, tuple[str, ...]]:
    """Which --engine names can run each topology kind."""
    out: dict[str, list[str]] = {}
    for e in all_engines():
        for k in e.kinds:
            if e.engine not in out.setdefault(k, []):
                out[k].append(e.engine)
    return {k: tuple(v) for k, v in out.items()}


def for_topology(engine: str, topology) -> Engine:
    """The engine that builds `topology`'s workers for --engine `engine` (one-line
    ConfigError when none does)."""
    for e in all_engines():
        if e.engine == engine and topology.kind in e.kinds:
            return e
    allowed = kind_engines().get(topology.kind, ())
    raise ConfigError(f"topology {topology.name!r} ({topology.kind}) cannot run on engine "
                      f"{engine!r}: only {', '.join(allowed)}")
