"""The small YAML schema checks shared by the model registry (model_specs.py) and the lane
table (lanes.py). Each raises a one-line ConfigError naming where (entry and key) and what."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def mapping(where: str, raw: Any, known, required=()) -> dict:
    """`raw` is a mapping whose keys are all `known` and which has every `required` one."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in known]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(known)})")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    return raw


def type_name(t: type | tuple[type, ...]) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def check_type(where: str, value: Any, t: type | tuple[type, ...]) -> None:
    # bool is an int subclass: refuse it where a number is expected.
    bad_bool = isinstance(value, bool) and t is not bool
    if bad_bool or not isinstance(value, t):
        raise ConfigError(f"{where}: expected {type_name(t)}, got {type(value).__name__} "
                          f"{value!r}")


def integer(where: str, value: Any, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{where}: expected an integer >= {lo}, got {value!r}")
    return value


def str_list(where: str, value: Any, allowed=None, nonempty: bool = False,
             unique: bool = False) -> tuple[str, ...]:
    """A list of strings (non-empty ones, when `nonempty`: and at least one), each in
    `allowed` when given, without repeats when `unique`."""
    if not isinstance(value, list) or not all(isinstance(v, str) and (v or not nonempty)
                                              for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    if nonempty and not value:
        raise ConfigError(f"{where}: must not be empty")
    if allowed is not None:
        bad = [v for v in value if v not in allowed]
        if bad:
            raise ConfigError(f"{where}: unknown {', '.join(map(repr, bad))} "
                              f"(known: {', '.join(allowed)})")
    dup = sorted({v for v in value if value.count(v) > 1})
    if unique and dup:
        raise ConfigError(f"{where}: duplicate {', '.join(map(repr, dup))}")
    return tuple(value)
