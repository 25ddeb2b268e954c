"""Topologies as data, parsed from short strings.

Grammar:  CORE[,OPTION]*
  CORE    `1`                 one regular worker
          `dpN`               N regular workers behind the gateway (round robin)
          `dpN-engine`        one engine started with --data-parallel-size N, gateway --dp-aware
          `XpYd`              X prefill + Y decode workers (PD disaggregation)
          `XeYpZd`            X encode + Y prefill + Z decode workers (EPD)
          `XaYf`              AFD: attention on X ranks, FFN on Y ranks (X a multiple of Y)
          `native-dpN`        AFD's native baseline: one engine, DP N with expert parallel
  OPTION  `tp=K` (every role) or `ROLE.tp=K` / `ROLE.dp=K`, ROLE one of the role names below
          (short forms e/p/d/a/f accepted), e.g. `1p1d,p.tp=2`;
          `ROLE.node=K` pins the role's workers to node K of a multi-node launcher (`--launcher
          ray`), e.g. `1p1d,p.node=0,d.node=1` (plan.assign_nodes; unpinned roles spread).

A *list* of topologies (`--topology`, E2E_TOPOLOGIES, `split_list`) is comma-separated too:
a piece that is an option (`tp=K`, `ROLE.key=K`) belongs to the topology before it, so
`1,1p1d,p.node=0,d.node=1` is `1` and `1p1d,p.node=0,d.node=1`. `;` also separates
topologies (`1p1d,p.tp=2;1`).

Every problem is a one-line ConfigError, raised before anything starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..errors import ConfigError

ROLE_NAMES = ("worker", "encode", "prefill", "decode", "attention", "ffn")
_SHORT = {"w": "worker", "e": "encode", "p": "prefill", "d": "decode", "a": "attention",
          "f": "ffn"}
# Which engines run each kind is each engine's knowledge: engines.kind_engines().
MAX_WORKERS_PER_ROLE = 64
MAX_NODES = 256


@dataclass(frozen=True)
class RoleGroup:
    """`count` processes playing `role`, each with tp x dp devices."""
    role: str
    count: int
    tp: int = 1
    dp: int = 1
    node: int | None = None        # pinned to this node of the launcher (None: the planner picks)

    @property
    def devices_per_worker(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True)
class Topology:
    name: str                      # the string it was parsed from (normalised)
    kind: str                      # regular | dp | pd | epd | afd
    roles: tuple[RoleGroup, ...]   # in start/device-assignment order
    engine_dp: bool = False        # dpN-engine: one engine with --data-parallel-size
    native_baseline: bool = False  # AFD native DP/EP baseline
    options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_workers(self) -> int:
        return sum(r.count for r in self.roles)

    @property
    def num_devices(self) -> int:
        return sum(r.count * r.devices_per_worker for r in self.roles)

    def group(self, role: str) -> RoleGroup | None:
        return next((g for g in self.roles if g.role == role), None)

    def __str__(self) -> str:
        return self.name


_CORE = [
    (re.compile(r"^1$"), "regular"),
    (re.compile(r"^dp(\d+)(-engine)?$"), "dp"),
    (re.compile(r"^(\d+)p(\d+)d$"), "pd"),
    (re.compile(r"^(\d+)e(\d+)p(\d+)d$"), "epd"),
    (re.compile(r"^(\d+)a(\d+)f$"), "afd"),
    (re.compile(r"^native-dp(\d+)$"), "afd-native"),
]


_OPTION = re.compile(r"^(?:[a-z]+\.)?[a-z_]+=")


def split_list(text: str) -> list[str]:
    """A topology list as its topologies: `;` separates; within a `;` part a comma starts a
    new topology unless the next piece is an option (`key=value`, `role.key=value`), which
    belongs to the topology before it. A list that starts with an option is a ConfigError."""
    out: list[str] = []
    for part in (text or "").split(";"):
        group: list[str] = []
        for piece in (x.strip() for x in part.split(",")):
            if not piece:
                continue
            if _OPTION.match(piece.lower()):
                if not group:
                    raise ConfigError(f"bad topology list {text!r}: option {piece!r} follows "
                                      "no topology (options go after theirs: 1p1d,p.tp=2)")
                group.append(piece)
                continue
            if group:
                out.append(",".join(group))
            group = [piece]
        if group:
            out.append(",".join(group))
    return out


def _count(text: str, what: str, name: str) -> int:
    n = int(text)
    if not 1 <= n <= MAX_WORKERS_PER_ROLE:
        raise ConfigError(f"topology {name!r}: {what} count {n} must be 1..{MAX_WORKERS_PER_ROLE}")
    return n


def parse(text: str) -> Topology:
    """A topology string as a Topology (a Topology is returned as it is). A text is parsed once
    per process: the same text again gets the same (immutable) object back."""
    if isinstance(text, Topology):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"topology must be a non-empty string, got {text!r}")
    return parse_cached(text)


@lru_cache(maxsize=512)
def parse_cached(text: str) -> Topology:
    return parse_uncached(text)


def parse_uncached(text: str) -> Topology:
    name = text.strip().lower().replace(" ", "")
    core, *opts = name.split(",")
    for rx, kind in _CORE:
        m = rx.match(core)
        if m:
            break
    else:
        raise ConfigError(f"bad topology {text!r}: expected 1, dpN, dpN-engine, XpYd, XeYpZd, "
                          "XaYf or native-dpN (e.g. 1p1d, 1e1p1d, 2a2f)")
    engine_dp = native = False
    if kind == "regular":
        roles = [RoleGroup("worker", 1)]
    elif kind == "dp":
        n = _count(m.group(1), "dp", text)
        if n < 2:
            raise ConfigError(f"topology {text!r}: dp needs at least 2 (use `1` for one worker)")
        engine_dp = bool(m.group(2))
        roles = [RoleGroup("worker", 1, dp=n)] if engine_dp else [RoleGroup("worker", n)]
    elif kind == "pd":
        roles = [RoleGroup("prefill", _count(m.group(1), "prefill", text)),
                 RoleGroup("decode", _count(m.group(2), "decode", text))]
    elif kind == "epd":
        roles = [RoleGroup("encode", _count(m.group(1), "encode", text)),
                 RoleGroup("prefill", _count(m.group(2), "prefill", text)),
                 RoleGroup("decode", _count(m.group(3), "decode", text))]
    elif kind == "afd":
        a, f = _count(m.group(1), "attention", text), _count(m.group(2), "ffn", text)
        if a % f:
            raise ConfigError(f"topology {text!r}: AFD needs attention ranks ({a}) to be a "
                              f"multiple of FFN ranks ({f})")
        # One attention server with DP=a, one FFN server with DP=f (the plugin's layout).
        roles = [RoleGroup("attention", 1, dp=a), RoleGroup("ffn", 1, dp=f)]
    else:  # afd-native
        kind, native = "afd", True
        roles = [RoleGroup("worker", 1, dp=_count(m.group(1), "dp", text))]
    topo = Topology(name=name, kind=kind, roles=tuple(roles), engine_dp=engine_dp,
                    native_baseline=native)
    return _apply_options(topo, opts, text)


def _apply_options(topo: Topology, opts: list[str], text: str) -> Topology:
    roles = list(topo.roles)
    for opt in opts:
        m = re.match(r"^(?:([a-z]+)\.)?(tp|dp|node)=(\d+)$", opt)
        if not m:
            raise ConfigError(f"topology {text!r}: bad option {opt!r} (use tp=K, ROLE.tp=K "
                              "or ROLE.node=K)")
        role = m.group(1)
        role = _SHORT.get(role, role) if role else None
        if role is not None and role not in ROLE_NAMES:
            raise ConfigError(f"topology {text!r}: unknown role {m.group(1)!r} "
                              f"(roles: {', '.join(ROLE_NAMES)})")
        key, value = m.group(2), int(m.group(3))
        if key == "node":
            if value > MAX_NODES - 1:
                raise ConfigError(f"topology {text!r}: node={value} must be 0..{MAX_NODES - 1}")
        elif value not in (1, 2, 4, 8, 16):
            raise ConfigError(f"topology {text!r}: {key}={value} must be 1, 2, 4, 8 or 16")
        hit = False
        for i, g in enumerate(roles):
            if role is None or g.role == role:
                roles[i] = replace(g, **{key: value})
                hit = True
        if not hit:
            raise ConfigError(f"topology {text!r}: no {role!r} role in {topo.kind}")
    return replace(topo, roles=tuple(roles))
