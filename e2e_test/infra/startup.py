"""What every entry point runs first, above the settings table, the model registry and the
engines: every variable parsed (settings.py) and checked across (the selection of engines x
topologies x model against the registries, an opt-in model against its flag, the weights'
config.json), the options that stand for variables, and device ids against this machine
(devices.py: NVML, the affinity mask). Raises SettingError with one line per problem.
"""

from __future__ import annotations

import os
from typing import Any

from .engines import all_engines, kind_engines
from .errors import ConfigError, SettingError
from .specs import devices as dev
from .specs import settings
from .specs.model_specs import get_spec
from .specs.models import check_config_json
from .specs.topology import Topology
from .specs.topology import parse as parse_topology


def _check_cpu_cores(values: dict, environ) -> None:
    cores = values.get("E2E_CPU_CORES")
    if cores:
        dev.check_cpu_ids(cores, "E2E_CPU_CORES", settings.raw("E2E_CPU_CORES", environ))


def _opt_in_flags() -> list[str]:
    """The variables that admit opt-in registry models (each engine's `opt_in_flag`)."""
    return [e.opt_in_flag for e in all_engines() if e.opt_in_flag]


def _opt_in_allowed(values: dict) -> bool:
    return any(values.get(f) for f in _opt_in_flags())


def _opt_in_text() -> str:
    return " or ".join(f"{f}=1" for f in _opt_in_flags()) or "an engine's opt-in profile"


def _check_opt_in_model(values: dict, environ) -> None:
    spec = get_spec(values["E2E_MODEL"])
    if spec.opt_in and not _opt_in_allowed(values):
        raise SettingError(f"E2E_MODEL={settings.raw('E2E_MODEL', environ)!r}: an opt-in model; "
                           f"accepts it only with {_opt_in_text()} (the opt-in profile)")


def selection_problem(model: str, engines, topologies, source: str, text: str) -> str | None:
    """One line when a topology of the selection runs on no selected engine with this model
    (the registry's engines and topology kinds, and which engines build each kind): pytest
    would collect tests that can only fail. None when every topology has a runnable pair."""
    spec = get_spec(model)
    kinds = kind_engines()
    for t in topologies:
        topo = parse_topology(t)
        runs = [e for e in engines if e in kinds.get(topo.kind, ()) and
                spec.supports(e, topo.kind)]
        if not runs:
            return (f"{source}={text!r}: topology {topo.name!r} ({topo.kind}) runs on none of "
                    f"engine(s) {','.join(engines)} with model {spec.id!r} (its registry entry "
                    f"allows {','.join(spec.topologies)} on {','.join(spec.engines)}); accepts "
                    "topologies the model and an engine both run")
    return None


def _check_selection(values: dict, environ) -> None:
    """E2E_TOPOLOGIES, when given, against E2E_MODEL and E2E_ENGINES (the defaults are the
    harness's, and a command that takes its own topology, `plan 1`, does not read them)."""
    text = settings.raw("E2E_TOPOLOGIES", environ)
    if text is None:
        return
    why = selection_problem(values["E2E_MODEL"], values["E2E_ENGINES"],
                            values["E2E_TOPOLOGIES"], "E2E_TOPOLOGIES", text)
    if why:
        raise SettingError(why)


def _check_model_path(values: dict, environ) -> None:
    """E2E_MODEL_PATH's config.json parsed now (what `plan` and a Cluster do before launch),
    so `settings` and pytest's start-up do not pass a folder a worker would fail on."""
    path = values.get("E2E_MODEL_PATH")
    if path is None:
        return
    try:
        check_config_json(get_spec(values["E2E_MODEL"]), path,
                          f"E2E_MODEL_PATH={settings.raw('E2E_MODEL_PATH', environ)}")
    except ConfigError as e:
        raise SettingError(f"E2E_MODEL_PATH={settings.raw('E2E_MODEL_PATH', environ)!r}: "
                           f"{e.summary}") from None


_CROSS_CHECKS = [_check_cpu_cores, _check_opt_in_model, _check_selection, _check_model_path]


def check(environ=None) -> dict[str, Any]:
    """Every variable parsed, then checked across (cores against the affinity mask, an opt-in
    model against its flag, the selection against the registry, the weights' config.json);
    all errors at once, one line each. Returns the values."""
    out, errors = _collect(environ)
    if errors:
        raise SettingError("\n".join(errors))
    return out


def _collect(environ=None) -> tuple[dict[str, Any], list[str]]:
    out, errors = settings.collect(environ)
    if not errors:
        for fn in _CROSS_CHECKS:
            try:
                fn(out, environ)
            except SettingError as e:
                errors.append(e.summary)
    return out, errors


def check_devices(text: str | None, backend: str, source: str = "--devices",
                  cpu_present=dev.affinity, gpu_present=None) -> tuple[int, ...] | None:
    """Parse a device list and check it against the machine: GPU ids against NVML (cuda),
    CPU cores against the affinity mask (cpu)."""
    devs = settings.value("E2E_DEVICES", text, source)
    if devs:
        if backend == "cuda":
            dev.check_gpu_ids(devs, source, text, present=gpu_present)
        else:
            dev.check_cpu_ids(devs, source, text, present=cpu_present)
    return devs


def resolve_devices(topology: Topology, explicit: str | None = None,
                    environ: dict | None = None, inventory=None) -> tuple[int, ...]:
    """The ordered GPU list; a list given by --devices, E2E_DEVICES or AFD_E2E_DEVICES must name
    GPUs NVML lists (devices.check_gpu_ids: where NVML lists none, a given list is an error)."""
    inventory = inventory or dev.nvml_inventory
    env = os.environ if environ is None else environ
    given = None
    if explicit:
        given = (explicit, "--devices")
    elif settings.raw("E2E_DEVICES", env):
        given = (settings.raw("E2E_DEVICES", env), "E2E_DEVICES")
    else:       # the list of the engine that builds this kind, when it has a variable of its own
        given = next(((settings.raw(v, env), v) for v in _devices_envs(topology)
                      if settings.raw(v, env)), None)
    if given:
        devs = settings.value("E2E_DEVICES", given[0], given[1])
        dev.check_gpu_ids(devs, given[1], given[0], present=inventory)
    elif env.get("CUDA_VISIBLE_DEVICES"):
        devs = dev.parse_device_list(env["CUDA_VISIBLE_DEVICES"], "CUDA_VISIBLE_DEVICES")
    else:
        devs = tuple(inventory())
    return dev.xdist_share(devs, env) if devs else devs


def _devices_envs(topology: Topology) -> list[str]:
    return [e.devices_env for e in all_engines() if e.devices_env and topology.kind in e.kinds]


def cpu_cores(environ: dict | None = None) -> tuple[int, ...]:
    """This process's cores for CPU workers: E2E_CPU_CORES (checked against the affinity mask)
    or the affinity mask, this xdist worker's share."""
    env = os.environ if environ is None else environ
    cores = settings.get("E2E_CPU_CORES", env)
    if cores:
        dev.check_cpu_ids(cores, "E2E_CPU_CORES", settings.raw("E2E_CPU_CORES", env))
    else:
        cores = dev.affinity()
    return dev.xdist_share(cores, env)


def child_env(topology: Topology, backend: str, environ: dict | None = None) -> dict:
    """The environment of a process that boots topologies of its own, started from this one (a
    user's driver script, a pytest run inside a test): what this process holds as that
    process's whole list (E2E_DEVICES on cuda, E2E_CPU_CORES on cpu), without the pytest-xdist
    worker count, by which it would take a worker's slice of that list again
    (devices.xdist_share) or fail to find one. The worker id stays: the child's ports come from
    this worker's slice (ports.py). Outside a pytest-xdist worker: the environment as it is."""
    env = dict(os.environ if environ is None else environ)
    if "PYTEST_XDIST_WORKER_COUNT" not in env:
        return env
    if backend == "cuda":
        env["E2E_DEVICES"] = ",".join(map(str, resolve_devices(topology, environ=env)))
    else:
        env["E2E_CPU_CORES"] = ",".join(map(str, cpu_cores(env)))
    del env["PYTEST_XDIST_WORKER_COUNT"]
    return env


def machine_devices(topology: Topology, backend: str,
                    explicit: str | None = None) -> tuple[int, ...]:
    """What plan.place takes as data: on cuda the ordered GPU list (resolve_devices), on cpu
    the cores (`explicit`, a --devices text, else cpu_cores())."""
    if backend == "cuda":
        return resolve_devices(topology, explicit)
    if backend == "cpu":
        return dev.parse_device_list(explicit, "--devices") if explicit else cpu_cores()
    raise ConfigError(f"unknown backend {backend!r} (cpu or cuda)")


def resolve_backend(text: str | None, source: str = "--backend") -> str:
    """`--backend`/E2E_BACKEND checked (cpu | cuda; `gpu` is refused, never read as cpu);
    unset: cuda when NVML sees a GPU."""
    b = settings.value("E2E_BACKEND", text, source) if text else settings.get("E2E_BACKEND")
    if b:
        return b
    return "cuda" if dev.nvml_inventory() else "cpu"


def startup(environ=None, *, backend: str | None = None, devices: str | None = None,
            model: str | None = None, engines: str | None = None,
            topologies: str | None = None) -> dict[str, Any]:
    """What every entry point runs first: all variables (check()), then the options that stand
    for them (they override the variables), device ids against this machine and an opt-in
    model against its flag, and with AFD_E2E_LARGE_MODEL=1 the opt-in profile's prerequisites
    (engines/afd.check_profile). Raises SettingError with one line per problem."""
    values, errors = _collect(environ)
    if errors:
        errors += _profile_problems(values, environ, skip=errors)
        raise SettingError("\n".join(errors))

    def opt(name, text, source):
        if text is None:
            return values[name]
        try:
            return settings.value(name, text, source)
        except SettingError as e:
            errors.append(e.summary)

    b = None
    try:
        b = resolve_backend(backend) if backend else (values["E2E_BACKEND"] or resolve_backend(None))
    except SettingError as e:
        errors.append(e.summary)
    values["backend"] = b
    values["model"] = opt("E2E_MODEL", model, "--model")
    sel_engines = opt("E2E_ENGINES", engines, "--engine")
    sel_topologies = opt("E2E_TOPOLOGIES", topologies, "--topology")
    if (topologies or engines or model) and not errors and values["model"]:
        # the options over the variables: the selection pytest would collect
        t_text, t_source = ((topologies, "--topology") if topologies else
                            (settings.raw("E2E_TOPOLOGIES", environ), "E2E_TOPOLOGIES"))
        if t_text is not None:
            why = selection_problem(values["model"], sel_engines, sel_topologies, t_source,
                                    t_text)
            if why:
                errors.append(why)
    text, source = (devices, "--devices") if devices else (settings.raw("E2E_DEVICES", environ), "E2E_DEVICES")
    if text and b:
        try:
            check_devices(text, b, source)
        except SettingError as e:
            errors.append(e.summary)
    for e in all_engines():         # each engine's own variables (e.g. its device list)
        errors += e.settings_problems(values, environ)
    if model and values["model"] and not errors:
        if get_spec(values["model"]).opt_in and not _opt_in_allowed(values):
            errors.append(f"--model={model!r}: an opt-in model; accepts it only with "
                          f"{_opt_in_text()} (the opt-in profile)")
    errors += _profile_problems(values, environ, skip=errors)
    if errors:
        raise SettingError("\n".join(errors))
    return values


def _profile_problems(values: dict, environ, skip=()) -> list[str]:
    """Each engine's switched-on opt-in profile's missing prerequisites, one line each
    (Engine.profile_problems); a variable already named in `skip` is not named twice."""
    out: list[str] = []
    for e in all_engines():
        out += e.profile_problems(values, environ, skip=skip)
    return out
