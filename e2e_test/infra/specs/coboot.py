"""Lane-level placement: which of a session's shared topologies boot together.

A lane spends most of its wall time waiting for workers, one topology after another (issue 30;
docs/lanes.md, "Booting a lane's topologies together"). Where the machine has room, every
topology the session selected can boot at once and each test waits only for its own. This
module decides that from data, purely (tests/test_coboot.py):

- the session's shared topologies in the order their tests run (the pytest plugin's keys:
  (engine, topology name, profile...)), each with the Plan it was placed with;
- the backend, the GPUs' free memory as a share of each device (NVML; None: unknown), and the
  cores this process may use.

The answer is a BootSchedule: waves of keys, in test order, each wave booted at once; "serial"
is one key per wave (the tests' order), "together" one wave holding every key. Rules:

- not cuda: serial. On CPU the workers share the cores: overlapping boots on 2 cores lost
  68-74 % against serial (scripts/bench_overlap.py), and the CPU lane is that machine.
- GPU memory unknown (no NVML): serial, said so.
- a wave takes keys in order while, on every device, the planned memory shares of its workers
  (PlanEntry.mem_fraction on each of its GPUs) add up to no more than the device's free share
  minus HEADROOM (CUDA contexts, allocator slack: what no engine's fraction covers), and while
  its workers number at most cores // CORES_PER_WORKER (a boot is CPU-bound: tokenizer, weights,
  compilation); the next key starts the next wave. A key that does not fit alone is a wave of
  its own, planned for the device as it is now, and so is a key whose engine sizes its
  memory from what the device has free when it starts (Engine.alone_reason: another
  topology booting beside it would change its budget).

The reason, in one line, goes into the session's time report (time_report.boot_schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The share of each device no plan may take when topologies share it: CUDA contexts (about
# 0.5 GiB each), the allocator's slack and NCCL buffers, which no engine's memory fraction
# counts. 0.1 of an H200 is 14 GiB.
HEADROOM = 0.1
# Cores a booting worker keeps busy (tokenizer, weight loading, compilation threads).
CORES_PER_WORKER = 2


@dataclass(frozen=True)
class BootSchedule:
    mode: str                                   # "serial" | "together" | "waves"
    waves: tuple[tuple, ...]                    # keys, in test order, wave by wave
    reason: str
    shares: dict = field(default_factory=dict)  # device -> share planned per wave (for the record)

    def wave_of(self, key) -> int:
        for i, w in enumerate(self.waves):
            if key in w:
                return i
        raise KeyError(key)

    @property
    def together(self) -> bool:
        return any(len(w) > 1 for w in self.waves)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason,
                "waves": [[key_name(k) for k in w] for w in self.waves],
                "shares": {str(k): v for k, v in self.shares.items()}}


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


def serial(keys, reason: str) -> BootSchedule:
    return BootSchedule("serial", tuple((k,) for k in keys), reason)


def schedule(keyed_plans, backend: str, free_share: dict[int, float] | None,
             cores: int, headroom: float = HEADROOM,
             cores_per_worker: int = CORES_PER_WORKER,
             alone: dict | None = None, held: dict | None = None) -> BootSchedule:
    """keyed_plans: [(key, Plan)] in test order. `alone`: key -> why it must boot with no
    other topology beside it (its engine's Engine.alone_reason). `held`: key -> the share
    its workers hold on each device where that is not the sum of their planned fractions
    (Engine.held_share; default device_share). See the module's doc for the rules."""
    keyed_plans = list(keyed_plans)
    keys = [k for k, _ in keyed_plans]
    alone = alone or {}
    held = held or {}
    if len(keys) < 2:
        return serial(keys, f"{len(keys)} shared topology: nothing to boot together")
    if backend != "cuda":
        return serial(keys, f"backend {backend}: workers share {cores} core(s), and overlapping "
                            "boots lost 68-74 % against serial on 2 cores "
                            "(scripts/bench_overlap.py)")
    if free_share is None:
        return serial(keys, "GPU free memory unknown (no NVML): booted one after another")
    max_workers = max(1, cores // cores_per_worker)
    waves: list[list] = []
    used: list[dict[int, float]] = []
    workers: list[int] = []
    for i, (key, plan) in enumerate(keyed_plans):
        need = held.get(key) or device_share(plan)
        n = len(plan.entries)
        room = {d: free_share.get(d, 0.0) - headroom for d in need}
        fits = (waves and workers[-1] + n <= max_workers
                and key not in alone and keyed_plans[i - 1][0] not in alone
                and all(used[-1].get(d, 0.0) + s <= room[d] + 1e-9 for d, s in need.items()))
        if fits:
            waves[-1].append(key)
            workers[-1] += n
            for d, s in need.items():
                used[-1][d] = round(used[-1].get(d, 0.0) + s, 6)
        else:
            waves.append([key])
            workers.append(n)
            used.append(dict(need))
    shares = {i: u for i, u in enumerate(used)}
    frees = ", ".join(f"GPU {d} {s:.2f} free" for d, s in sorted(free_share.items()))
    if len(waves) == 1:
        return BootSchedule("together", (tuple(waves[0]),),
                            f"every topology fits at once ({_shares(used[0])} of the device "
                            f"planned; {frees}; headroom {headroom:g}; {workers[0]} worker(s), "
                            f"{cores} cores)", shares)
    why_alone = "; ".join(sorted({f"{key_name(k).split('/')[0]} boots alone: {w}"
                                  for k, w in alone.items() if k in keys}))
    if all(len(w) == 1 for w in waves):
        return BootSchedule("serial", tuple(tuple(w) for w in waves),
                            why_alone or
                            f"no two topologies fit at once ({frees}; headroom {headroom:g}; "
                            f"at most {max_workers} worker(s) booting on {cores} cores)", shares)
    return BootSchedule("waves", tuple(tuple(w) for w in waves),
                        f"{len(waves)} waves that fit ({frees}; headroom {headroom:g}; at most "
                        f"{max_workers} worker(s) booting on {cores} cores)"
                        + (f"; {why_alone}" if why_alone else ""), shares)


def _shares(used: dict[int, float]) -> str:
    return ", ".join(f"GPU {d} {s:.2f}" for d, s in sorted(used.items()))
