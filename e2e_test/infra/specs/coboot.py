"""How many of a session's topologies run at once: the device-aware assignment of the
pytest-xdist workers (`pytest -n auto --dist loadgroup`).

Each worker runs one topology at a time (its tests form one xdist group per topology: the
pytest plugin), so the number of workers is the number of topologies that may be up together.
This module decides it from data, purely (tests/test_coboot.py):

- the session's topologies (keys (engine, topology), each with the Plan it is placed with);
- the backend, the GPUs' free memory as a share of each device (NVML; None: unknown), and the
  cores this process may use.

Rules:
- not cuda: one worker. On CPU the workers share the cores: overlapping boots on 2 cores lost
  68-74 % against serial (scripts/bench_overlap.py), and the CPU lane is that machine.
- GPU memory unknown (no NVML): one worker, said so.
- an engine that sizes its memory from what the device has free when it starts
  (Engine.alone_reason: another topology booting beside it would change its budget): one.
- else as many workers as copies of the largest topology fit at once: on every device its
  planned memory share (PlanEntry.mem_fraction on each of its GPUs; Engine.held_share where
  the engine holds less than their sum) times the workers stays within the device's free
  share minus HEADROOM (CUDA contexts, allocator slack: what no engine's fraction covers), and
  its workers times the workers stay within cores // CORES_PER_WORKER (a boot is CPU-bound:
  tokenizer, weights, compilation). Any topologies of the session then fit together.
  `shares` is what they may hold together on each device (Engine.beside: TokenSpeed's
  utilization is that total).
- where not even two copies of the largest fit, as many workers as the largest topologies
  of the session fit together: on every device the sum of that many of the largest shares
  (the most any of them may hold at once), within the same bounds. The EPD lane: `1e1p1d`
  takes 0.45 of the GPU and `1` 0.15; two copies of 0.45 exceed what NVML reports free less
  HEADROOM, the two together (0.60) do not (docs/gpu.md, "Every lane at one SHA on one
  H200").

The reason, in one line, goes into the session's time report (time_report `assignment`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The share of each device no plan may take when topologies share it: CUDA contexts (about
# 0.5 GiB each), the allocator's slack and NCCL buffers, which no engine's memory fraction
# counts. 0.1 of an H200 is 14 GiB.
HEADROOM = 0.1
# Cores a booting worker keeps busy (tokenizer, weight loading, compilation threads).
CORES_PER_WORKER = 2


@dataclass(frozen=True)
class Assignment:
    workers: int                                # topologies up at once (xdist workers)
    reason: str
    shares: dict = field(default_factory=dict)  # device -> share they hold together at most

    def to_dict(self) -> dict:
        return {"workers": self.workers, "reason": self.reason,
                "shares": {str(k): v for k, v in self.shares.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> Assignment:
        return cls(d["workers"], d["reason"], {int(k): v for k, v in d["shares"].items()})


def key_name(key) -> str:
    """engine/topology[profile] of a shared key."""
    engine, topo, *profile = key
    topo = getattr(topo, "name", topo)
    return f"{engine}/{topo}" + (f"[{profile[0]}]" if profile else "")


def device_share(plan) -> dict[int, float]:
    """The memory share a plan's workers take on each device (a worker spanning several GPUs
    takes its fraction on each)."""
    out: dict[int, float] = {}
    for e in plan.entries:
        for g in e.gpus:
            out[g] = round(out.get(g, 0.0) + e.mem_fraction, 6)
    return out


def assign(keyed_plans, backend: str, free_share: dict[int, float] | None, cores: int,
           headroom: float = HEADROOM, cores_per_worker: int = CORES_PER_WORKER,
           alone: dict | None = None, held: dict | None = None) -> Assignment:
    """keyed_plans: [(key, Plan)]. `alone`: key -> why it must boot with no other topology
    beside it (its engine's Engine.alone_reason). `held`: key -> the share its workers hold
    on each device where that is not the sum of their planned fractions (Engine.held_share;
    default device_share). See the module's doc for the rules."""
    keyed_plans = list(keyed_plans)
    alone = {k: w for k, w in (alone or {}).items() if w}
    held = held or {}
    if not keyed_plans:
        return Assignment(1, "no topology")
    if backend != "cuda":
        return Assignment(1, f"backend {backend}: workers share {cores} core(s), and "
                             "overlapping boots lost 68-74 % against serial on 2 cores "
                             "(scripts/bench_overlap.py)")
    if free_share is None:
        return Assignment(1, "GPU free memory unknown (no NVML): one topology at a time")
    if alone:
        return Assignment(1, "; ".join(sorted({f"{key_name(k).split('/')[0]} boots alone: {w}"
                                              for k, w in alone.items()})))
    per_device: dict[int, list[float]] = {}      # device -> each topology's share there
    for key, plan in keyed_plans:
        for d, s in (held.get(key) or device_share(plan)).items():
            per_device.setdefault(d, []).append(s)
    big = {d: max(v) for d, v in per_device.items()}
    by_memory = min((math.floor((free_share.get(d, 0.0) - headroom) / s + 1e-9)
                     for d, s in big.items() if s > 0), default=len(keyed_plans))
    most = max(len(p.entries) for _, p in keyed_plans)
    by_cores = cores // (cores_per_worker * most)
    n = max(1, min(by_memory, by_cores))
    frees = ", ".join(f"GPU {d} {s:.2f} free" for d, s in sorted(free_share.items()))
    if n == 1 and by_cores > 1 and len(keyed_plans) > 1:
        together = _together(per_device, free_share, headroom,
                             min(by_cores, len(keyed_plans)))
        if together is not None:
            k, sums = together
            taken = ", ".join(f"GPU {d} {s:.2f}" for d, s in sorted(sums.items()))
            return Assignment(k, f"{k} topologies at once: the {k} largest take {taken} "
                                 f"together ({frees}; headroom {headroom:g}; two copies of "
                                 f"the largest would not fit)", sums)
    largest = ", ".join(f"GPU {d} {s:.2f}" for d, s in sorted(big.items()))
    why = (f"{n} topologies at once: the largest takes {largest} ({frees}; headroom "
           f"{headroom:g}) and boots {most} worker(s) ({cores} cores, {cores_per_worker} a "
           f"booting worker)")
    if n == 1:
        return Assignment(1, why.replace("1 topologies at once", "one topology at a time"))
    return Assignment(n, why, {d: round(min(n * s, free_share.get(d, 0.0) - headroom), 4)
                               for d, s in big.items()})


def _together(per_device: dict[int, list[float]], free_share: dict[int, float],
              headroom: float, limit: int) -> tuple[int, dict[int, float]] | None:
    """(k, what the k largest topologies hold together on each device) for the largest k
    from 2 to `limit` where, on every device, the sum of the k largest of its topologies'
    shares (`per_device`) stays within its free share less `headroom`; None where not even
    two fit. Pure."""
    best = None
    for k in range(2, limit + 1):
        sums = {d: round(sum(sorted(v, reverse=True)[:k]), 4) for d, v in per_device.items()}
        if any(s > free_share.get(d, 0.0) - headroom + 1e-9 for d, s in sums.items()):
            break
        best = (k, sums)
    return best
