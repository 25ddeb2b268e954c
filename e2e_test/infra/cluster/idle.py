"""Idle verification: every role's running and waiting requests and KV-cache usage, from its
own metrics, and a wait that fails naming the role and the numbers.

The gauge names are engine knowledge: each engine module says them in `IDLE_GAUGES`
({"running": ..., "waiting": ..., "kv_cache_usage": ...}, KV usage as a 0-1 fraction). The
gateway's per-worker in-flight count (`gateway.ACTIVE_REQUESTS`) is checked too, so a request
that smg still holds (a stream it never closed upstream) counts as not idle.

    rep = idle.wait_idle(cluster, timeout=30)      # IdleError when not idle in time
    rep.seconds, rep.loads                         # how long it took, what each role said
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from ..errors import HarnessError
from ..specs import settings
from . import gateway as gw
from . import metrics

# KV-cache usage (0-1) at or below which a worker counts as idle. An idle vLLM worker reports
# exactly 0.0 (freed blocks that stay in the prefix cache count as free); one leaked request of
# a 64-token prompt on the CPU lane's 2 GiB cache holds about 0.001 of it.
KV_IDLE_MAX = float(settings.get("E2E_IDLE_KV_MAX"))
# How long a cluster may take to settle after a test's traffic (E2E_IDLE_TIMEOUT_S).
DEFAULT_TIMEOUT_S = float(settings.get("E2E_IDLE_TIMEOUT_S"))


class IdleError(HarnessError):
    """A role still holds requests or KV blocks after traffic ended."""


@dataclass
class Load:
    name: str                     # worker name, or "gateway"
    role: str
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    active: float | None = None   # gateway only: requests smg has in flight to workers
    error: str = ""

    def problems(self, kv_max: float = KV_IDLE_MAX) -> list[str]:
        if self.error:
            return [self.error]
        out = []
        for what, v in (("running", self.running), ("waiting", self.waiting),
                        ("in flight", self.active)):
            if v is not None and v > 0:
                out.append(f"{what} {v:.0f}")
        if self.kv_cache_usage is not None and self.kv_cache_usage > kv_max:
            out.append(f"kv_cache_usage {self.kv_cache_usage:.4f} (> {kv_max:g})")
        return out

    def describe(self) -> str:
        if self.error:
            return f"{self.name}: {self.error}"
        parts = [f"{k} {v:.4g}" for k, v in (("running", self.running),
                                            ("waiting", self.waiting),
                                            ("kv_cache_usage", self.kv_cache_usage),
                                            ("in flight", self.active)) if v is not None]
        return f"{self.name}: " + ", ".join(parts)


@dataclass
class IdleReport:
    seconds: float
    polls: int
    loads: list[Load] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "polls": self.polls,
                "loads": [asdict(x) for x in self.loads]}


def gauges_of(cluster) -> dict[str, str] | None:
    """The engine module's idle gauge names, or None when it names none."""
    return cluster.driver.idle_gauges


def worker_load(worker, gauges: dict[str, str], timeout: float = 3.0) -> Load:
    ld = Load(worker.name, worker.entry.role)
    try:
        s = worker.metrics(timeout=timeout)
    except (httpx.HTTPError, OSError, ValueError) as e:   # down, refused, unparsable
        ld.error = f"metrics not answering ({type(e).__name__}: {str(e)[:120]})"
        return ld
    present = {n for n, _ in s}
    missing = [g for g in gauges.values() if g not in present]
    if missing:
        ld.error = f"reports no {', '.join(missing)}"
        return ld
    for key, name in gauges.items():
        setattr(ld, key, metrics.total(s, name))
    return ld


def gateway_load(cluster, timeout: float = 3.0) -> Load:
    ld = Load("gateway", "gateway")
    try:
        s = metrics.scrape(cluster.gateway_metrics_url, timeout=timeout)
    except (httpx.HTTPError, OSError, ValueError) as e:   # down, refused, unparsable
        ld.error = f"metrics not answering ({type(e).__name__}: {str(e)[:120]})"
        return ld
    if any(n == gw.ACTIVE_REQUESTS for n, _ in s):   # smg exports it once a worker served
        ld.active = metrics.total(s, gw.ACTIVE_REQUESTS)
    return ld


def snapshot(cluster, gateway: bool = True) -> list[Load]:
    """One Load per worker that serves metrics (and the gateway), scraped in parallel."""
    gauges = gauges_of(cluster)
    if not gauges:
        raise IdleError(f"engine {cluster.engine!r} names no idle gauges (Engine.idle_gauges in its "
                        "engine module): idleness cannot be verified")
    skip = cluster.driver.idle_skip_roles
    workers = [w for w in cluster.workers if w.process and w.entry.role not in skip]
    if not workers:          # the gateway alone would pass: a verdict over nothing
        raise IdleError(f"topology {cluster.topology.name} ({cluster.engine}): no running "
                        "worker to read (none started, or every role's idle check skipped): "
                        "idleness cannot be verified")
    jobs = [lambda w=w: worker_load(w, gauges) for w in workers]
    if gateway and cluster.gateway is not None:
        jobs.append(lambda: gateway_load(cluster))
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as ex:
        return list(ex.map(lambda f: f(), jobs))


def busy(loads: list[Load], kv_max: float = KV_IDLE_MAX) -> list[str]:
    return [f"{x.name} ({', '.join(p)})" for x in loads if (p := x.problems(kv_max))]


def wait_idle(cluster, timeout: float = DEFAULT_TIMEOUT_S, kv_max: float = KV_IDLE_MAX,
              poll_s: float = 0.25, gateway: bool = True) -> IdleReport:
    """Poll until every role is idle; IdleError naming each busy role and its numbers."""
    t0 = time.monotonic()
    polls = 0
    while True:
        loads = snapshot(cluster, gateway=gateway)
        polls += 1
        bad = busy(loads, kv_max)
        elapsed = time.monotonic() - t0
        if not bad:
            return IdleReport(elapsed, polls, loads)
        if elapsed >= timeout:
            raise IdleError(
                f"topology {cluster.topology.name} ({cluster.engine}): not idle {timeout:.0f} s "
                f"after traffic: {'; '.join(bad)}",
                "every role: " + "; ".join(x.describe() for x in loads))
        time.sleep(poll_s)
